""" Fused Triton kernels for the divergence-corrected layers, and the switch between them and torch's operations

PatchNorm of a convolution `y = conv(x) + bias` costs one channel reduction of `x` (none for a depthwise map) and
one pass over `y` that applies the box filter to it and a fused slot's affine and activation:

    q = sum_{c in group} x^2,   b = (box(q) + offset) / c,   out = act(y rsqrt(b) + post_bias)

and its backward one pass over the output gradient `g` (giving the convolution's `g r` and the channel reduction
`t = r^3 sum_c ga y`, `ga = g act'`) and one update `dx -= x box^T(t) / c` of the convolution's input gradient that
applies the box filter's adjoint on `t` itself. All norms accumulate in float32; inputs may be float32, float16 or
bfloat16, NCHW or channels-last (read by their strides, never copied). `AffineDivLinear` is the case of rows, and
`l2_normalise` (L2NormLinear, L2Norm, standalone slots) `out = x rsqrt(|x|^2 / c + eps)`.

`dispatch` chooses the path (`TIMM_AFFINEDIV_KERNELS=auto|triton|torch`, `set_kernels`) and takes a kernel's failure,
`functional` holds the entry points the layers call, `ops` the torch custom ops, `passes` the output pass and `dx`
update they compose from the launchers, `_triton` the kernels and `_torch` their twins in torch's operations (what
the ops fall back to), `selfcheck` the comparison of the two before the kernels' first use, and `recording` the
Triton path traced on a CPU with its launches recorded instead of run (what the GPU scripts count and price).
"""
from ...errors import KernelError
from .dispatch import KERNEL_MODES, kernel_path, kernels_mode, set_kernels, triton_available, use_triton

__all__ = ['KERNEL_MODES', 'KernelError', 'kernel_path', 'kernels_mode', 'set_kernels', 'triton_available',
           'use_triton']

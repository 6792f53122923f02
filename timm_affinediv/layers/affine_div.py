""" Divergence-corrected affine maps: AffineDivLinear and PatchNormConv2d (PatchNorm)

An affine layer `z = W x + b` trained by steepest descent moves its output by `-eta * g * (|x|^2 + 1)`: every sample
(and, for a convolution, every output position, through its input patch `P_p`) gets its own effective learning
rate. Dividing the map by the norm of its augmented input `a = [x; 1]` removes that factor:

    z = (W x + b) / s(x),    s(x)^2 = |a|^2 / c

so one SGD step moves `z` by exactly `-eta * c * g`, the same for every sample and position. `scale="rms"` takes
`c = m` (the length of `a`: fan-in, plus one with a bias), so `s` is the root mean square of `a` and activations keep
the size of a plain layer; `scale="l2"` takes `c = 1`, the literal steepest-descent step. Without a bias `a = x` and a
tiny `eps` guards 0/0.

Norms are computed in float32 whatever the input dtype, so float16/bfloat16 do not overflow. Depthwise convolutions
and linear maps with a wider output train through autograd Functions of their own, with fewer passes and
temporaries than autograd through the same operations.

Under `torch.jit.script`, `torch.export` and both ONNX exporters (`portable_ops()`), the layers compute the same
function with plain operations every one of them supports: no autograd Functions, no in-place `out=`, no
`avg_pool2d(divisor_override=)` (which the dynamo ONNX exporter drops without an error) and no `vecdot` (which the
TorchScript-based ONNX exporter lacks).

Reference: "The Affine Divergence: Aligning Activation Updates Beyond Normalisation", ICLR 2026 GRaM workshop
(arXiv 2512.22247).
"""
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module

from ..errors import OptionError, ShapeError
from .kernels import functional, use_triton
from .patches import at_least_float32, patch_sq_norm, portable_ops, sq_norm

__all__ = ['AffineDivLinear', 'PatchNormConv2d', 'divergence_constant', 'standardised_weight']

#: the variance guard of the weight standardisation, timm's `ScaledStdConv2d`'s
WEIGHT_STD_EPS = 1e-6


def check_scale(scale: str) -> str:
    """`scale` where it is 'rms' or 'l2', the two a divergence-corrected layer takes (`OptionError` otherwise)."""
    # written in what TorchScript compiles: l2_normalise checks its scale in forward
    if scale != 'rms' and scale != 'l2':
        raise OptionError(f"scale must be 'rms' or 'l2', got '{scale}'")
    return scale


def divergence_constant(fan_in: int, bias: bool, scale: str) -> int:
    """The constant `c` every update is scaled by: `m = fan_in (+1 with bias)` for "rms", 1 for "l2"."""
    check_scale(scale)
    return unchecked_constant(fan_in, bias, scale)


def unchecked_constant(fan_in: int, bias: bool, scale: str) -> int:
    """`divergence_constant` without checking `scale` (its caller has), in what TorchScript compiles."""
    return fan_in + int(bias) if scale == 'rms' else 1


def norm_offset(bias: bool, eps: float) -> float:
    """What `|a|^2` adds to `|x|^2`: the bias's constant 1 in `a = [x; 1]`, else `eps` against 0/0."""
    return 1.0 if bias else eps


# the shape checks below are written in what TorchScript compiles (no tuple(), no !r in f-strings)
def check_last_dim(x: torch.Tensor, features: int, name: str) -> None:
    """Refuse (`ShapeError`) an input to the layer `name` whose last dimension is not its `features`."""
    if x.dim() == 0 or x.shape[-1] != features:
        raise ShapeError(
            f"{name} expects inputs whose last dimension is in_features={features}, "
            f"got shape {list(x.shape)}")


def _check_nchw(x: torch.Tensor, channels: int, name: str) -> None:
    if x.dim() != 4:
        raise ShapeError(
            f"{name} expects a 4-D input (N, C, H, W), got shape {list(x.shape)}; "
            "add a batch dimension with x.unsqueeze(0)")
    if x.shape[1] != channels:
        raise ShapeError(f"{name} expects {channels} input channels, got shape {list(x.shape)}")


def inverse_scale(sq: torch.Tensor, c: int, offset: float) -> torch.Tensor:
    """`1 / s = ((|x|^2 + offset) / c)^(-1/2)`, in place on `sq`."""
    return sq.add_(offset).div_(c).rsqrt_()


def augmented_input(x: torch.Tensor, inv_s: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                    channel_dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """ `(x * inv_s, weight)` for a map applied per position, with `inv_s` appended as an input channel (along
    `channel_dim`) that the bias weights.

    `(W x + b) / s = [W b] [x / s; 1 / s]`: scaling the input instead of the output is cheaper when the output is
    wider, and leaves the map's own bias free for a fused slot's.
    """
    inv_s = inv_s.to(x.dtype)
    x = x * inv_s
    if bias is None:
        return x, weight
    bias_column = bias.view([-1, 1] + [1] * (weight.dim() - 2))
    return torch.cat([x, inv_s], dim=channel_dim), torch.cat([weight, bias_column], dim=1)


def standardised_weight(weight: torch.Tensor, eps: float = WEIGHT_STD_EPS) -> torch.Tensor:
    """ `(W - mean W) / sqrt(n (var W + eps))` per output channel (dim 0), over its fan-in of `n` entries: each row
    centred, at unit norm (timm's `ScaledStdConv2d` with gain 1). Computed in float32 at least, returned in `W`'s dtype.
    """
    flat = at_least_float32(weight.flatten(1))
    centred = flat - flat.mean(1, keepdim=True)
    variance = centred.pow(2).mean(1, keepdim=True)
    return (centred * torch.rsqrt((variance + eps) * float(flat.shape[1]))).to(weight.dtype).view_as(weight)


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`<a_m, b_m>` for every row of two (M, K) matrices, as (M, 1), without materialising `a * b`."""
    return torch.matmul(a.unsqueeze(1), b.unsqueeze(2)).squeeze(2)


def _apply_under_autocast(function, device_type: str, tensors: Tuple[Optional[torch.Tensor], ...], *args):
    """ `function.apply(*tensors, *args)` for the autograd Functions below, which run with autocast off.

    Where autocast is on for `device_type`, the tensors are cast to its dtype first, as autocast casts a
    convolution's or a GEMM's inputs.
    """
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        tensors = tuple(t if t is None or not t.is_floating_point() else t.to(dtype) for t in tensors)
    with torch.autocast(device_type, enabled=False):
        return function.apply(*tensors, *args)


class _WideAffineDivLinearFn(torch.autograd.Function):
    """ `(x W^T + b) / s(x) (+ post_bias)` for a matrix `x` of rows, when the output is wider than the input.

    The division goes on the narrower side: `x' = x / s`, `y = x' W^T + (1 / s) b^T`, a GEMM on `x'` and a
    rank-one bias term (no `[x'; 1/s]` input, whose odd width slows every GEMM). With `g = dL/dy`:

        dW = g^T x',   db = g^T (1/s),   dx = (g W - h x' / c) / s,   h = <g W, x'> + <g, b> / s

    per row, the last two terms being the gradient through `s` (`d(1/s)/dx = -x / (c s^3)`).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, post_bias, c: int, offset: float):
        inv_s = inverse_scale(sq_norm(x, -1), c, offset).to(x.dtype)
        x = x * inv_s
        if bias is None:
            y = F.linear(x, weight, post_bias)
        else:
            y = inv_s * bias if post_bias is None else torch.addcmul(post_bias, inv_s, bias)
            y.addmm_(x, weight.t())
        ctx.save_for_backward(x, inv_s, weight, bias)
        ctx.c, ctx.has_post_bias = c, post_bias is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, inv_s, weight, bias = ctx.saved_tensors
        needs_x, needs_weight, needs_bias, needs_post_bias = ctx.needs_input_grad[:4]
        grad_x = grad_weight = grad_bias = grad_post_bias = None
        if needs_weight:
            grad_weight = grad.t() @ x
        if bias is not None and needs_bias:
            grad_bias = grad.t() @ inv_s.squeeze(1)
        if ctx.has_post_bias and needs_post_bias:
            grad_post_bias = grad.sum(0)
        if needs_x:
            grad_x = grad @ weight
            h = _rowdot(grad_x, x)
            if bias is not None:
                h.addcmul_(inv_s, grad @ bias.unsqueeze(1))
            grad_x.addcmul_(x, h, value=-1. / ctx.c).mul_(inv_s)
        return grad_x, grad_weight, grad_bias, grad_post_bias, None, None


class _DepthwisePatchNormFn(torch.autograd.Function):
    """ A depthwise PatchNormConv2d (one input channel per output channel, zero padding) with autograd.

    `y = conv(x) r (+ post_bias)`, `r = (box(x^2) / c + offset / c)^(-1/2)` per channel and position
    (`box` the kernel-window sum, with the convolution's geometry). With `g = dL/dy`:

        dL/dconv(x) = g r,    dL/dx += -x box^T(g conv(x) r^3) / c

    `box^T` being the box filter's adjoint. Autograd through the same ops would keep `x^2` and `r^3` and
    allocate every product; this keeps `x`, `conv(x)` and `r`, and its backward makes five elementwise
    passes besides the two convolutions.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, post_bias, c: int, offset: float, stride, padding, dilation):
        channels, kernel_size = x.shape[1], weight.shape[2:]
        box_padding = (padding[1], padding[1], padding[0], padding[0])
        inv_s = patch_sq_norm(x, kernel_size, stride, box_padding, dilation, channels, c, offset / c).rsqrt_()
        y = F.conv2d(x, weight, bias, stride, padding, dilation, channels)
        inv_s_y = inv_s.to(y.dtype)
        out = y * inv_s_y if post_bias is None else torch.addcmul(post_bias.view(-1, 1, 1), y, inv_s_y)
        ctx.save_for_backward(x, weight, y, inv_s)
        ctx.c, ctx.geometry, ctx.has_bias, ctx.has_post_bias = c, (stride, padding, dilation), \
            bias is not None, post_bias is not None
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, y, inv_s = ctx.saved_tensors
        (stride, padding, dilation), channels = ctx.geometry, x.shape[1]
        needs_x, needs_weight, needs_bias, needs_post_bias = ctx.needs_input_grad[:4]
        grad_y = grad * inv_s.to(grad.dtype)
        grad_x, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            grad_y, x, weight, [weight.shape[0]] if ctx.has_bias else None, stride, padding, dilation,
            False, (0, 0), channels, (needs_x, needs_weight, needs_bias and ctx.has_bias))
        if needs_x:
            # g conv(x) r^3 = (g r) conv(x) r^2, in grad_y's buffer (the convolution is done with it); the -1/c
            # (the -1/2 of rsqrt times the 2 of x^2) rides in the kernel of the box filter's adjoint
            dr = grad_y.mul_(y).to(inv_s.dtype).mul_(inv_s).mul_(inv_s)
            kernel = dr.new_full((channels, 1) + tuple(weight.shape[2:]), -1. / ctx.c)
            if stride == (1, 1) and all(2 * p == d * (k - 1) for p, d, k in zip(padding, dilation, kernel.shape[2:])):
                # a "same" box filter is its own adjoint, and its forward is the cheaper kernel
                box_adjoint = F.conv2d(dr, kernel, None, stride, padding, dilation, channels)
            else:
                # the adjoint is the box filter's input gradient; given x (not a stand-in of x's shape) it keeps
                # x's memory format, which the accumulation into grad_x needs to be one fast pass
                box_adjoint = torch.ops.aten.convolution_backward(
                    dr, x.to(dr.dtype), kernel, None, stride, padding, dilation, False, (0, 0), channels,
                    (True, False, False))[0]
            grad_x.addcmul_(x, box_adjoint)
        grad_post_bias = grad.sum((0, 2, 3)) if ctx.has_post_bias and needs_post_bias else None
        return grad_x, grad_weight, grad_bias, grad_post_bias, None, None, None, None, None


def _drop_fused_slot_keys(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """A layer's state dict without its fused slot's entries: they are the slot's, under the slot's own name."""
    for key in [k for k in state_dict if k.startswith(prefix + 'fused_slot.')]:
        del state_dict[key]
    getattr(state_dict, '_metadata', {}).pop(prefix + 'fused_slot', None)


def _ignore_fused_slot_keys(module: nn.Module, incompatible_keys: Any) -> None:
    """Loading a state dict: the fused slot's entries are expected under the slot's own name, not the layer's."""
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if '.fused_slot.' not in k and not k.startswith('fused_slot.')]


class _DivergenceCorrected:
    """ What AffineDivLinear and PatchNormConv2d share: the scaling, and a fused per-channel affine.

    A bound `patchnorm` slot right after the layer becomes the layer's submodule `fused_slot`
    (`fuse_post_affine`), and the layer computes `slot.weight * z + slot.bias` in the same pass as the division
    by `s`: TorchScript, torch.export and the ONNX exporters see the slot as any submodule, so scripted and
    eager layers apply the affine in the same place. The slot stays the model's where the model has it: the
    layer's `named_modules` (so `modules`, `named_parameters`, `parameters`) does not descend into it, and its
    state dict leaves it out, so every parameter keeps its one name (`bn1.weight`, not `conv1.fused_slot.weight`).
    """

    def _init_fusion(self) -> None:
        self.fused_slot = None
        self.standardise_weight = False
        self.register_state_dict_post_hook(_drop_fused_slot_keys)
        self.register_load_state_dict_post_hook(_ignore_fused_slot_keys)

    # whether the Triton path applies a fused `PatchNormAct2d`'s activation too (the slot then skips it)
    applies_slot_activation = False

    def fuse_post_affine(self, slot: Optional[nn.Module]) -> None:
        """Apply `slot`'s per-channel affine after the division (None: stop applying one)."""
        if self.fused_slot is not None:
            self.fused_slot.activation_in_producer = False
        self.fused_slot = slot
        if slot is not None:
            slot.activation_in_producer = self.applies_slot_activation

    def named_modules(self, memo: Optional[set] = None, prefix: str = '', remove_duplicate: bool = True):
        """`nn.Module.named_modules` without the fused slot: it is listed where the model has it."""
        if memo is None:
            memo = set()
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        for name, module in self._modules.items():
            if module is not None and name != 'fused_slot':
                yield from module.named_modules(memo, f'{prefix}.{name}' if prefix else name, remove_duplicate)

    def _weight(self) -> torch.Tensor:
        """The weight the map applies: `weight`, or, where `standardise_weight` (a `patchnorm_ws` slot's producer),
        `standardised_weight(weight)`: the output then no longer grows with the weight's scale, a different function
        from the paper's."""
        return standardised_weight(self.weight) if self.standardise_weight else self.weight

    def _fused_params(self) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(weight, bias, post_bias): the layer's parameters with a fused slot's gain folded in."""
        weight, bias, slot = self._weight(), self.bias, self.fused_slot
        if slot is None:
            return weight, bias, None
        gain = slot.weight.to(weight.dtype)
        weight = weight * gain.view([-1] + [1] * (weight.dim() - 1))
        return weight, None if bias is None else bias * gain, slot.bias.to(weight.dtype)

    def _slot_affine(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(gain, post_bias): the fused slot's affine as it is, for the kernels' output pass (None without a slot)."""
        slot = self.fused_slot
        return (None, None) if slot is None else (slot.weight, slot.bias)

    def _scale_output(self, y: torch.Tensor, inv_s: torch.Tensor, post_bias: Optional[torch.Tensor],
                      channel_dim: int, groups: int = 1) -> torch.Tensor:
        """ `y * inv_s (+ post_bias)`, one pass; `inv_s` has one channel per group along `channel_dim`.

        Without autograd (inference) `y` is scaled in place: a fresh output tensor costs more than the pass.
        """
        inv_s = inv_s.to(y.dtype)
        grouped = inv_s.shape[channel_dim] != 1 and inv_s.shape[channel_dim] != y.shape[channel_dim]
        bias_shape = [-1] + [1] * (y.dim() - channel_dim - 1 if channel_dim >= 0 else 0)
        if grouped:
            y, inv_s, bias_shape = y.unflatten(channel_dim, [groups, -1]), inv_s.unsqueeze(channel_dim + 1), \
                [groups] + bias_shape
        if portable_ops() or torch.is_grad_enabled():
            y = y * inv_s if post_bias is None else torch.addcmul(post_bias.to(y.dtype).view(bias_shape), y, inv_s)
        elif post_bias is None:
            y = torch.mul(y, inv_s, out=y)
        else:
            y = torch.addcmul(post_bias.to(y.dtype).view(bias_shape), y, inv_s, out=y)
        return y.flatten(channel_dim, channel_dim + 1) if grouped else y

    @torch.jit.unused
    def _uses_kernels(self, x: torch.Tensor) -> bool:
        """Whether this forward takes the fused Triton kernels (`kernels.dispatch`)."""
        return use_triton(x)

    @torch.jit.unused
    def _wide_linear(self, rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     post_bias: Optional[torch.Tensor]) -> torch.Tensor:
        """`(W x + b) / s(x) (+ post_bias)` for every row `x` of a matrix, divided on the input side."""
        return _apply_under_autocast(
            _WideAffineDivLinearFn, rows.device.type, (rows, weight, bias, post_bias),
            self.divergence_constant, norm_offset(bias is not None, self.eps))


@register_notrace_module  # a leaf for timm's FX feature extraction, like its own norm layers
class AffineDivLinear(_DivergenceCorrected, nn.Linear):
    """ Divergence-corrected linear layer, a drop-in for `nn.Linear`.

    `y = (W x + b) / s(x)` over the last dimension, `s(x)^2 = (|x|^2 + 1) / c`
    (`(|x|^2 + eps) / c` without bias), `c = in_features + 1` for `scale="rms"`, 1 for "l2".
    One SGD step on `weight` and `bias` moves `y` by `-lr * c * dL/dy` for every sample.
    Inputs may have any leading shape.
    """

    def __init__(
            self,
            in_features: int,
            out_features: int,
            bias: bool = True,
            scale: str = 'rms',
            eps: float = 1e-12,
            device=None,
            dtype=None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.scale = check_scale(scale)
        self.eps = eps
        self._init_fusion()

    @property
    def divergence_constant(self) -> int:
        return unchecked_constant(self.in_features, self.bias is not None, self.scale)

    def inv_scale(self, x: torch.Tensor) -> torch.Tensor:
        """`1 / s(x)` in float32 (or float64), shape `x.shape[:-1] + (1,)`."""
        offset = norm_offset(self.bias is not None, self.eps)
        if torch.jit.is_scripting():
            # TorchScript does not apply autocast
            return inverse_scale(sq_norm(x, -1), self.divergence_constant, offset)
        else:
            with torch.autocast(x.device.type, enabled=False):
                return inverse_scale(sq_norm(x, -1), self.divergence_constant, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_last_dim(x, self.in_features, 'AffineDivLinear')
        if not portable_ops() and self._uses_kernels(x):
            return self._kernel_forward(x)
        weight, bias, post_bias = self._fused_params()
        if self.out_features > self.in_features + 1:
            if portable_ops():
                # exporters get the wide map on its scaled input: its bias is then the fused slot's alone, and
                # ONNX Runtime fuses it and the activation into the GEMM instead of two passes over the output
                x, weight = augmented_input(x, self.inv_scale(x), weight, bias, -1)
                return F.linear(x, weight, post_bias)
            y = self._wide_linear(x.reshape(-1, self.in_features), weight, bias, post_bias)
            return y.view(x.shape[:-1] + (self.out_features,))
        return self._scale_output(F.linear(x, weight, bias), self.inv_scale(x), post_bias, -1)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward on the fused Triton kernels, with the fused slot's affine in the output pass."""
        gain, post_bias = self._slot_affine()
        return functional.affine_div_linear(x, self._weight(), self.bias, gain, post_bias, self.divergence_constant,
                                            norm_offset(self.bias is not None, self.eps))

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, scale={self.scale}' + (', standardised weight' if self.standardise_weight
                                                               else '')

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale: str = 'rms') -> 'AffineDivLinear':
        """The divergence-corrected form of `linear`, sharing its parameters."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, scale=scale,
                  device='meta')
        new.weight = linear.weight
        new.bias = linear.bias
        return new


@register_notrace_module
class PatchNormConv2d(_DivergenceCorrected, nn.Conv2d):
    """ PatchNorm: the divergence-corrected convolution, a drop-in for `nn.Conv2d`.

    `y_p = (W * x + b)_p / s(P_p)`, `s(P)^2 = (|P|^2 + 1) / c` (`(|P|^2 + eps) / c` without bias),
    where `P_p` is the input patch output position `p` reads (its group's channels times the
    kernel window, zero padding included) and `c = C_in / groups * kh * kw (+ 1)` for
    `scale="rms"`, 1 for "l2". One SGD step on `weight` and `bias` moves every position of every
    sample by `-lr * c * dL/dy`. All strides, paddings (ints, tuples, "same", "valid"), dilations,
    group counts (depthwise included) and padding modes are exact: non-zero padding modes pad
    the input first, so the patches are what the convolution reads.
    """
    applies_slot_activation = True

    def __init__(
            self,
            in_channels: int,
            out_channels: int,
            kernel_size: Union[int, Tuple[int, int]],
            stride: Union[int, Tuple[int, int]] = 1,
            padding: Union[str, int, Tuple[int, int]] = 0,
            dilation: Union[int, Tuple[int, int]] = 1,
            groups: int = 1,
            bias: bool = True,
            padding_mode: str = 'zeros',
            scale: str = 'rms',
            eps: float = 1e-12,
            device=None,
            dtype=None,
    ):
        valid_modes = ('zeros', 'reflect', 'replicate', 'circular')
        if padding_mode not in valid_modes:
            raise OptionError(
                f"PatchNormConv2d supports padding_mode in {valid_modes}, got {padding_mode!r}")
        super().__init__(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
            groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self.scale = check_scale(scale)
        self.eps = eps
        self._init_fusion()

    @property
    def divergence_constant(self) -> int:
        fan_in = self.in_channels // self.groups * self.kernel_size[0] * self.kernel_size[1]
        return unchecked_constant(fan_in, self.bias is not None, self.scale)

    def inv_scale(self, x: torch.Tensor, padding: Tuple[int, int, int, int]) -> torch.Tensor:
        """`1 / s(P_p)` in float32 (or float64), `(N, groups, H_out, W_out)`, for `x` padded by `padding`."""
        c = self.divergence_constant
        scaled_sq_norm = patch_sq_norm(  # (|P|^2 + 1) / c
            x, self.kernel_size, self.stride, padding, self.dilation, self.groups,
            divisor=c, offset=norm_offset(self.bias is not None, self.eps) / c)
        return scaled_sq_norm.rsqrt_()

    @property
    def _depthwise(self) -> bool:
        return self.groups == self.in_channels and self.groups == self.out_channels

    @property
    def _wide_pointwise(self) -> bool:
        """A 1x1 map, stride 1, no padding, to more channels than its augmented input has."""
        return self.kernel_size == (1, 1) and self.stride == (1, 1) and self.groups == 1 and \
            sum(self._reversed_padding_repeated_twice) == 0 and self.out_channels > self.in_channels + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_nchw(x, self.in_channels, 'PatchNormConv2d')
        pads = self._reversed_padding_repeated_twice  # (left, right, top, bottom)
        if self.padding_mode != 'zeros' or pads[0] != pads[1] or pads[2] != pads[3]:
            # non-zero padding modes pad the input first, so the patches are what the convolution reads; an
            # asymmetric "same" padding is applied here as F.conv2d would, so the convolution pads symmetrically
            x = F.pad(x, pads, mode='constant' if self.padding_mode == 'zeros' else self.padding_mode)
            pads = [0, 0, 0, 0]
        if not portable_ops() and self._uses_kernels(x):
            return self._kernel_forward(x, (pads[2], pads[0]))
        weight, bias, post_bias = self._fused_params()
        if self._wide_pointwise and portable_ops():
            # as AffineDivLinear's wide map: ONNX Runtime then fuses the slot's bias, the activation and a residual
            # sum into the convolution
            x, weight = augmented_input(x, self.inv_scale(x, (0, 0, 0, 0)), weight, bias, 1)
            return F.conv2d(x, weight, post_bias)
        if torch.is_grad_enabled() and (self._depthwise or self._wide_pointwise) and not portable_ops():
            return self._training_forward(x, weight, bias, post_bias, (pads[2], pads[0]))
        y = F.conv2d(x, weight, bias, self.stride, (pads[2], pads[0]), self.dilation, self.groups)
        inv_s = self.inv_scale(x, (pads[0], pads[1], pads[2], pads[3]))
        return self._scale_output(y, inv_s, post_bias, 1, self.groups)

    @torch.jit.unused
    def _training_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                          post_bias: Optional[torch.Tensor], padding: Tuple[int, int]) -> torch.Tensor:
        """ The forward of a depthwise or a wide pointwise map under autograd, with fewer passes and temporaries.

        The depthwise map trains through its own autograd Function; a wider pointwise map is cheaper on its
        scaled input (in inference, where the output is scaled in place, the odd channel count of the augmented
        input costs more than it saves).
        """
        if self._depthwise:
            return _apply_under_autocast(
                _DepthwisePatchNormFn, x.device.type, (x, weight, bias, post_bias), self.divergence_constant,
                norm_offset(bias is not None, self.eps), self.stride, padding, self.dilation)
        if x.is_contiguous(memory_format=torch.channels_last):
            # channels-last memory is a matrix of pixels: the wide linear map's, with no augmented input,
            # and the output stays channels-last
            n, _, h, w = x.shape
            rows = x.permute(0, 2, 3, 1).reshape(-1, self.in_channels)
            y = self._wide_linear(rows, weight.flatten(1), bias, post_bias)
            return y.view(n, h, w, self.out_channels).permute(0, 3, 1, 2)
        x, weight = augmented_input(x, self.inv_scale(x, (0, 0, 0, 0)), weight, bias, 1)
        return F.conv2d(x, weight, post_bias)

    @torch.jit.unused
    def _kernel_forward(self, x: torch.Tensor, padding: Tuple[int, int]) -> torch.Tensor:
        """ The forward on the fused Triton kernels, with the fused slot's affine (its gain in the output pass, not
        folded into the weight) and its activation where the kernel can take it."""
        gain, post_bias = self._slot_affine()
        act = 'none' if self.fused_slot is None else self.fused_slot.kernel_activation()
        return functional.patchnorm_conv2d(
            x, self._weight(), self.bias, gain, post_bias, self.stride, padding, self.dilation, self.groups,
            self.divergence_constant, norm_offset(self.bias is not None, self.eps), act)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, scale={self.scale}' + (', standardised weight' if self.standardise_weight
                                                               else '')

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, scale: str = 'rms', bias: Optional[bool] = None) -> 'PatchNormConv2d':
        """ The PatchNorm form of `conv`, sharing its weight (and bias).

        `bias=True` gives a convolution without one a zero-initialised pre-division bias, so the
        divergence factor is exactly `c` (the augmented patch `[P; 1]`).
        """
        bias = conv.bias is not None if bias is None else bias
        padding = conv.padding if isinstance(conv.padding, str) else tuple(conv.padding)
        new = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride, padding=padding,
            dilation=conv.dilation, groups=conv.groups, bias=False, padding_mode=conv.padding_mode,
            scale=scale, device='meta')
        new.weight = conv.weight
        if conv.bias is not None:
            new.bias = conv.bias
        elif bias:
            new.bias = nn.Parameter(conv.weight.new_zeros(conv.out_channels))
        return new

""" The square norms of a convolution's input patches, and when the layers take their portable operations

`|P_p|^2` of every output position `p` is a channel sum of `x^2` per group (`channel_sq_norm`) and a box filter with
the convolution's geometry (`box_sum`): the torch path of the layers and the Triton path's custom ops both build on
them, so they sit below both.
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = ['portable_ops', 'at_least_float32', 'is_channels_last', 'sq_norm', 'channel_sq_norm', 'box_sum',
           'patch_sq_norm', 'BoxFilter']


def portable_ops() -> bool:
    """ Whether the forward is being scripted or exported (`torch.jit.script`, `torch.export`, ONNX).

    Then the layers take the operations every exporter supports, computing the same function as their
    eager route.
    """
    if torch.jit.is_scripting():
        return True
    else:
        return torch.compiler.is_exporting() or torch.onnx.is_in_onnx_export()


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32, or as it is if wider (float64): the dtype norms are taken in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def is_channels_last(x: torch.Tensor) -> bool:
    """Whether `x` is a 4-d tensor laid out channels-last and not also contiguous (a map whose strides say NHWC)."""
    return x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)


# squares are written `x * x` throughout: `square()` is exported as Pow, which ONNX Runtime runs several times
# slower than Mul
def sq_norm(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`|x|^2` over `dim`, kept as a dimension of size 1, in float32 or wider."""
    if portable_ops():
        x = at_least_float32(x)
        return (x * x).sum(dim, keepdim=True)
    if x.stride(dim) == 1:
        # over contiguous elements the norm kernel is fastest, and it does not materialise x^2
        dtype = torch.promote_types(x.dtype, torch.float32)
        return torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=dtype).square()
    # over strided elements (the channels of an NCHW tensor) vecdot's kernel is several times faster
    x = at_least_float32(x)
    return torch.linalg.vecdot(x, x, dim=dim).unsqueeze(dim)


def channel_sq_norm(x: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """`|x|^2` over the channels of each group of an (N, C, H, W) tensor: (N, groups, H, W), float32 or wider."""
    if groups == x.shape[1]:
        x = at_least_float32(x)
        return x * x
    if groups == 1:
        return sq_norm(x, 1)
    return sq_norm(x.unflatten(1, (groups, -1)), 2).squeeze(2)


def box_sum(
        x: torch.Tensor,
        kernel_size: Tuple[int, int],
        stride: Tuple[int, int] = (1, 1),
        padding: Tuple[int, int, int, int] = (0, 0, 0, 0),
        dilation: Tuple[int, int] = (1, 1),
        divisor: int = 1,
        offset: float = 0.,
        channels: Optional[int] = None,
) -> torch.Tensor:
    """ `sum(x) / divisor + offset` over every window of a convolution's geometry, per channel.

    `padding` is (left, right, top, bottom). The division and offset ride in the filter's kernel and
    bias, so the affine step that follows a box filter costs no pass of its own. `channels`, x's channel
    count where the caller knows it, keeps the filter's kernel a constant in exported graphs.
    """
    (kh, kw), (left, right, top, bottom) = kernel_size, padding
    if left == right and top == bottom:
        pad = (top, left)
    else:
        x, pad = F.pad(x, padding), (0, 0)
    if channels is None:
        channels = x.shape[1]
    # avg_pool2d is the faster box filter for a few channels, a grouped conv with a ones kernel for many
    if dilation == (1, 1) and pad[0] <= kh // 2 and pad[1] <= kw // 2 and channels <= 4:
        if portable_ops():
            # the dynamo ONNX exporter drops divisor_override without an error: divide by the window area (zero
            # padding counted, as in the convolution's patches), then rescale
            return F.avg_pool2d(x, kernel_size, stride, pad) * (kh * kw / divisor) + offset
        out = F.avg_pool2d(x, kernel_size, stride, pad, divisor_override=divisor)
        return out.add_(offset) if offset else out
    kernel = x.new_full((channels, 1, kh, kw), 1. / divisor)
    bias = x.new_full((channels,), offset) if offset else None
    return F.conv2d(x, kernel, bias, stride=stride, padding=pad, dilation=dilation, groups=channels)


def patch_sq_norm(
        x: torch.Tensor,
        kernel_size: Tuple[int, int],
        stride: Tuple[int, int] = (1, 1),
        padding: Tuple[int, int, int, int] = (0, 0, 0, 0),
        dilation: Tuple[int, int] = (1, 1),
        groups: int = 1,
        divisor: int = 1,
        offset: float = 0.,
) -> torch.Tensor:
    """ `|P_p|^2 / divisor + offset` for every output position `p` of a convolution, per group, in float32
    (or float64).

    `P_p` is the im2col column that position `p` reads: the group's input channels times the
    kernel window, zero padding included. Computed as a channel sum of `x^2` per group and a
    box filter with the convolution's geometry. `padding` is `(left, right, top, bottom)`.
    Returns `(N, groups, H_out, W_out)`.
    """
    if kernel_size == (1, 1) and stride != (1, 1) and not any(padding) and not portable_ops():
        # a strided 1x1 convolution reads only every stride-th position: take the norms there alone (exported
        # graphs keep the stride in the box filter: a strided Slice of the input costs ONNX Runtime a copy, and the
        # full-resolution norms are those of the same input's other reader, e.g. a bottleneck's first convolution,
        # which ONNX Runtime's common-subexpression elimination then computes once)
        x, stride = x[:, :, ::stride[0], ::stride[1]], (1, 1)
    if torch.jit.is_scripting():
        # TorchScript does not apply autocast
        return box_sum(channel_sq_norm(x, groups), kernel_size, stride, padding, dilation, divisor, offset, groups)
    else:
        with torch.autocast(x.device.type, enabled=False):
            return box_sum(channel_sq_norm(x, groups), kernel_size, stride, padding, dilation, divisor, offset, groups)


@dataclass(frozen=True)
class BoxFilter:
    """ A convolution's window geometry as a box filter of a map with one channel per group (symmetric zero padding).

    Forward: `m[o] = sum_{p in window(o)} map[p] / divisor + offset` at every output position `o`. `adjoint`:
    `m[p] = sum_{o : p in window(o)} map[o]` at every input position `p` (divisor 1, offset 0), the forward's
    transpose. `squares`: the map is a depthwise convolution's input `x`, whose squares are filtered (its channel
    sums of `x^2`, one channel a group). `out`: where the forward's `m` is stored as well (the fused kernels apply
    the filter inside their output pass, and store it for the backward).
    """
    kernel_size: Tuple[int, int]
    stride: Tuple[int, int]
    padding: Tuple[int, int]
    dilation: Tuple[int, int]
    divisor: int = 1
    offset: float = 0.
    adjoint: bool = False
    squares: bool = False
    out: Optional[torch.Tensor] = None

    def __call__(self, m: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
        """The filtered map in torch's operations, `size` its (H, W): the output's, or the input's (`adjoint`)."""
        (ph, pw), (kh, kw) = self.padding, self.kernel_size
        if self.squares:
            m = channel_sq_norm(m, m.shape[1])
        if not self.adjoint:
            out = box_sum(m, self.kernel_size, self.stride, (pw, pw, ph, ph), self.dilation, self.divisor,
                          self.offset, m.shape[1])
            return out if self.out is None else self.out.copy_(out)
        (n, groups), (h, w) = m.shape[:2], size
        if self.dilation == (1, 1) and ph <= kh // 2 and pw <= kw // 2:
            # the adjoint of a window sum is the backward of an average pooling whose divisor is 1
            return torch.ops.aten.avg_pool2d_backward(
                m, m.new_empty((n, groups, h, w)), self.kernel_size, self.stride, self.padding, False, True, 1)
        # the transposed convolution's output is one row/column short where the forward's windows left input unread
        output_padding = [full - ((o - 1) * s - 2 * p + d * (k - 1) + 1) for full, o, s, p, d, k in zip(
            size, m.shape[2:], self.stride, self.padding, self.dilation, self.kernel_size)]
        return F.conv_transpose2d(m, m.new_ones((groups, 1, kh, kw)), None, self.stride, self.padding,
                                  output_padding, groups, self.dilation)

""" The passes every fused op composes from the launchers: a map's output pass and its `dx` update

`conv_output` gives a PatchNorm map's output and its patch norms `b`, `add_norm_grad` adds the norms' term to the
convolution's input gradient; `ops` runs them in the custom ops, and `selfcheck` on both sets of launchers (`_triton`
and its torch twins `_torch`) to compare them. `AffineDivLinear`'s rows are 1x1 maps.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..patches import BoxFilter

__all__ = ['conv_output', 'add_norm_grad']


def _pointwise(kernel_size: List[int], padding: List[int]) -> bool:
    return list(kernel_size) == [1, 1] and not any(padding)


def _box(kernel_size: List[int], stride: List[int], padding: List[int], dilation: List[int], **options) -> BoxFilter:
    return BoxFilter(tuple(kernel_size), tuple(stride), tuple(padding), tuple(dilation), **options)


def _separable(kernel_size: List[int]) -> bool:
    """Whether a window sums in two passes, along rows into a float32 map and then along columns: `kh + kw` loads an
    element instead of `kh kw`, for the windows larger than 3 x 3 (ConvNeXt's 7 x 7)."""
    kh, kw = kernel_size
    return kh > 1 and kw > 1 and kh * kw > 9


def _rows_and_columns(kernel_size: List[int], stride: List[int], padding: List[int],
                      dilation: List[int]) -> Tuple[List[List[int]], List[List[int]]]:
    """A window's geometry split into its rows' (1 x kw) and its columns' (kh x 1)."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel_size, stride, padding, dilation
    return [[1, kw], [1, sw], [0, pw], [1, dw]], [[kh, 1], [sh, 1], [ph, 0], [dh, 1]]


def conv_output(kernels, x: Tensor, y: Tensor, weight: Tensor, bias: Optional[Tensor], gain: Optional[Tensor],
                post_bias: Optional[Tensor], stride: List[int], padding: List[int], dilation: List[int], groups: int,
                c: int, offset: float, act: str) -> Tuple[Tensor, Tensor]:
    """ `(out, b)`: the output pass and `b = (|P_p|^2 + offset) / c` per group and output position, float32.

    A k x k map's box filter runs inside the output pass on the channel sums of `x^2` at the input positions (on
    `x` itself for a depthwise map), which stores `b` for the backward: no pooling, offset or fill launches of its
    own. `kernels`: the launchers (`_triton` or `_torch`)."""
    if _pointwise(weight.shape[2:], padding):
        # a 1x1 map reads only every stride-th position, and its box filter is the identity
        b = kernels.channel_sq_norm(x[:, :, ::stride[0], ::stride[1]], groups, 1. / c, offset / c)
        return kernels.scale(y, b, post_bias, act, gain=gain, bias=bias), b
    b = y.new_empty((y.shape[0], groups, *y.shape[2:]), dtype=torch.float32)
    # a depthwise map's channel sums are the squares themselves: the output pass filters them from `x`
    depthwise = groups == x.shape[1]
    q = x if depthwise else kernels.channel_sq_norm(x, groups)
    if _separable(weight.shape[2:]):
        rows, columns = _rows_and_columns(weight.shape[2:], stride, padding, dilation)
        q = kernels.box_filter(q, _box(*rows, squares=depthwise), (x.shape[2], y.shape[3]))
        box = _box(*columns, divisor=c, offset=offset / c, out=b)
    else:
        box = _box(weight.shape[2:], stride, padding, dilation, divisor=c, offset=offset / c, squares=depthwise, out=b)
    return kernels.scale(y, q, post_bias, act, gain=gain, bias=bias, box=box), b


def add_norm_grad(kernels, grad_x: Tensor, x: Tensor, t: Tensor, kernel_size: List[int], stride: List[int],
                  padding: List[int], dilation: List[int], c: int, partials: Optional[Tensor]) -> Optional[Tensor]:
    """ `grad_x -= x box^T(t) / c`, in place; `t` holds one channel per group at the output positions. Returns
    `partials` (`scale_backward`'s, K x R x C) summed over dim 1, in the same launch (None without them), by
    `kernels` (`_triton` or `_torch`)."""
    sums = None if partials is None else partials.new_empty((partials.shape[0], partials.shape[2]))
    box = None
    if _pointwise(kernel_size, padding):
        grad_x, x = grad_x[:, :, ::stride[0], ::stride[1]], x[:, :, ::stride[0], ::stride[1]]
    elif _separable(kernel_size):
        # the adjoint of rows-then-columns: the columns' adjoint into a map at the input's rows, then the rows'
        rows, columns = _rows_and_columns(kernel_size, stride, padding, dilation)
        t = kernels.box_filter(t, _box(*columns, adjoint=True), (x.shape[2], t.shape[3]))
        box = _box(*rows, adjoint=True)
    else:
        box = _box(kernel_size, stride, padding, dilation, adjoint=True)
    kernels.scale(x, t, alpha=-1. / c, rsqrt=False, base=grad_x, out=grad_x, box=box, partials=partials, sums=sums)
    return sums

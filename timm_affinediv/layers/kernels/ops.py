""" The fused path as torch custom ops (`timm_affinediv::...`), with fake implementations and autograd

Each layer is one forward op and one backward op, so `torch.compile` traces a model without graph breaks and
autograd keeps only what the backward needs: the input, the affine map's output `y` and the float32 map `b`
(`r = rsqrt(b)`, one channel per group).

PatchNormConv2d, `y = conv(x) (+ bias)` and `r = ((box(q) + offset) / c)^(-1/2)`, `q = sum_{c in group} x^2`:

    out = act(y r + post_bias)
    ga = g act'(y r + post_bias),   dL/dy = ga r,   t = r^3 sum_{c in group} ga y,
    dL/dx = conv_backward(ga r) - x box^T(t) / c,   dL/dpost_bias = sum ga

AffineDivLinear is the case of rows (`box` the identity), and the L2 normaliser `out = x r`,
`r = (|x|^2 / c + eps)^(-1/2)`, has `dL/dx = g r - x t / c`, `t = r^3 <g, x>`.

An op whose kernel fails to build or launch completes on `_torch`'s twins of the launchers under `auto`
(`dispatch.kernel_failed`), as every op after it does.
"""
import functools
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import KernelError
from . import _torch, dispatch
from .passes import add_norm_grad, conv_output

__all__ = ['patchnorm_conv2d', 'affine_div_linear', 'l2_normalise_channels']


def _kernels(x: Tensor):
    """ The launchers: `_triton`'s, once they have passed their self-check on `x`'s device, dtype and memory layout
    (`selfcheck.verify`, which raises `KernelError` where they do not), or their torch twins once a kernel has
    failed under `auto`; or the stand-ins `dispatch.launchers_replaced` set."""
    if dispatch.stand_in_launchers() is not None:
        return dispatch.stand_in_launchers()
    if dispatch.fell_back():
        return _torch
    from . import _triton, selfcheck  # defines the kernels on first use, after TRITON_INTERPRET is set
    selfcheck.verify(x)
    return _triton


def _falls_back(layer: Callable[..., str]):
    """ An op body that, where a kernel fails, reports it (`dispatch.kernel_failed`: raises under `triton`) and runs
    again on the torch twins; `layer(*args)` describes the layer for the report."""
    def decorate(body):
        @functools.wraps(body)
        def run(*args, **kwargs):
            try:
                return body(*args, **kwargs)
            except KernelError as failure:
                dispatch.kernel_failed(layer(*args, **kwargs), failure)
                return body(*args, **kwargs)
        return run
    return decorate


def _conv_layer(x: Tensor, weight: Tensor, stride: List[int], padding: List[int], dilation: List[int],
                groups: int) -> str:
    return (f'PatchNormConv2d({x.shape[1]}, {weight.shape[0]}, kernel_size={tuple(weight.shape[2:])}, '
            f'stride={tuple(stride)}, padding={tuple(padding)}, dilation={tuple(dilation)}, groups={groups}) '
            f'on a {x.dtype} input of shape {list(x.shape)}')


def _linear_layer(x: Tensor, weight: Tensor, *_) -> str:
    return f'AffineDivLinear({weight.shape[1]}, {weight.shape[0]}) on {x.shape[0]} {x.dtype} rows'


def _normaliser(x: Tensor, *_) -> str:
    return f'the L2 normaliser of a {x.dtype} input of shape {list(x.shape)}'


def _unused(x: Tensor) -> Tensor:
    """The placeholder for a gradient the backward was not asked for (custom ops return tensors only)."""
    return x.new_empty(0)


def _summed_alone(partials: Optional[Tensor]) -> Optional[Tensor]:
    """`partials` summed over dim 1 in a launch of their own, where no `dx` pass follows to sum them."""
    return None if partials is None else partials.sum(1)


def _affine_needed(output_mask: List[bool], bias: Optional[Tensor], gain: Optional[Tensor],
                   post_bias: Optional[Tensor]) -> Tuple[bool, bool, bool]:
    """Whether the backward computes dL/dbias, dL/dgain and dL/dpost_bias: asked for (`output_mask[2:]`) and there."""
    needs_bias, needs_gain, needs_post_bias = (
        needed and p is not None for needed, p in zip(output_mask[2:], (bias, gain, post_bias)))
    return needs_bias, needs_gain, needs_post_bias


def _fake_backward(x: Tensor, weight: Tensor, bias: Optional[Tensor], gain: Optional[Tensor],
                   post_bias: Optional[Tensor], output_mask: List[bool]) -> Tuple[Tensor, Tensor, Tensor]:
    """The shapes a backward op returns, `(dL/dx, dL/dweight, affine)`: the fake implementation of both."""
    needs_x, needs_weight = output_mask[:2]
    rows = sum(_affine_needed(output_mask, bias, gain, post_bias))
    return (torch.empty_like(x) if needs_x else _unused(x), torch.empty_like(weight) if needs_weight else _unused(x),
            x.new_empty((rows, weight.shape[0]), dtype=torch.float32) if rows else _unused(x))


@torch.library.custom_op('timm_affinediv::patchnorm_conv2d', mutates_args=())
@_falls_back(lambda x, weight, bias, gain, post_bias, stride, padding, dilation, groups, *_: _conv_layer(
    x, weight, stride, padding, dilation, groups))
def patchnorm_conv2d(x: Tensor, weight: Tensor, bias: Optional[Tensor], gain: Optional[Tensor],
                     post_bias: Optional[Tensor], stride: List[int], padding: List[int], dilation: List[int],
                     groups: int, c: int, offset: float, act: str,
                     norm_map: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """ `(out, y, b)`: `out = act(gain (y + bias) rsqrt(b) + post_bias)`, `y = conv(x)` without its bias, `b` as
    `passes.conv_output`.

    The bias, `gain` and `post_bias` (a fused slot's affine) are applied in the output pass, in float32: not folded
    into the weight, nor the bias cast to the convolution's dtype, each of which would cost launches forward and
    backward every step. `norm_map`: `b`, where the caller has it (another map of the same input with the same `c`
    and `offset`).
    """
    kernels = _kernels(x)
    y = torch.ops.aten.convolution(x, weight, None, stride, padding, dilation, False, [0, 0], groups)
    if norm_map is None:
        out, b = conv_output(kernels, x, y, weight, bias, gain, post_bias, stride, padding, dilation, groups, c,
                             offset, act)
        return out, y, b
    b = norm_map.contiguous() if not norm_map.is_contiguous() else norm_map.clone()  # an output is no input
    return kernels.scale(y, b, post_bias, act, gain=gain, bias=bias), y, b


@patchnorm_conv2d.register_fake
def _(x, weight, bias, gain, post_bias, stride, padding, dilation, groups, c, offset, act, norm_map=None):
    y = torch.ops.aten.convolution(x, weight, None, stride, padding, dilation, False, [0, 0], groups)
    n, _, h, w = y.shape
    return torch.empty_like(y), y, y.new_empty((n, groups, h, w), dtype=torch.float32)


@torch.library.custom_op('timm_affinediv::patchnorm_conv2d_backward', mutates_args=())
@_falls_back(lambda grad, x, weight, y, b, bias, gain, post_bias, stride, padding, dilation, groups, *_: _conv_layer(
    x, weight, stride, padding, dilation, groups))
def patchnorm_conv2d_backward(grad: Tensor, x: Tensor, weight: Tensor, y: Tensor, b: Tensor, bias: Optional[Tensor],
                              gain: Optional[Tensor], post_bias: Optional[Tensor], stride: List[int],
                              padding: List[int], dilation: List[int], groups: int, c: int, act: str,
                              output_mask: List[bool]) -> Tuple[Tensor, Tensor, Tensor]:
    """ `(dL/dx, dL/dweight, affine)`, empty where `output_mask` (x, weight, bias, gain, post_bias) is False;
    `affine`: the rows dL/dpost_bias, dL/dgain and dL/dbias (float32, those asked for), summed in the `dx` pass's
    launch."""
    kernels = _kernels(x)
    needs_x, needs_weight = output_mask[:2]
    needs_bias, needs_gain, needs_post_bias = _affine_needed(output_mask, bias, gain, post_bias)
    grad_y, t, partials = kernels.scale_backward(
        grad, y, b, post_bias, act, needs_post_bias, gain=gain, gain_grad=needs_gain, bias=bias, bias_grad=needs_bias)
    grad_x, grad_weight, _ = torch.ops.aten.convolution_backward(
        grad_y, x, weight, None, stride, padding, dilation, False, [0, 0], groups, [needs_x, needs_weight, False])
    if needs_x:
        affine = add_norm_grad(kernels, grad_x, x, t, weight.shape[2:], stride, padding, dilation, c, partials)
    else:
        affine = _summed_alone(partials)
    return (grad_x if needs_x else _unused(x), grad_weight if needs_weight else _unused(x),
            _unused(x) if affine is None else affine)


@patchnorm_conv2d_backward.register_fake
def _(grad, x, weight, y, b, bias, gain, post_bias, stride, padding, dilation, groups, c, act, output_mask):
    return _fake_backward(x, weight, bias, gain, post_bias, output_mask)


def _affine_grads(affine: Tensor, mask: List[bool], bias: Optional[Tensor], gain: Optional[Tensor],
                  post_bias: Optional[Tensor]) -> Tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """`(dL/dbias, dL/dgain, dL/dpost_bias)` from the backward op's `affine` rows (those `mask[2:]` asked for)."""
    rows = iter(affine)  # dL/dpost_bias, dL/dgain, dL/dbias: those asked for, in this order
    grad_post_bias, grad_gain, grad_bias = (
        next(rows).to(p.dtype) if needed and p is not None else None
        for needed, p in zip(mask[:1:-1], (post_bias, gain, bias)))
    return grad_bias, grad_gain, grad_post_bias


def _setup_patchnorm(ctx, inputs, output):
    x, weight, bias, gain, post_bias, stride, padding, dilation, groups, c, _, act, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2], bias, gain, post_bias)
    ctx.set_materialize_grads(False)  # `y` and `b` are the backward's, never the loss's: no zero gradients for them
    ctx.geometry = (stride, padding, dilation, groups, c, act)


def _backward_patchnorm(ctx, grad, _grad_y, _grad_b):
    if grad is None:  # the output did not reach the loss
        return (None,) * 13
    x, weight, y, b, bias, gain, post_bias = ctx.saved_tensors
    mask = list(ctx.needs_input_grad[:5])
    grad_x, grad_weight, affine = patchnorm_conv2d_backward(
        grad, x, weight, y, b, bias, gain, post_bias, *ctx.geometry, mask)
    return (grad_x if mask[0] else None, grad_weight if mask[1] else None,
            *_affine_grads(affine, mask, bias, gain, post_bias)) + (None,) * 8


patchnorm_conv2d.register_autograd(_backward_patchnorm, setup_context=_setup_patchnorm)


# the geometry of rows as maps: a 1x1 map's kernel size, stride, padding and dilation
_ROW_MAP = ([1, 1], [1, 1], [0, 0], [1, 1])


def _as_maps(rows: Tensor) -> Tensor:
    """An (M, K) matrix as (M, K, 1, 1): the kernels' rows."""
    return rows[:, :, None, None]


@torch.library.custom_op('timm_affinediv::affine_div_linear', mutates_args=())
@_falls_back(_linear_layer)
def affine_div_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], gain: Optional[Tensor],
                      post_bias: Optional[Tensor], c: int, offset: float) -> Tuple[Tensor, Tensor, Tensor]:
    """ `(out, y, b)` for the rows of `x`: `out = gain (x W^T + bias) rsqrt(b) + post_bias`, `y = x W^T`,
    `b = (|x|^2 + offset) / c`; the bias and the affine in the output pass, as `patchnorm_conv2d`'s."""
    kernels = _kernels(x)
    y = F.linear(x, weight)
    b = kernels.channel_sq_norm(_as_maps(x), 1, 1. / c, offset / c)
    out = torch.empty_like(y)
    kernels.scale(_as_maps(y), b, post_bias, out=_as_maps(out), gain=gain, bias=bias)
    return out, y, b


@affine_div_linear.register_fake
def _(x, weight, bias, gain, post_bias, c, offset):
    y = x.new_empty((x.shape[0], weight.shape[0]))
    return torch.empty_like(y), y, x.new_empty((x.shape[0], 1, 1, 1), dtype=torch.float32)


@torch.library.custom_op('timm_affinediv::affine_div_linear_backward', mutates_args=())
@_falls_back(lambda grad, x, weight, *_: _linear_layer(x, weight))
def affine_div_linear_backward(grad: Tensor, x: Tensor, weight: Tensor, y: Tensor, b: Tensor, bias: Optional[Tensor],
                               gain: Optional[Tensor], post_bias: Optional[Tensor], c: int,
                               output_mask: List[bool]) -> Tuple[Tensor, Tensor, Tensor]:
    """`(dL/dx, dL/dweight, affine)` as `patchnorm_conv2d_backward`'s."""
    kernels = _kernels(x)
    needs_x, needs_weight = output_mask[:2]
    needs_bias, needs_gain, needs_post_bias = _affine_needed(output_mask, bias, gain, post_bias)
    grad_y = torch.empty_like(y)
    _, t, partials = kernels.scale_backward(
        _as_maps(grad), _as_maps(y), b, post_bias, 'none', needs_post_bias, grad_y=_as_maps(grad_y), gain=gain,
        gain_grad=needs_gain, bias=bias, bias_grad=needs_bias)
    grad_x = _unused(x)
    if needs_x:
        grad_x = grad_y @ weight
        affine = add_norm_grad(kernels, _as_maps(grad_x), _as_maps(x), t, *_ROW_MAP, c, partials)
    else:
        affine = _summed_alone(partials)
    return grad_x, grad_y.t() @ x if needs_weight else _unused(x), _unused(x) if affine is None else affine


@affine_div_linear_backward.register_fake
def _(grad, x, weight, y, b, bias, gain, post_bias, c, output_mask):
    return _fake_backward(x, weight, bias, gain, post_bias, output_mask)


def _setup_linear(ctx, inputs, output):
    x, weight, bias, gain, post_bias, c, _ = inputs
    ctx.save_for_backward(x, weight, output[1], output[2], bias, gain, post_bias)
    ctx.set_materialize_grads(False)
    ctx.c = c


def _backward_linear(ctx, grad, _grad_y, _grad_b):
    if grad is None:
        return (None,) * 7
    x, weight, y, b, bias, gain, post_bias = ctx.saved_tensors
    mask = list(ctx.needs_input_grad[:5])
    grad_x, grad_weight, affine = affine_div_linear_backward(grad, x, weight, y, b, bias, gain, post_bias, ctx.c, mask)
    return (grad_x if mask[0] else None, grad_weight if mask[1] else None,
            *_affine_grads(affine, mask, bias, gain, post_bias), None, None)


affine_div_linear.register_autograd(_backward_linear, setup_context=_setup_linear)


@torch.library.custom_op('timm_affinediv::l2_normalise_channels', mutates_args=())
@_falls_back(_normaliser)
def l2_normalise_channels(x: Tensor, c: int, eps: float) -> Tuple[Tensor, Tensor]:
    """`(x rsqrt(b), b)` over dim 1 of an (N, C, H, W) tensor, `b = |x|^2 / c + eps` (float32)."""
    kernels = _kernels(x)
    b = kernels.channel_sq_norm(x, 1, 1. / c, eps)
    return kernels.scale(x, b), b


@l2_normalise_channels.register_fake
def _(x, c, eps):
    n, _, h, w = x.shape
    return torch.empty_like(x), x.new_empty((n, 1, h, w), dtype=torch.float32)


@torch.library.custom_op('timm_affinediv::l2_normalise_channels_backward', mutates_args=())
@_falls_back(lambda grad, x, *_: _normaliser(x))
def l2_normalise_channels_backward(grad: Tensor, x: Tensor, b: Tensor, c: int) -> Tensor:
    """`dL/dx = g r - x t / c`, `t = r^3 <g, x>`."""
    kernels = _kernels(x)
    grad_x, t = kernels.scale_backward(grad, x, b, None, 'none', False)[:2]
    return kernels.scale(x, t, alpha=-1. / c, rsqrt=False, base=grad_x, out=grad_x)


@l2_normalise_channels_backward.register_fake
def _(grad, x, b, c):
    return torch.empty_like(x)


def _setup_l2(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.set_materialize_grads(False)
    ctx.c = inputs[1]


def _backward_l2(ctx, grad, _grad_b):
    if grad is None:
        return None, None, None
    x, b = ctx.saved_tensors
    return l2_normalise_channels_backward(grad, x, b, ctx.c), None, None


l2_normalise_channels.register_autograd(_backward_l2, setup_context=_setup_l2)

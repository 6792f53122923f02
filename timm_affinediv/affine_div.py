""" Divergence-corrected affine maps: AffineDivLinear and PatchNormConv2d (PatchNorm)

An affine layer `z = W x + b` trained by steepest descent moves its output by
`-eta * g * (|x|^2 + 1)`: every sample (and, for a convolution, every output position,
through its input patch `P_p`) gets its own effective learning rate. Dividing the map by
the norm of its augmented input `a = [x; 1]` removes that factor:

    z = (W x + b) / s(x),    s(x)^2 = |a|^2 / c

so one SGD step moves `z` by exactly `-eta * c * g`, the same for every sample and position.
`scale="rms"` takes `c = m` (the length of `a`: fan-in, plus one with a bias), so `s` is the
root mean square of `a` and activations keep the size of a plain layer; `scale="l2"` takes
`c = 1`, the literal steepest-descent step. Without a bias `a = x` and a tiny `eps` guards 0/0.

Norms are computed in float32 whatever the input dtype, so float16/bfloat16 do not overflow.

Reference: "The Affine Divergence: Aligning Activation Updates Beyond Normalisation", ICLR 2026.
"""
import math
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module

__all__ = ['AffineDivLinear', 'PatchNormConv2d', 'divergence_constant', 'patch_sq_norm']

_SCALES = ('rms', 'l2')


def _check_scale(scale: str) -> str:
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    return scale


def divergence_constant(fan_in: int, bias: bool, scale: str) -> int:
    """The constant `c` every update is scaled by: `m = fan_in (+1 with bias)` for "rms", 1 for "l2"."""
    return fan_in + int(bias) if _check_scale(scale) == 'rms' else 1


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` in float32, or as it is if wider (float64): the dtype norms are taken in."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _inv_scale(sq_norm: torch.Tensor, c: int, bias: bool, eps: float) -> torch.Tensor:
    """`1 / s = sqrt(c / (|x|^2 + 1))` with a bias, `sqrt(c / (|x|^2 + eps))` without."""
    return sq_norm.add(1.0 if bias else eps).div_(c).rsqrt()


def _check_last_dim(x: torch.Tensor, features: int, name: str) -> None:
    if x.dim() == 0 or x.shape[-1] != features:
        raise ValueError(
            f"{name} expects inputs whose last dimension is in_features={features}, "
            f"got shape {tuple(x.shape)}")


def _check_nchw(x: torch.Tensor, channels: int, name: str) -> None:
    if x.dim() != 4:
        raise ValueError(
            f"{name} expects a 4-D input (N, C, H, W), got shape {tuple(x.shape)}; "
            "add a batch dimension with x.unsqueeze(0)")
    if x.shape[1] != channels:
        raise ValueError(f"{name} expects {channels} input channels, got shape {tuple(x.shape)}")


@register_notrace_module  # a leaf for timm's FX feature extraction, like its own norm layers
class AffineDivLinear(nn.Linear):
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
        self.scale = _check_scale(scale)
        self.eps = eps

    @property
    def divergence_constant(self) -> int:
        return divergence_constant(self.in_features, self.bias is not None, self.scale)

    def inv_scale(self, x: torch.Tensor) -> torch.Tensor:
        """`1 / s(x)` in float32 (or float64), shape `x.shape[:-1] + (1,)`."""
        with torch.autocast(x.device.type, enabled=False):
            sq_norm = at_least_float32(x).square().sum(-1, keepdim=True)
            return _inv_scale(sq_norm, self.divergence_constant, self.bias is not None, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_last_dim(x, self.in_features, type(self).__name__)
        y = F.linear(x, self.weight, self.bias)
        return y * self.inv_scale(x).to(y.dtype)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, scale={self.scale}'

    @classmethod
    def from_linear(cls, linear: nn.Linear, scale: str = 'rms') -> 'AffineDivLinear':
        """The divergence-corrected form of `linear`, sharing its parameters."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, scale=scale,
                  device='meta')
        new.weight = linear.weight
        new.bias = linear.bias
        return new


def patch_sq_norm(
        x: torch.Tensor,
        kernel_size: Tuple[int, int],
        stride: Tuple[int, int] = (1, 1),
        padding: Tuple[int, int, int, int] = (0, 0, 0, 0),
        dilation: Tuple[int, int] = (1, 1),
        groups: int = 1,
) -> torch.Tensor:
    """ `|P_p|^2` for every output position `p` of a convolution, per group, in float32 (or float64).

    `P_p` is the im2col column that position `p` reads: the group's input channels times the
    kernel window, zero padding included. Computed as a channel sum of `x^2` per group and a
    box filter with the convolution's geometry. `padding` is `(left, right, top, bottom)`.
    Returns `(N, groups, H_out, W_out)`.
    """
    with torch.autocast(x.device.type, enabled=False):
        sq = at_least_float32(x).square()
        if groups == 1:
            sq = sq.sum(1, keepdim=True)
        elif groups != x.shape[1]:
            sq = sq.unflatten(1, (groups, -1)).sum(2)
        left, right, top, bottom = padding
        kh, kw = kernel_size
        if dilation == (1, 1) and left == right <= kw // 2 and top == bottom <= kh // 2:
            pad = (top, left)
        else:
            sq = F.pad(sq, padding)
            pad = (0, 0)
        if dilation != (1, 1):
            ones = sq.new_ones(sq.shape[1], 1, kh, kw)
            return F.conv2d(sq, ones, stride=stride, padding=pad, dilation=dilation, groups=sq.shape[1])
        # separable box filter: kh + kw additions per output instead of kh * kw
        sq = F.avg_pool2d(sq, (kh, 1), (stride[0], 1), (pad[0], 0), divisor_override=1)
        return F.avg_pool2d(sq, (1, kw), (1, stride[1]), (0, pad[1]), divisor_override=1)


@register_notrace_module
class PatchNormConv2d(nn.Conv2d):
    """ PatchNorm: the divergence-corrected convolution, a drop-in for `nn.Conv2d`.

    `y_p = (W * x + b)_p / s(P_p)`, `s(P)^2 = (|P|^2 + 1) / c` (`(|P|^2 + eps) / c` without bias),
    where `P_p` is the input patch output position `p` reads (its group's channels times the
    kernel window, zero padding included) and `c = C_in / groups * kh * kw (+ 1)` for
    `scale="rms"`, 1 for "l2". One SGD step on `weight` and `bias` moves every position of every
    sample by `-lr * c * dL/dy`. All strides, paddings (ints, tuples, "same", "valid"), dilations,
    group counts (depthwise included) and padding modes are exact: non-zero padding modes pad
    the input first, so the patches are what the convolution reads.
    """

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
            raise ValueError(
                f"PatchNormConv2d supports padding_mode in {valid_modes}, got {padding_mode!r}")
        super().__init__(
            in_channels, out_channels, kernel_size, stride=stride, padding=padding, dilation=dilation,
            groups=groups, bias=bias, padding_mode=padding_mode, device=device, dtype=dtype)
        self.scale = _check_scale(scale)
        self.eps = eps

    @property
    def divergence_constant(self) -> int:
        fan_in = self.in_channels // self.groups * self.kernel_size[0] * self.kernel_size[1]
        return divergence_constant(fan_in, self.bias is not None, self.scale)

    def inv_scale(self, x: torch.Tensor, padding: Tuple[int, int, int, int]) -> torch.Tensor:
        """`1 / s(P_p)` in float32 (or float64), `(N, groups, H_out, W_out)`, for `x` padded by `padding`."""
        sq_norm = patch_sq_norm(x, self.kernel_size, self.stride, padding, self.dilation, self.groups)
        return _inv_scale(sq_norm, self.divergence_constant, self.bias is not None, self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_nchw(x, self.in_channels, type(self).__name__)
        if self.padding_mode == 'zeros':
            y = F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
            padding = tuple(self._reversed_padding_repeated_twice)
        else:
            x = F.pad(x, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            y = F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)
            padding = (0, 0, 0, 0)
        inv_s = self.inv_scale(x, padding).to(y.dtype)
        if inv_s.shape[1] in (1, y.shape[1]):
            return y * inv_s
        return (y.unflatten(1, (self.groups, -1)) * inv_s.unsqueeze(2)).flatten(1, 2)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, scale={self.scale}'

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

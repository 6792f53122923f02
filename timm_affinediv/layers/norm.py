""" The normalisers the affine divergence derives: L2Norm, L2Norm2d and L2NormLinear

Normalising the input of an affine layer to a fixed norm makes its divergence factor
`|x|^2 + 1` a constant that the learning rate absorbs:

    y = weight * x / sqrt(|x|^2 / c + eps) + bias

with `c = 1` (`scale="l2"`, the L2 normaliser `x / |x|`) or `c = n`, the number of features
(`scale="rms"`, the RMS normaliser `sqrt(n) x / |x|`, timm's `rmsnorm`). Norms in float32.
`L2NormLinear` is the paper's "norm-like" layer: the normaliser fused right before an affine map.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import register_notrace_module

from .affine_div import check_last_dim, check_scale
from .kernels import functional, use_triton
from .patches import at_least_float32, portable_ops

__all__ = ['L2Norm', 'L2Norm2d', 'L2NormLinear', 'l2_normalise']


def l2_normalise(x: torch.Tensor, dim: int, scale: str = 'l2', eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(|x|^2 / c + eps)` over `dim`, `c = 1` ("l2") or `x.shape[dim]` ("rms")."""
    c = x.shape[dim] if check_scale(scale) == 'rms' else 1
    if torch.jit.is_scripting():
        # TorchScript does not apply autocast
        return _normalise(x, dim, c, eps)
    else:
        if not portable_ops():
            out = _kernel_normalise(x, dim, c, eps)
            if out is not None:
                return out
        with torch.autocast(x.device.type, enabled=False):
            return _normalise(x, dim, c, eps)


@torch.jit.unused
def _kernel_normalise(x: torch.Tensor, dim: int, c: int, eps: float) -> Optional[torch.Tensor]:
    """`l2_normalise` on the fused Triton kernels, or None where they do not apply (`kernels.dispatch`)."""
    if not use_triton(x):
        return None
    return functional.l2_normalise(x, dim, c, eps)


def _normalise(x: torch.Tensor, dim: int, c: int, eps: float) -> torch.Tensor:
    x32 = at_least_float32(x)
    inv_norm = (x32 * x32).sum(dim, keepdim=True).div_(c).add_(eps).rsqrt()  # x * x: exported as Mul, not Pow
    return (x32 * inv_norm).to(x.dtype)


@register_notrace_module
class L2Norm(nn.Module):
    """ L2 normaliser over the last dimension, with a per-feature affine.

    `y = weight * x / sqrt(|x|^2 / c + eps) + bias`, `c = 1` for "l2", `num_features` for "rms".
    """
    channel_dim = -1
    __constants__ = ['channel_dim']

    def __init__(self, num_features: int, eps: float = 1e-6, affine: bool = True, scale: str = 'l2',
                 device=None, dtype=None):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.scale = check_scale(scale)
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        else:
            self.register_parameter('weight', None)
            self.register_parameter('bias', None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = l2_normalise(x, self.channel_dim, self.scale, self.eps)
        if self.weight is None:
            return x
        return channel_affine(x, self.weight, self.bias, self.channel_dim)

    def extra_repr(self) -> str:
        return f'{self.num_features}, eps={self.eps}, scale={self.scale}'


@register_notrace_module
class L2Norm2d(L2Norm):
    """ L2 normaliser over the channels of an (N, C, H, W) tensor, at every position, with affine.

    `y = weight * x / sqrt(|x|^2 / c + eps) + bias`, `|x|` over C, `c = 1` ("l2") or C ("rms").
    """
    channel_dim = 1


@register_notrace_module
class L2NormLinear(nn.Linear):
    """ The paper's norm-like layer: an affine map of the L2-normalised input, a drop-in for `nn.Linear`.

    `y = W x / sqrt(|x|^2 / c + eps) + b` over the last dimension, `c = 1` for `scale="l2"` (the
    paper's `x / |x|`, default) or `in_features` for "rms"; `eps = 1e-6` keeps a zero input finite
    (it maps to zero). The input's norm is fixed, so one SGD step on `weight` and `bias` moves `y` by
    `-lr * (c + 1) * dL/dy` (`c` without a bias) for every sample, up to `eps`: 2 for "l2" with a bias.
    Scale-invariant in `x` (unlike `AffineDivLinear`); no parameters beyond `nn.Linear`'s.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, scale: str = 'l2',
                 eps: float = 1e-6, **kwargs):
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.scale = check_scale(scale)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_last_dim(x, self.in_features, type(self).__name__)
        return F.linear(l2_normalise(x, -1, self.scale, self.eps), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, scale={self.scale}, eps={self.eps}'


def channel_affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """`weight * x + bias` with per-channel parameters along `channel_dim` (1 or -1), in x's dtype."""
    if channel_dim == 1:
        shape = [-1] + [1] * (x.dim() - 2)
        weight, bias = weight.view(shape), bias.view(shape)
    return torch.addcmul(bias.to(x.dtype), x, weight.to(x.dtype))

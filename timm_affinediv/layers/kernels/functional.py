""" What the layers call on the Triton path: autocast applied as for torch's operations, then the custom ops """
from typing import List, Optional

import torch
import torch.nn as nn
from timm.layers.activations import GELU as TimmGELU

from . import ops

__all__ = ['fused_activation', 'patchnorm_conv2d', 'affine_div_linear', 'l2_normalise']


def fused_activation(slot: Optional[nn.Module]) -> str:
    """ The activation a convolution's kernel can apply for its fused slot: 'relu', 'gelu', 'silu' or 'none'.

    Only a `PatchNormAct2d`'s exact ReLU, SiLU or erf GELU with no dropout before it: anything else stays the
    slot's.
    """
    act, drop = getattr(slot, 'act', None), getattr(slot, 'drop', None)
    if act is None or type(drop) is not nn.Identity:
        return 'none'
    if type(act) is nn.ReLU:
        return 'relu'
    if type(act) is nn.SiLU:
        return 'silu'
    if type(act) is TimmGELU or (type(act) is nn.GELU and act.approximate == 'none'):
        return 'gelu'
    return 'none'


def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the affine map computes in: autocast's where it is on (as for a convolution or a GEMM)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def patchnorm_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     post_bias: Optional[torch.Tensor], stride: List[int], padding: List[int], dilation: List[int],
                     groups: int, c: int, offset: float, act: str = 'none') -> torch.Tensor:
    """`act(conv(x) / s(P) + post_bias)` (zero, symmetric `padding`), see `ops.patchnorm_conv2d`."""
    dtype = _autocast_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        out, _, _ = ops.patchnorm_conv2d(
            x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype), post_bias, list(stride),
            list(padding), list(dilation), groups, c, offset, act)
    return out


def affine_div_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      post_bias: Optional[torch.Tensor], c: int, offset: float) -> torch.Tensor:
    """`(x W^T + b) / s(x) + post_bias` over the last dim of `x`, see `ops.affine_div_linear`."""
    dtype = _autocast_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        out, _, _ = ops.affine_div_linear(
            x.to(dtype).reshape(-1, x.shape[-1]), weight.to(dtype), None if bias is None else bias.to(dtype),
            post_bias, c, offset)
    return out.reshape(x.shape[:-1] + (weight.shape[0],))


def l2_normalise(x: torch.Tensor, dim: int, c: int, eps: float) -> Optional[torch.Tensor]:
    """`x / sqrt(|x|^2 / c + eps)` over `dim` in `x`'s dtype, or None where the kernels do not take `dim`
    (they take the last dim and dim 1 of a 4-D tensor)."""
    if dim == 1 and x.dim() == 4:
        return ops.l2_normalise_channels(x, c, eps)[0]
    if dim == -1 or dim == x.dim() - 1:
        out = ops.l2_normalise_channels(x.reshape(-1, x.shape[-1])[:, :, None, None], c, eps)[0]
        return out.reshape(x.shape)
    return None

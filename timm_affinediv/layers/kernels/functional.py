""" What the layers call on the Triton path: autocast applied as for torch's operations, then the custom ops """
import weakref
from typing import Hashable, List, Optional, Tuple

import torch
import torch.nn as nn
from timm.layers.activations import GELU as TimmGELU

from ..._torch_compat import tensor_version
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


class _NormMapCache:
    """ The norm map of the last 1x1, stride-1 map's input, for a later 1x1 map of the same tensor with the same
    `c` and offset (a bottleneck's first convolution and its downsample): the later one reads it at its stride
    instead of its input.

    Eager mode only, where it is exact: a tensor's version counter changes with every in-place write, and the weak
    reference dies with the tensor (compiled graphs may reuse a buffer without either).
    """

    def __init__(self):
        # one tuple, replaced whole: threads (DataParallel's replicas) never see one entry's tensor with another's map
        self._entry: Optional[Tuple[weakref.ref, Hashable, torch.Tensor]] = None

    def get(self, x: torch.Tensor, key: Hashable) -> Optional[torch.Tensor]:
        entry = self._entry
        if entry is not None and entry[0]() is x and entry[1] == (tensor_version(x), key):
            return entry[2]
        return None

    def put(self, x: torch.Tensor, key: Hashable, norm_map: torch.Tensor) -> None:
        self._entry = (weakref.ref(x), (tensor_version(x), key), norm_map)


_norm_maps = _NormMapCache()


def patchnorm_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], gain: Optional[torch.Tensor],
                     post_bias: Optional[torch.Tensor], stride: List[int], padding: List[int], dilation: List[int],
                     groups: int, c: int, offset: float, act: str = 'none') -> torch.Tensor:
    """`act(gain conv(x) / s(P) + post_bias)` (zero, symmetric `padding`), see `ops.patchnorm_conv2d`."""
    dtype = _autocast_dtype(x)
    x = x.to(dtype)
    shared = tuple(weight.shape[2:]) == (1, 1) and not any(padding) and not torch.compiler.is_compiling()
    key = (groups, c, offset)
    full_map = _norm_maps.get(x, key) if shared else None
    with torch.autocast(x.device.type, enabled=False):
        out, _, norm_map = ops.patchnorm_conv2d(
            x, weight.to(dtype), bias, gain, post_bias, list(stride), list(padding),
            list(dilation), groups, c, offset, act,
            None if full_map is None else full_map[:, :, ::stride[0], ::stride[1]])
    if shared and full_map is None and tuple(stride) == (1, 1):
        _norm_maps.put(x, key, norm_map)
    return out


def affine_div_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      gain: Optional[torch.Tensor], post_bias: Optional[torch.Tensor], c: int,
                      offset: float) -> torch.Tensor:
    """`gain (x W^T + b) / s(x) + post_bias` over the last dim of `x`, see `ops.affine_div_linear`."""
    dtype = _autocast_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        out, _, _ = ops.affine_div_linear(
            x.to(dtype).reshape(-1, x.shape[-1]), weight.to(dtype), bias, gain, post_bias, c, offset)
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

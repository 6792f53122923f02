""" The fit's rows: the divergence-corrected features at sampled output positions, and the original's targets

A corrected layer computes, for each output channel `o` and position `p`,

    z_o,p = v_o . u_p + beta_o,     u_p = [P_p; 1] / s(P_p)

(`v_o = g_o [W_o, b_o]` with the slot's gain `g_o` folded in, `beta_o` the slot's shift, present only where a slot
follows), linear in `(v_o, beta_o)`. `patch_features` gathers `u` (only the kept patches: the im2col of every
position is never materialised), `output_targets` the original's `z`, and `layer_params`/`set_layer_params` move
`v` in and out of a layer and its slot.
"""
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers.affine_div import AffineDivLinear
from ..layers.slot import PatchNormSlot

__all__ = ['patch_features', 'output_targets', 'fit_order', 'from_fit_order', 'layer_params', 'set_layer_params']


def _pixels(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`x` padded as the convolution pads it, as contiguous (N, H, W, C) pixels: a patch is then kh x kw rows."""
    left, right, top, bottom = layer._reversed_padding_repeated_twice
    if layer.padding_mode != 'zeros':
        x = F.pad(x, (left, right, top, bottom), mode=layer.padding_mode)
    elif left or right or top or bottom:
        n, c, h, w = x.shape
        padded = x.new_zeros(n, h + top + bottom, w + left + right, c)
        padded[:, top:top + h, left:left + w] = x.permute(0, 2, 3, 1)
        return padded
    return x.permute(0, 2, 3, 1).contiguous()  # no copy where x is channels-last already


def _positions(keep: torch.Tensor, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(image, row, column) of output positions numbered image first, then row-major (as `F.unfold` numbers them)."""
    image, at = keep.div(height * width, rounding_mode='floor'), keep.remainder(height * width)
    return image, at.div(width, rounding_mode='floor'), at.remainder(width)


def patch_features(layer: nn.Module, x: torch.Tensor, keep: Optional[torch.Tensor],
                   shift: bool = False) -> torch.Tensor:
    """ `u = [P; 1] / s(P)` at the output positions `keep` (all if None), and a constant 1 after it for a slot's
    shift if `shift`: (groups, positions, K (+1) (+1)), a patch's features in (kh, kw, C) order (`fit_order`).

    Only the kept patches are gathered, so the im2col of every position is never materialised.
    """
    bias = layer.bias is not None
    c = layer.divergence_constant
    if isinstance(layer, AffineDivLinear):
        cols = x.reshape(-1, x.shape[-1])
        cols = (cols if keep is None else cols[keep]).unsqueeze(0)             # (1, P, K)
    else:
        (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.stride, layer.dilation
        left, right, top, bottom = layer._reversed_padding_repeated_twice
        out_h = (x.shape[2] + top + bottom - dh * (kh - 1) - 1) // sh + 1
        out_w = (x.shape[3] + left + right - dw * (kw - 1) - 1) // sw + 1
        if keep is None:
            keep = torch.arange(x.shape[0] * out_h * out_w, device=x.device)
        image, row, column = _positions(keep, out_h, out_w)
        rows = row[:, None, None] * sh + torch.arange(kh, device=x.device)[:, None] * dh                # (P, kh, 1)
        columns = column[:, None, None] * sw + torch.arange(kw, device=x.device) * dw                  # (P, 1, kw)
        if layer.groups == 1:
            patches = _pixels(x, layer)[image[:, None, None], rows, columns]                # (P, kh, kw, C)
            cols = patches.view(1, len(keep), -1)                                              # (1, P, K)
        else:
            # gathered channels first, a depthwise layer's features are already (G, P, K), with no transposing copy
            mode = 'constant' if layer.padding_mode == 'zeros' else layer.padding_mode
            x = F.pad(x, (left, right, top, bottom), mode=mode)
            patches = x.transpose(0, 1)[:, image[:, None, None], rows, columns]             # (C, P, kh, kw)
            patches = patches.unflatten(0, (layer.groups, -1)).permute(0, 2, 3, 4, 1)      # (G, P, kh, kw, C/G)
            cols = patches.flatten(2)                                                          # (G, P, K)
    sq = torch.linalg.vector_norm(cols, dim=-1, keepdim=True).square_()
    scale = sq.add_(1. if bias else layer.eps).reciprocal_().mul_(c).sqrt_()            # sqrt(c / (|P|^2 + 1))
    k = cols.shape[-1]
    u = cols.new_empty(cols.shape[:-1] + (k + bias + shift,))
    torch.mul(cols, scale, out=u[..., :k])
    if bias:
        u[..., k:k + 1] = scale
    if shift:
        u[..., -1] = 1.
    return u


def output_targets(out: torch.Tensor, channels: int, conv: bool, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The original's values at the output positions `keep` (all if None) as (positions, channels), whatever
    layout the original produced them in; only the kept positions are copied."""
    if not conv:
        rows = out.reshape(-1, channels)
        return rows if keep is None else rows[keep]
    if out.dim() == 4 and out.shape[1] != channels:
        out = out.permute(0, 3, 1, 2)                                            # channels-last norm output
    pixels = out.permute(0, 2, 3, 1)                                             # (N, H, W, C)
    if keep is None:
        return pixels.reshape(-1, channels)
    return pixels[_positions(keep, pixels.shape[1], pixels.shape[2])]


def fit_order(weight: torch.Tensor) -> torch.Tensor:
    """A weight as (O, K), each row in the order of `patch_features`' patch features: (kh, kw, C) for a convolution."""
    return weight.permute(0, 2, 3, 1).flatten(1) if weight.dim() == 4 else weight


def from_fit_order(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`fit_order`'s inverse: (O, K) rows as a view shaped as `weight`."""
    if weight.dim() != 4:
        return rows
    out, channels, kh, kw = weight.shape
    return rows.view(out, kh, kw, channels).permute(0, 3, 1, 2)


def layer_params(layer: nn.Module, slot: Optional[PatchNormSlot]) -> torch.Tensor:
    """The current map as `v`: (groups, K (+1 bias) (+1 shift), out per group), the slot's gain folded in."""
    groups = getattr(layer, 'groups', 1)
    w = fit_order(layer.weight.detach().double())                              # (O, K)
    cols = [w] + ([layer.bias.detach().double()[:, None]] if layer.bias is not None else [])
    v = torch.cat(cols, 1)
    if slot is not None:
        v = v * slot.weight.detach().double()[:, None]
        v = torch.cat([v, slot.bias.detach().double()[:, None]], 1)
    return v.unflatten(0, (groups, -1)).transpose(1, 2)


def set_layer_params(layer: nn.Module, slot: Optional[PatchNormSlot], v: torch.Tensor) -> None:
    v = v.transpose(1, 2).flatten(0, 1)                                          # (O, K (+1) (+1))
    with torch.no_grad():
        if slot is not None:
            shift, v = v[:, -1], v[:, :-1]
            reference = layer.weight.detach().double().flatten(1).norm(dim=1)
            gain = (v[:, :layer.weight[0].numel()].norm(dim=1) / reference.clamp_min(1e-12))
            gain = torch.where(gain > 0, gain, torch.ones_like(gain))
            v = v / gain[:, None]
            slot.weight.copy_(gain)
            slot.bias.copy_(shift)
        k = layer.weight[0].numel()
        layer.weight.copy_(from_fit_order(v[:, :k], layer.weight))
        if layer.bias is not None:
            layer.bias.copy_(v[:, k])

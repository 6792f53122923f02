""" The launchers of `_triton` in torch's operations: what the custom ops compute on after a kernel failed (`auto`)

Same signatures and results as `_triton.channel_sq_norm`, `scale` and `scale_backward` (float32 arithmetic, outputs
in the inputs' dtypes and layouts), so an operation whose kernel failed to build or launch completes with the numbers
the kernels give.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from ..patches import BoxFilter
from ..patches import channel_sq_norm as _channel_sq_norm

_ACTIVATIONS = {'none': lambda z: z, 'relu': F.relu, 'gelu': F.gelu, 'silu': F.silu}


def _per_channel(m: torch.Tensor, channels: int) -> torch.Tensor:
    """A map with one channel per group, broadcast over (or repeated across) the groups' channels."""
    return m if m.shape[1] in (1, channels) else m.repeat_interleave(channels // m.shape[1], 1)


def _into(z: torch.Tensor, like: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    return (torch.empty_like(like) if out is None else out).copy_(z)


def channel_sq_norm(x: torch.Tensor, groups: int, alpha: float = 1., beta: float = 0.) -> torch.Tensor:
    return _channel_sq_norm(x, groups).float().mul(alpha).add(beta).contiguous()


def box_filter(m: torch.Tensor, box: BoxFilter, size) -> torch.Tensor:
    return box(m.float() if not box.squares else m, size).float().contiguous(memory_format=torch.channels_last)


def _per_channel_vector(v: torch.Tensor) -> torch.Tensor:
    return v.float()[:, None, None]


def scale(y: torch.Tensor, m: torch.Tensor, post_bias: Optional[torch.Tensor] = None, act: str = 'none',
          alpha: float = 1., rsqrt: bool = True, base: Optional[torch.Tensor] = None,
          out: Optional[torch.Tensor] = None, gain: Optional[torch.Tensor] = None,
          bias: Optional[torch.Tensor] = None, box: Optional[BoxFilter] = None,
          partials: Optional[torch.Tensor] = None, sums: Optional[torch.Tensor] = None) -> torch.Tensor:
    if partials is not None:
        torch.sum(partials, 1, out=sums)
    if box is not None:
        m = box(m, y.shape[2:])
    m = _per_channel(m.rsqrt() if rsqrt else m, y.shape[1])
    z = y.float() if bias is None else y.float() + _per_channel_vector(bias)
    z = z * m * alpha
    if gain is not None:
        z = z * _per_channel_vector(gain)
    if post_bias is not None:
        z = z + _per_channel_vector(post_bias)
    if base is not None:
        z = z + base.float()
    return _into(_ACTIVATIONS[act](z), y, out)


def scale_backward(grad: torch.Tensor, y: torch.Tensor, b: torch.Tensor, post_bias: Optional[torch.Tensor],
                   act: str, post_bias_grad: bool, grad_y: Optional[torch.Tensor] = None,
                   gain: Optional[torch.Tensor] = None, gain_grad: bool = False, bias: Optional[torch.Tensor] = None,
                   bias_grad: bool = False):
    groups = b.shape[1]
    r_groups = b.rsqrt()
    r = _per_channel(r_groups, y.shape[1])
    y32, g = y.float() if bias is None else y.float() + _per_channel_vector(bias), grad.float()
    yr = y32 * r
    if act != 'none':
        z = yr if gain is None else yr * _per_channel_vector(gain)
        if post_bias is not None:
            z = z + _per_channel_vector(post_bias)
        g = torch.func.vjp(_ACTIVATIONS[act], z)[1](g)[0]
    g_lin = g if gain is None else g * _per_channel_vector(gain)
    dy = g_lin * r
    t = (g_lin * y32).unflatten(1, (groups, -1)).sum(2) * r_groups ** 3
    sums = [g, g * yr, dy]
    affine = [s.sum((0, 2, 3)) for s, wanted in zip(sums, (post_bias_grad, gain_grad, bias_grad)) if wanted]
    return _into(dy, y, grad_y), t.contiguous(), torch.stack(affine)[:, None] if affine else None

""" Measuring the affine divergence: how far one SGD step actually moves an activation

For a loss whose gradient `g` is non-zero at one output vector only (one sample, one
position), the ideal steepest-descent step in activation space is `-lr * g`. After one SGD
step on a set of parameters, the output vector moves by `delta`; the ratio `delta / (-lr * g)`,
per channel, is the effective-update factor: `|x|^2 + 1` (`|P_p|^2 + 1`) for a plain
linear (convolution), the constant `c` for the divergence-corrected layers.
"""
from typing import Callable, Sequence, Tuple

import torch
import torch.nn as nn

__all__ = ['update_factor']


def update_factor(
        forward: Callable[[], torch.Tensor],
        params: Sequence[nn.Parameter],
        index: Tuple,
        lr: float = 1e-3,
) -> torch.Tensor:
    """ The effective-update factor at `output[index]` for one SGD step on `params`.

    `forward` recomputes the output; `index` selects one vector of it (e.g. `(n, slice(None), i, j)`).
    The gradient is `g = 1 + u`, `u ~ U(0, 1)` at `index`, zero elsewhere. Parameters are restored
    afterwards. Returns `delta / (-lr * g)` at `index`, per element.
    """
    params = [p for p in params if p is not None]
    out = forward()
    grad_out = torch.zeros_like(out)
    grad_out[index] = 1 + torch.rand_like(grad_out[index])
    grads = torch.autograd.grad(out, params, grad_out)
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)
            moved = forward()
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return (moved[index] - out.detach()[index]) / (-lr * grad_out[index])

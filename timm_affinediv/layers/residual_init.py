""" How a freshly built `patchnorm` model's residual branches start: SkipInit gains and a zero classifier

timm zero-initialises the last norm of every residual branch (`zero_init_last`), so that a BatchNorm network
starts as its shortcuts alone. A BatchNorm network survives that: its norms divide by the batch's spread, so even
the tiny differences between images that a chain of strided 1x1 shortcuts carries are scaled back to unit
variance. A PatchNorm slot divides by the patch's own norm instead, and never centres: the network of shortcuts
can give every image nearly the same output, and SGD then finds no gradient to leave it by (measured in
docs/results/results.md, section 6).

The default (`"skipinit"`) keeps every branch small but open: where timm zeroed the last slot of a branch, its gain
starts at `1 / sqrt(N)` instead, `N` the number of branches zeroed (SkipInit, De & Smith 2020: the branches
together then add at most the shortcut's variance), and the classifier starts at zero (Fixup, Zhang et al. 2019),
so that the first steps do not push the shared logit offset around while the features are still alike. Both are
initial values only: the layers compute the paper's function, each divergence factor stays its constant, and
pretrained or converted weights replace them. `"timm"` leaves timm's initialisation as it is.

    with residual_init('timm'):
        model = timm.create_model('resnet50', norm_layer='patchnorm')
"""
import contextlib
import math
import threading
from typing import Iterator, List

import torch
import torch.nn as nn

from ..errors import OptionError
from .slot import PatchNormSlot

__all__ = ['RESIDUAL_INITS', 'residual_init', 'get_residual_init', 'init_residual_branches']

RESIDUAL_INITS = ('skipinit', 'timm')
_state = threading.local()


def _check_policy(policy: str) -> None:
    if policy not in RESIDUAL_INITS:
        raise OptionError(f"residual_init takes one of {RESIDUAL_INITS}, got {policy!r}")


def get_residual_init() -> str:
    """The policy `timm.create_model` applies to a `patchnorm` model's residual branches in this thread."""
    return getattr(_state, 'policy', 'skipinit')


@contextlib.contextmanager
def residual_init(policy: str) -> Iterator[None]:
    """ Build `patchnorm` models with `policy` ('skipinit', the default, or 'timm') inside the block. """
    _check_policy(policy)
    previous = get_residual_init()
    _state.policy = policy
    try:
        yield
    finally:
        _state.policy = previous


def _zeroed_slots(model: nn.Module) -> List[PatchNormSlot]:
    """The slots whose gain the model's own initialisation set to zero: the last of each residual branch (a slot
    is built with gains of one)."""
    return [m for m in model.modules() if isinstance(m, PatchNormSlot) and not m.weight.is_meta
            and m.weight.numel() and not m.weight.detach().any()]


@torch.no_grad()
def init_residual_branches(model: nn.Module, policy: str = 'skipinit') -> int:
    """ Apply `policy` to a freshly built model's residual branches (in place) and return how many branches it
    opened: with "skipinit", every slot whose gain timm zeroed gets `1 / sqrt(N)` for `N` such slots and, where
    there is at least one, the classifier's weight and bias start at zero; "timm" changes nothing.
    """
    _check_policy(policy)
    slots = _zeroed_slots(model) if policy == 'skipinit' else []
    if not slots:
        return 0
    gain = 1.0 / math.sqrt(len(slots))
    for slot in slots:
        slot.weight.fill_(gain)
    classifier = model.get_classifier() if hasattr(model, 'get_classifier') else None
    for param in (getattr(classifier, 'weight', None), getattr(classifier, 'bias', None)):
        if isinstance(param, torch.Tensor) and not param.is_meta:
            param.zero_()
    return len(slots)

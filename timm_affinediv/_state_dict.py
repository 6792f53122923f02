""" Weights files a user names, read and loaded or refused in one short line

A checkpoint, an initial checkpoint, a teacher's weights or a Hub folder's `model.safetensors` may come from anyone:
it is read as safetensors or through `torch.load(weights_only=True)` (timm's `load_state_dict`), so nothing in it
runs, and it is refused, before any model uses it, when it cannot be read (a truncated download), holds NaN or
infinite values, or does not fit the model. `nn.Module.load_state_dict` lists every mismatched key, thousands of
characters for a whole model; a person needs the kind of mismatch and the first few keys of each kind.
"""
from dataclasses import dataclass
from typing import Dict, List, Mapping

import timm
import torch
import torch.nn as nn

from .errors import AffineDivError, CheckpointError, NormMismatchError

__all__ = ['WeightsFile', 'describe_mismatch', 'check_finite']


def _first(keys: List[str], shown: int) -> str:
    more = f' and {len(keys) - shown} more' if len(keys) > shown else ''
    return ', '.join(keys[:shown]) + more


def describe_mismatch(model: nn.Module, state_dict: Mapping[str, torch.Tensor], shown: int = 3) -> str:
    """'2 missing keys (a, b), 1 unexpected (c), 1 of another shape (d: (10, 64) in the checkpoint, (1000, 64) in the
    model)': at most `shown` keys of each kind, then how many more; '' if `state_dict` fits `model`."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    reshaped = [k for k in expected if k in state_dict and tuple(state_dict[k].shape) != tuple(expected[k].shape)]
    parts = []
    if missing:
        parts.append(f'{len(missing)} missing key{"s" * (len(missing) > 1)} ({_first(missing, shown)})')
    if unexpected:
        parts.append(f'{len(unexpected)} unexpected ({_first(unexpected, shown)})')
    if reshaped:
        shapes = [f'{k}: {tuple(state_dict[k].shape)} in the checkpoint, {tuple(expected[k].shape)} in the model'
                  for k in reshaped]
        parts.append(f'{len(reshaped)} of another shape ({_first(shapes, shown)})')
    return ', '.join(parts)


def check_finite(state_dict: Mapping[str, torch.Tensor], source: str, error: type[AffineDivError]) -> None:
    """Raise `error` when a floating tensor of `state_dict` holds NaN or infinite values: such weights give NaN
    outputs (and NaN losses), whatever the input."""
    bad = [k for k, v in state_dict.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise error(f'{source} holds NaN or infinite values in {len(bad)} tensor{"s" * (len(bad) > 1)} '
                    f'({_first(bad, 3)}): a model with them outputs NaN. Use weights saved before the values diverged, '
                    'or download them again.')


@dataclass(frozen=True)
class WeightsFile:
    """A weights file the user named: `what` it is for the messages ('checkpoint', 'initial checkpoint'), its path,
    and the error its refusals raise (each caller keeps the one it documents)."""
    what: str
    path: str
    error: type[AffineDivError] = CheckpointError

    def __str__(self) -> str:
        return f'{self.what} {self.path}'

    def read(self) -> Dict[str, torch.Tensor]:
        """Its state dict, as timm reads one (`timm.models.load_state_dict`: safetensors, or a PyTorch checkpoint
        through `torch.load(weights_only=True)`; EMA weights preferred), all of its values finite."""
        try:
            state_dict = timm.models.load_state_dict(self.path)
        except Exception as e:  # truncated, not a checkpoint at all, a pickle that weights_only refuses: many types
            raise self.error(f'{self} is unreadable ({type(e).__name__}: {" ".join(str(e).split())}); a download '
                             'or a copy may have been cut short: fetch or write it again.') from e
        check_finite(state_dict, str(self), self.error)
        return state_dict

    def load_into(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], target: str = 'the model',
                  hint: str = '') -> None:
        """Load `state_dict` (this file's) into `model` strictly; a mismatch names its first keys, then `hint`."""
        try:
            model.load_state_dict(state_dict, strict=True)
        except NormMismatchError as e:  # a BatchNorm checkpoint for patchnorm slots
            raise self.error(f'{self}: {e}') from e
        except RuntimeError as e:  # missing / unexpected keys, shape mismatches
            mismatch = describe_mismatch(model, state_dict) or ' '.join(str(e).split())
            raise self.error(f'{self} does not fit {target}: {mismatch}.{hint and " " + hint}') from e

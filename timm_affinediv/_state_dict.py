""" What keeps a state dict from fitting a model, in one short line

`nn.Module.load_state_dict` lists every mismatched key, thousands of characters for a whole model; a person needs
the kind of mismatch and the first few keys of each kind.
"""
from typing import List, Mapping

import torch
import torch.nn as nn

__all__ = ['describe_mismatch']


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

""" Checkpoint I/O: weights files, atomic writes, RNG states, and the checkpoint folders of a run

A run's checkpoints are folders `checkpoints/<name>/` (`model.safetensors`, `ema.safetensors`, `train_state.pt`)
written atomically (a temporary folder renamed into place), with `checkpoints/last.json` / `best.json` naming the
latest and the best.
"""
import json
import os
import random
import shutil
from typing import Any, Dict

import numpy as np
import torch
import torch.nn as nn

from .._state_dict import WeightsFile
from .config import CheckpointError, ConfigError

__all__ = ['resolve_checkpoint', 'prune_checkpoints', 'STATE_FILE', 'MODEL_FILE', 'EMA_FILE', 'read_weights',
           'load_weights', 'rng_state', 'set_rng_state']

CHECKPOINT_FORMAT = 1
STATE_FILE = 'train_state.pt'
MODEL_FILE = 'model.safetensors'
EMA_FILE = 'ema.safetensors'


def _weights_file(path: str, what: str) -> str:
    """A weights file, or the `model.safetensors` of a (Hub-format) folder: a folder's other files (a pickled
    `pytorch_model.bin`) are never read."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, MODEL_FILE)):
            raise ConfigError(f'{what} {path} is a folder without {MODEL_FILE}; give a folder holding it (a Hub '
                              'folder, downloaded in full) or a .safetensors / .pth file.')
        path = os.path.join(path, MODEL_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f'{what} {path} not found; give a .safetensors / .pth file or a folder holding '
                          f'{MODEL_FILE}.')
    return path


def read_weights(path: str, what: str) -> Dict[str, torch.Tensor]:
    """A state dict from a weights file or Hub-format folder, refused in one line when unreadable or not finite
    (`WeightsFile.read`)."""
    return WeightsFile(what, _weights_file(path, what), ConfigError).read()


def load_weights(model: nn.Module, state_dict: Dict[str, torch.Tensor], path: str, what: str) -> None:
    WeightsFile(what, path, ConfigError).load_into(model, state_dict)


def resolve_checkpoint(path: str) -> str:
    """The checkpoint folder `path` names: a checkpoint folder itself, or a run's output folder (its latest one)."""
    if os.path.isfile(os.path.join(path, STATE_FILE)):
        return path
    pointer = os.path.join(path, 'checkpoints', 'last.json')
    if os.path.isfile(pointer):
        try:
            with open(pointer) as f:
                name = json.load(f)['checkpoint']
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f'{pointer} is unreadable ({e}); resume from a folder under '
                                  f'{os.path.dirname(pointer)} instead.') from e
        return os.path.join(path, 'checkpoints', name)
    raise CheckpointError(f'no checkpoint at {path}: give a run output folder (with checkpoints/last.json) or a '
                          f'checkpoint folder (with {STATE_FILE}).')


def rng_state() -> Dict[str, Any]:
    """torch / numpy / python RNG states, in types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state = dict(
        torch=torch.get_rng_state(),
        numpy=(np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        python=random.getstate(),
    )
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state['torch'])
    name, keys, *rest = state['numpy']
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(tuple(tuple(s) if isinstance(s, list) else s for s in state['python']))
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


def prune_checkpoints(checkpoint_dir: str, keep_last: int) -> None:
    """Delete the checkpoint folders of `checkpoint_dir` but the last `keep_last` epochs' and those `last.json` /
    `best.json` name."""
    keep = set()
    for pointer in ('last.json', 'best.json'):
        try:
            with open(os.path.join(checkpoint_dir, pointer)) as f:
                keep.add(json.load(f)['checkpoint'])
        except FileNotFoundError:
            pass
    folders = sorted(d for d in os.listdir(checkpoint_dir)
                     if d.startswith(('epoch-', 'interrupt-')))
    keep.update([d for d in folders if d.startswith('epoch-')][-keep_last:])
    for d in folders:
        if d not in keep:
            shutil.rmtree(os.path.join(checkpoint_dir, d), ignore_errors=True)

""" What a Hub folder must hold before it is loaded or published

A Hub folder is downloaded from people its user does not know, or left half-written by an interrupted download or
copy. Before anything is built from it, its `config.json` must be a JSON object naming an architecture, with one
class name per output when it names them (transformers' pipeline labels the outputs with them, in order), and its
`model.safetensors` a complete safetensors file; each refusal is one line (`HubError`) naming the file and what to
do. Weights are read as safetensors only: a folder of timm-affinediv's without `model.safetensors` is refused rather
than left to timm's fallback to a pickled `pytorch_model.bin`.
"""
import json
import os
from pathlib import Path
from typing import Any, Dict, Mapping

import safetensors

from ._timm_compat import download_from_hf
from .errors import HubError, MissingFileError

__all__ = ['WEIGHTS_NAME', 'CONFIG_NAME', 'check_folder', 'read_config', 'check_labels', 'missing_weights',
           'check_weights_file']

WEIGHTS_NAME = 'model.safetensors'
CONFIG_NAME = 'config.json'
_WRITE_AGAIN = 'download the folder again, or write it again with timm_affinediv.hub.save_hub_folder.'


def check_folder(name: str) -> Dict[str, Any]:
    """The checked ``config.json`` of the folder timm's model name ``name`` gives (``local-dir:PATH`` or
    ``hf-hub:ORG/NAME``), read before timm builds anything from it, and a local folder's ``model.safetensors`` where
    it has one (timm's own folders may hold other weights; the plugin's loader requires this one)."""
    source, _, where = name.partition(':')
    if source == 'hf-hub':
        return read_config(Path(download_from_hf(where, CONFIG_NAME)))
    folder = Path(where)
    config = read_config(folder / CONFIG_NAME)
    if os.path.lexists(folder / WEIGHTS_NAME):
        check_weights_file(folder / WEIGHTS_NAME)
    return config


def read_config(path: Path) -> Dict[str, Any]:
    """The content of the `config.json` at `path`, refused unless it is a JSON object naming an architecture, whose
    `pretrained_cfg` and `model_args` (where present) are objects and whose class names match its class count."""
    try:
        config = json.loads(path.read_text(encoding='utf-8'))
    except FileNotFoundError as e:
        raise MissingFileError(f'{path} not found: give a Hub folder (config.json, model.safetensors).') from e
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise HubError(f'{path} is not readable JSON ({" ".join(str(e).split())}): {_WRITE_AGAIN}') from e
    if not isinstance(config, dict):
        raise HubError(f'{path} holds a JSON {type(config).__name__}, not the object of a timm config.json: '
                       f'{_WRITE_AGAIN}')
    if not isinstance(config.get('architecture'), str) or not config['architecture']:
        raise HubError(f'{path} names no architecture (its "architecture" entry): {_WRITE_AGAIN}')
    for key in ('pretrained_cfg', 'model_args'):
        if not isinstance(config.get(key, {}), dict):
            raise HubError(f'{path}: its "{key}" is a {type(config[key]).__name__}, not an object: {_WRITE_AGAIN}')
    check_labels(config, str(path))
    check_labels(config.get('pretrained_cfg', {}), str(path))
    return config


def check_labels(config: Mapping[str, Any], source: str) -> None:
    """Refuse `label_names` that do not name each of `num_classes` outputs once: transformers makes them its
    `id2label`, and its pipeline would name the outputs wrongly."""
    names, num_classes = config.get('label_names'), config.get('num_classes')
    if names is None:
        return
    if not isinstance(names, (list, dict)) or not all(isinstance(n, str) for n in (
            names.values() if isinstance(names, dict) else names)):
        raise HubError(f'{source}: label_names must be a list of class names, one per output; fix it in '
                       f'config.json, or {_WRITE_AGAIN}')
    if isinstance(num_classes, int) and len(names) != num_classes:
        raise HubError(
            f'{source} names {len(names)} classes (label_names) for {num_classes} outputs (num_classes): a pipeline '
            f'would label the outputs with the wrong names. Give one name per output in config.json, or {_WRITE_AGAIN}')


def missing_weights(source: str) -> HubError:
    """The refusal of a plugin folder (``source``: its path or ``hf-hub:`` name) without ``model.safetensors``."""
    return HubError(f'{source} has no {WEIGHTS_NAME}: a timm-affinediv Hub folder keeps its weights there, and pickled '
                    f'weights (pytorch_model.bin) are never loaded, since they can run code: {_WRITE_AGAIN}')


def check_weights_file(path: Path) -> None:
    """Refuse a missing `model.safetensors`, or one that is not a complete safetensors file (a cut-short download:
    safetensors checks that its header is whole and its tensors cover the file exactly)."""
    if not path.is_file():
        raise missing_weights(str(path.parent))
    try:
        with safetensors.safe_open(path, framework='pt'):
            pass
    except (safetensors.SafetensorError, OSError) as e:
        raise HubError(f'{path} is not a complete safetensors file ({" ".join(str(e).split())}); a download or copy '
                       f'may have been cut short: {_WRITE_AGAIN}') from e

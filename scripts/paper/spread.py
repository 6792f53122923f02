""" Why a family trains better with PatchNorm, one measurement: how much the divergence factor varies within each of
its native model's layers, depthwise convolutions against the rest

A plain convolution's step moves an output by `|P_p|^2 + 1` times the ideal step, `P_p` the input patch it reads; a
depthwise convolution's patch is k x k values of one channel, where a dense one's is k x k x C_in, so its norm varies
more from position to position and sample to sample. `layer_spreads` measures the factor (`diagnostics.
divergence_report`) in every layer of a trained model and gives each layer's spread (max / min), by kind.
"""
import json
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn

from timm_affinediv.diagnostics import divergence_report
from timm_affinediv.files import atomic_write

from .runs import Config, RunResult, Setting, cached_splits, run_path, train_run

__all__ = ['KINDS', 'layer_kind', 'layer_spreads', 'native_spreads', 'spread_table']

KINDS = ('depthwise conv', 'dense conv', 'linear')


def layer_kind(layer: nn.Module) -> str:
    """'depthwise conv' (one input channel per group), 'dense conv' (any other convolution) or 'linear'."""
    if isinstance(layer, nn.Conv2d):
        return 'depthwise conv' if layer.groups > 1 and layer.groups == layer.in_channels else 'dense conv'
    return 'linear'


def layer_spreads(model: nn.Module, images: torch.Tensor, samples: int = 8, positions: int = 8
                  ) -> Dict[str, List[float]]:
    """ Every affine layer's spread of the divergence factor (max / min over `samples` images x `positions`
    positions) in `model` (eval mode) on `images`, by `layer_kind`. """
    modules = dict(model.named_modules())
    spreads: Dict[str, List[float]] = {kind: [] for kind in KINDS}
    for stats in divergence_report(model.eval(), images, samples=samples, positions_per_sample=positions):
        spreads[layer_kind(modules[stats.name])].append(stats.spread)
    return spreads


def native_spreads(
        results: Sequence[Tuple[Setting, List[RunResult], List[RunResult]]], config: Config, seed: int,
        folder: Path, data_root, log: Callable[[str], None], train: bool = True,
) -> Dict[str, Dict[str, Dict[str, float]]]:
    """ For each model's native variant at the short budget: the first seed's run at the chosen rate again (the same
    weights: a run is determined by its seed), and the median and count of its layers' spreads by kind on the first
    test images; each model's written to `folder` and read back from there on a rerun (without `train`, the models
    not measured yet are left out). """
    data = cached_splits(config, 32, data_root)
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for setting, _, final in results:
        if setting.variant != 'native' or setting.epochs != config.epochs:
            continue
        path = run_path(folder, setting, final[0].lr, seed)
        if path.is_file():
            out[setting.model] = json.loads(path.read_text())
            continue
        if not train:
            continue
        kept: List[nn.Module] = []
        train_run(setting.build, data, final[0].lr, setting.batch_size, seed, setting.epochs, setting.steps,
                  name=setting.name, recipe=setting.recipe, keep=kept.append)
        spreads = layer_spreads(kept[0], data.test[0][:64])
        out[setting.model] = {kind: dict(layers=len(v), median=float(np.median(v)) if v else None)
                              for kind, v in spreads.items()}
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(out[setting.model], indent=1))
        log(f'{setting.model}: ' + ', '.join(f"{k} {v['layers']} layers, median spread {v['median']:.3g}"
                                            for k, v in out[setting.model].items() if v['layers']))
    return out


def spread_table(spreads: Dict[str, Dict[str, Dict[str, float]]], cells: Sequence[Dict[str, object]]) -> str:
    """ The spreads by family and kind, beside the family's `patchnorm` minus native difference at the short
    budget (`cells`: the families analysis's). """
    short = {}
    for c in cells:
        if c['model'] not in short or c['epochs'] < short[c['model']]['epochs']:
            short[c['model']] = c
    lines = ['| family | native norm | ' + ' | '.join(f'{k}: layers, median spread' for k in KINDS)
             + ' | patchnorm - native |', '|---|---|' + '---:|' * (len(KINDS) + 1)]
    for model, by_kind in spreads.items():
        if model not in short:
            continue

        def cell(kind):
            v = by_kind[kind]
            return f"{v['layers']}, {v['median']:.3g}" if v['layers'] else '-'
        c = short[model]
        lines.append(f"| {model} | {c['native_norm']} | " + ' | '.join(cell(k) for k in KINDS)
                     + f" | {c['diff']:+.2f} ({c['verdict']}) |")
    return '\n'.join(lines) + '\n'

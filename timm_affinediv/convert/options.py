""" The conversion's settings, one typed object: `ConvertOptions`, its groups `FitOptions`, `ReconstructOptions` and
`DistillOptions` (as timm groups `optimizer_kwargs` and `scheduler_kwargs`)

    options = ConvertOptions(fit=FitOptions(ridge=0.1), distill=DistillOptions(epochs=2), device='cuda')
    options = ConvertOptions().updated({'fit.ridge': 0.1, 'distill.epochs': 2})   # the same, by dotted names
    converted, report = convert_model(model, calibration=batches, options=options)
"""
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

import torch

from ..errors import ConversionError

__all__ = ['FitOptions', 'ReconstructOptions', 'DistillOptions', 'ConvertOptions', 'option_names']


@dataclass
class FitOptions:
    """ The least-squares fit of every corrected layer on the calibration images (`solver.py`, `features.py`).

    Args:
        ridge: strength of the pull towards the analytic map, relative to the mean diagonal of the normal equations.
        positions_per_batch: output positions sampled per batch and layer for the fit, at most.
        positions_per_unknown: at most this many sampled positions per unknown of a layer's fit (its fan-in, plus
            the bias and the slot's shift), over all batches: a least-squares fit needs a multiple of its unknowns,
            and `U^T U` costs positions x unknowns^2, which would dwarf the forward passes in a wide layer (None:
            `positions_per_batch` from every batch).
        analytic_batches: the first calibration batches the analytic map's top-1 agreement with the original is
            measured on, in a forward pass of its own (None: all; 0: not measured); a diagnostic.
        calib_memory: bytes of activations kept between two steps of the calibration walk; beyond, they spill to a
            temporary folder.
        cache_dtype: the dtype those activations are kept in (None: as computed, exact; torch.float16 halves the
            memory at float16 precision).
    """
    ridge: float = 1e-2
    positions_per_batch: int = 2048
    positions_per_unknown: Optional[float] = 32.
    analytic_batches: Optional[int] = 1
    calib_memory: int = 4 << 30
    cache_dtype: Optional[torch.dtype] = None


@dataclass
class ReconstructOptions:
    """ Block-wise reconstruction after the fit (`reconstruct.py`); off by default.

    Args:
        steps: Adam steps per block at most (0: none).
        threshold: where the fitted model's logits have a relative squared error above this on the calibration
            images, the blocks whose output has one above it are reconstructed.
        lr: Adam's learning rate (constant).
        tolerance: a block stops once a pass over the batches lowers its mean loss by less than this fraction.
    """
    steps: int = 0
    threshold: float = 0.1
    lr: float = 3e-3
    tolerance: float = 0.02


@dataclass
class DistillOptions:
    """ Logit distillation of the whole converted model after the fit (`distill.py`).

    It runs where the fitted model's top-1 agreement with the original on the held-out images (those neither fitted
    nor distilled on; the calibration images where none are given) is below `threshold`, on the distillation
    images (the calibration images where none are given), the original's logits computed as it goes.

    Args:
        epochs: passes over the distillation images at most (0: none).
        lr: Adam's peak learning rate.
        features: the weight, beside the logits' KL, of the fitted layers' outputs in the loss: the mean over the
            corrected layers of the relative squared error of each one's output against the original's value where
            it was fitted to (0: the logits alone).
        warmup: the fraction of a pass's steps over which the learning rate rises to `lr`; a cosine then takes it to
            0 by the pass's end (each pass a cycle).
        threshold: the held-out top-1 agreement below which the model is distilled (1: always).
        patience: with held-out images, stop after this many passes in a row that do not lower the held-out KL
            (None: never early); the parameters of the pass of lowest held-out KL are kept.
        batch_size: the batches a dataset of distillation images is read in (an iterable of batches is read as it
            comes).
    """
    epochs: int = 2
    lr: float = 3e-4
    features: float = 1.0
    warmup: float = 0.2
    threshold: float = 0.96
    patience: Optional[int] = 1
    batch_size: int = 64


@dataclass
class ConvertOptions:
    """ Everything `convert_model` does besides which model and data: the fit, block reconstruction, distillation,
    and where it runs.

    Args:
        fit: the least-squares fit (`FitOptions`).
        reconstruct: block reconstruction (`ReconstructOptions`).
        distill: distillation (`DistillOptions`).
        device: where the passes run and the fits are solved: 'cpu', 'cuda', or 'auto'/None (CUDA when available).
        progress: show a progress bar.
        seed: seed of the positions' draw, and of the reconstruction's and distillation's batch order.
    """
    fit: FitOptions = field(default_factory=FitOptions)
    reconstruct: ReconstructOptions = field(default_factory=ReconstructOptions)
    distill: DistillOptions = field(default_factory=DistillOptions)
    device: Optional[str] = None
    progress: bool = False
    seed: int = 0

    def updated(self, overrides: Mapping[str, Any]) -> 'ConvertOptions':
        """ A copy with `overrides` applied, by dotted names (`{'fit.ridge': 0.1, 'distill.epochs': 0, 'seed': 1}`):
        what a script's `--convert-kwargs fit.ridge=0.1` gives. An unknown name raises `ConversionError`."""
        known = option_names()
        changes: Dict[str, Dict[str, Any]] = {'': {}}
        for name, value in overrides.items():
            if name not in known:
                raise ConversionError(f"unknown conversion option '{name}': use one of {', '.join(known)}")
            group, _, key = name.rpartition('.')
            changes.setdefault(group, {})[key] = value
        top = changes.pop('')
        return dataclasses.replace(self, **top, **{g: dataclasses.replace(getattr(self, g), **values)
                                                   for g, values in changes.items()})

    def to_dict(self) -> Dict[str, Any]:
        """The options as JSON-able values (a dtype by its name), for the conversion report."""
        return dataclasses.asdict(self, dict_factory=lambda items: {
            k: str(v) if isinstance(v, torch.dtype) else v for k, v in items})


_GROUPS = {'fit': FitOptions, 'reconstruct': ReconstructOptions, 'distill': DistillOptions}


def option_names() -> List[str]:
    """Every option by its dotted name (`fit.ridge`, ..., `distill.epochs`, ..., `device`, `progress`, `seed`)."""
    return [f'{g}.{f.name}' for g, options in _GROUPS.items() for f in dataclasses.fields(options)] + [
        f.name for f in dataclasses.fields(ConvertOptions) if f.name not in _GROUPS]

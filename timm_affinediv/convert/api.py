""" The conversion's entry point: `convert_model`, its options and its report (see the package docstring) """
import contextlib
import copy
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
from timm.layers import BatchNormAct2d

from ..device import resolve_device
from ..errors import ConversionError
from ..layers.affine_div import AffineDivLinear, PatchNormConv2d
from ..layers.binding import fuses_qkv_bias, separate_qkv_biases
from ..layers.patches import is_channels_last
from ..layers.slot import PatchNormSlot
from .distill import (
    Agreement,
    DistillationFit,
    batch_images,
    compare_logits,
    distill_logits,
    distillation_batches,
    measure_agreement,
)
from .features import layer_params, output_targets, patch_features, set_layer_params
from .graph import ActivationCache, GraphWalk, trace
from .options import ConvertOptions, FitOptions, option_names
from .rebuild import architecture, build_converted, carry_weights, check_norms, model_in_chans
from .reconstruct import BlockFit, reconstruct_blocks, relative_squared_error
from .solver import NormalEquations

__all__ = ['convert_model', 'ConversionReport', 'LayerFit', 'positions_per_batch_for']

_logger = logging.getLogger(__name__)


@dataclass
class LayerFit:
    """How well one corrected layer reproduces the original at `target`, before and after fitting."""
    layer: str
    target: str
    positions: int
    rel_err_before: float
    cos_before: float
    rel_err_after: float
    cos_after: float


@dataclass
class ConversionReport:
    """ What `convert_model` did and how close the converted model is to the original.

    The agreement fields compare the converted model's top-1 prediction and class distribution with the original's:
    `agreement_fitted` after the fit (and any reconstruction), `agreement` for the model returned, both on the check
    images: the `heldout_images` held-out images (neither fitted nor distilled on) where they were given, else the
    calibration images. `top1_agreement_*` are on the calibration images, as each step left the model.
    """
    architecture: str
    norm: str
    calibration_batches: int
    calibration_images: int
    seconds: float
    top1_agreement_analytic: Optional[float] = None
    analytic_images: int = 0
    top1_agreement_calibrated: Optional[float] = None
    top1_agreement_reconstructed: Optional[float] = None
    output_error_calibrated: Optional[float] = None
    layers: List[LayerFit] = field(default_factory=list)
    blocks: List[BlockFit] = field(default_factory=list)
    heldout_images: int = 0
    agreement_fitted: Optional[Agreement] = None
    agreement: Optional[Agreement] = None
    distillation: Optional[DistillationFit] = None
    options: Optional[dict] = None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def check_images(self) -> str:
        """The images the agreement was measured on, in words."""
        return (f'{self.heldout_images} held-out images (neither fitted nor distilled on)' if self.heldout_images else
                f'{self.calibration_images} calibration images (no held-out images given)')

    def describe(self) -> str:
        """ What the conversion did, in one sentence: the fit, which blocks were reconstructed (steps each), the
        agreement with the original on the check images that decided the distillation, what the distillation did,
        and the agreement of the model returned (the model card's recipe)."""
        text = f'{len(self.layers)} divergence-corrected layers fitted by ridge least squares'
        trained = [b for b in self.blocks if b.steps]
        options = self.options or {}
        reconstruct, distill = options.get('reconstruct', {}), options.get('distill', {})
        if self.blocks:
            text += (f'; {len(trained)} of {len(self.blocks)} blocks had a relative squared output error above '
                     f"{reconstruct['threshold']:g} after the fit and were reconstructed"
                     + (' (' + ', '.join(f'{b.block}: {b.steps} Adam steps, error {b.rel_err_before:.3f} -> '
                                         f'{b.rel_err_after:.3f}' for b in trained) + ')' if trained else ''))
        elif reconstruct.get('steps'):
            text += (f"; the fitted model's output (relative squared error {self.output_error_calibrated:.3f}) was "
                     f"within {reconstruct['threshold']:g} of the original's, so no block was reconstructed")
        a, d = self.agreement_fitted, self.distillation
        if a is None:
            return text
        threshold = distill.get('threshold')
        text += (f"; top-1 agreement with the original on the {self.check_images} {100 * a.top1:.1f}% "
                 f'(mean KL {a.kl:.4f}) after the {"reconstruction" if trained else "fit"}')
        if d is None:
            return text + (f', at least {100 * threshold:g}%, so it was not distilled' if distill.get('epochs') else '')
        text += (f", under {100 * threshold:g}%, so the whole model was distilled on the original's logits over "
                 f'{d.images} images a pass, {d.epochs} passes ({d.steps} Adam steps'
                 + (', stopped early' if d.stopped_early else '') + ')')
        if d.kept_epoch:
            return text + (f'; pass {d.kept_epoch} kept: agreement {100 * self.agreement.top1:.1f}% '
                           f'(mean KL {self.agreement.kl:.4f})')
        return text + '; no pass agreed better, so the fit was kept'

    def format_table(self) -> str:
        """The per-layer fidelity as a markdown table, then the whole-model agreement."""
        lines = ['| layer | target | rel. err before | cos before | rel. err after | cos after |',
                 '|---|---|---:|---:|---:|---:|']
        lines += [f'| {f.layer} | {f.target} | {f.rel_err_before:.4f} | {f.cos_before:.4f} | '
                  f'{f.rel_err_after:.4f} | {f.cos_after:.4f} |' for f in self.layers]
        if self.blocks:
            lines += ['', '| block | rel. sq. err after the fit | reconstruction steps | after reconstruction |',
                      '|---|---:|---:|---:|']
            lines += [f'| {b.block} | {b.rel_err_before:.4f} | {b.steps} | {b.rel_err_after:.4f} |'
                      for b in self.blocks]
        lines.append('')
        if self.top1_agreement_analytic is not None:
            lines.append(f'top-1 agreement with the original on the calibration images: analytic map '
                         f'{100 * self.top1_agreement_analytic:.2f}% (first {self.analytic_images} images)'
                         + ('' if self.top1_agreement_calibrated is None else
                            f', calibrated {100 * self.top1_agreement_calibrated:.2f}%')
                         + ('' if self.top1_agreement_reconstructed is None else
                            f', reconstructed {100 * self.top1_agreement_reconstructed:.2f}%'))
        if self.agreement_fitted is not None:
            lines.append(f'on the {self.check_images}: after the fit {100 * self.agreement_fitted.top1:.2f}% '
                         f'(mean KL {self.agreement_fitted.kl:.4f})'
                         + ''.join(f', pass {i} {100 * p.top1:.2f}% ({p.kl:.4f})'
                                   for i, p in enumerate(self.distillation.passes if self.distillation else [], 1))
                         + f'; returned {100 * self.agreement.top1:.2f}% (mean KL {self.agreement.kl:.4f})')
        lines.append(f'{self.architecture} -> {self.norm}, {self.calibration_batches} calibration batches '
                     f'({self.calibration_images} images), {self.seconds:.1f} s')
        return '\n'.join(lines)


def _check_batch(images, in_chans: int, what: str = 'calibration') -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != in_chans:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ConversionError(
            f'{what} batches must be image tensors (N, {in_chans}, H, W) (or (images, labels) pairs), '
            f'got {shape}: use data with {in_chans} channel(s) and the size the model was trained at')


def _on_device(batches: List[torch.Tensor], device: torch.device) -> List[torch.Tensor]:
    # a batch made in inference mode cannot be saved for a backward pass: a copy of it can
    return [x.to(device).clone() if x.is_inference() else x.to(device) for x in batches]


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """torch's, Python's and numpy's generators seeded with `seed`, and restored after: a dataset's augmentation
    draws from all three in the loader's process (timm's random interpolation from Python's)."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _refuse_flat_options(model_kwargs: dict) -> None:
    """The conversion's settings come in `options`: a keyword naming one of them would reach timm.create_model."""
    names = {n.rpartition('.')[2] for n in option_names()} | {n.replace('.', '_') for n in option_names()}
    for key in model_kwargs:
        if key in names:
            raise ConversionError(
                f"'{key}' is not a keyword of convert_model: its settings are one object, options=ConvertOptions("
                f'fit=FitOptions(...), reconstruct=ReconstructOptions(...), distill=DistillOptions(...), device=..., '
                f"progress=..., seed=...) (or ConvertOptions().updated({{'distill.epochs': ...}}))")


@torch.inference_mode(False)  # the distillation trains the converted model, whatever mode the caller is in
def convert_model(
        model: nn.Module,
        norm: str = 'patchnorm',
        calibration: Optional[Iterable] = None,
        *,
        options: Optional[ConvertOptions] = None,
        distill_data: Optional[Iterable] = None,
        heldout: Optional[Iterable] = None,
        **model_kwargs,
) -> Tuple[nn.Module, ConversionReport]:
    """ Rebuild `model` (a BatchNorm/LayerNorm timm model) with `norm` ("patchnorm" or "affinediv").

    Args:
        model: the trained timm model; it is not modified (it is moved to the options' device and back).
        norm: "patchnorm" (norm slots bound to their convolutions), or "affinediv" (every Conv2d/Linear
            divergence corrected, the slots only affine).
        calibration: an iterable of image batches (or (images, labels) pairs), read once and held in memory: every
            corrected layer is fitted on them (ridge least squares). Without it, the analytic map only.
        options: how (`ConvertOptions`: the fit, block reconstruction, distillation, device, seed); its defaults
            where None.
        distill_data: the images the whole model is distilled on where its agreement with the original is below
            `options.distill.threshold`: a `Dataset` of images (or (image, label) pairs), read in shuffled batches of
            `options.distill.batch_size`, or an iterable of batches with a length (a `DataLoader`: streamed, each
            pass read anew, so a loader with train-time augmentation gives new views each pass). The original's
            logits are computed on each batch. None: the calibration images.
        heldout: image batches (or pairs) neither fitted nor distilled on, held in memory: the agreement that
            decides the distillation, stops it early and is reported is measured there. None: on the calibration
            images, and the distillation runs its epochs.
        **model_kwargs: passed to `timm.create_model`, over the arguments `model` was created with.

    Returns:
        The converted model (in eval mode, on the device and in the memory format of `model`) and the report.
    """
    _refuse_flat_options(model_kwargs)
    options = options or ConvertOptions()
    start = time.perf_counter()
    was_training = model.training
    home = next(model.parameters()).device
    device = resolve_device(options.device)
    converted = build_converted(model, norm, **model_kwargs).eval()
    norms = check_norms(model, converted)
    carry_weights(model, converted, norms)
    in_chans = model_in_chans(model)
    batches = [batch_images(b) for b in calibration] if calibration is not None else []
    check = [batch_images(b) for b in heldout] if heldout is not None else []
    for x in batches:
        _check_batch(x, in_chans)
    for x in check:
        _check_batch(x, in_chans, 'held-out')
    if not batches and (check or distill_data is not None):
        raise ConversionError('held-out and distillation images follow the fit: give calibration batches too')
    report = ConversionReport(
        architecture=architecture(model), norm=norm, calibration_batches=len(batches),
        calibration_images=sum(x.shape[0] for x in batches), seconds=0.0, options=options.to_dict())
    if batches:
        model.eval().to(device)
        converted.to(device)
        try:
            batches = _on_device(batches, device)
            original_logits, outputs, original = _calibrate(model, converted, batches, report, options)
            if options.reconstruct.steps:
                outputs = _reconstruct(model, converted, batches, original_logits, outputs, report, options)
            if check:
                check = _on_device(check, device)
                with torch.no_grad():
                    check_targets = [model(x) for x in check]
                report.heldout_images = sum(len(x) for x in check)
                report.agreement_fitted = measure_agreement(converted, check, check_targets)
            else:
                check, check_targets = batches, original_logits
                report.agreement_fitted = compare_logits(outputs, original_logits)
            report.agreement = report.agreement_fitted
            if options.distill.epochs and (report.agreement_fitted.top1 < options.distill.threshold
                                           or options.distill.threshold >= 1):
                data = distillation_batches(batches if distill_data is None else distill_data,
                                            options.distill.batch_size, options.seed)
                with _seeded(options.seed):
                    report.distillation, report.agreement = distill_logits(
                        converted, original, data, check, check_targets, report.agreement_fitted, options.distill,
                        early_stop=bool(report.heldout_images), device=device,
                        targets=[(f.layer, f.target) for f in report.layers])
        finally:
            model.to(home)
        converted.to(home)
    converted.to(memory_format=_memory_format(model))
    report.seconds = time.perf_counter() - start
    model.train(was_training)
    return converted, report


def _memory_format(model: nn.Module) -> torch.memory_format:
    """`torch.channels_last` where `model`'s convolution weights are in it (`model.to(memory_format=...)`)."""
    return torch.channels_last if any(map(is_channels_last, model.parameters())) else torch.contiguous_format


class _NormThenAct(nn.Module):
    """A BatchNormAct2d as its BatchNorm (a module of its own, so a fit can target its output) then dropout and
    activation: the same function, sharing the parameters and statistics."""

    def __init__(self, norm_act: BatchNormAct2d):
        super().__init__()
        self.norm = nn.BatchNorm2d(norm_act.num_features, eps=norm_act.eps, momentum=norm_act.momentum,
                                   affine=norm_act.affine, track_running_stats=norm_act.track_running_stats)
        self.norm.weight, self.norm.bias = norm_act.weight, norm_act.bias
        self.norm.running_mean, self.norm.running_var = norm_act.running_mean, norm_act.running_var
        self.norm.train(norm_act.training)
        self.drop, self.act = norm_act.drop, norm_act.act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.drop(self.norm(x)))


def _pre_activation_targets(model: nn.Module, targets: dict) -> nn.Module:
    """ `model`, with each norm-act layer that a fit targets split so the target is its norm's output, before the
    activation: a bound slot's producer applies the slot's affine, and the slot its activation after it (in
    EfficientNet, MobileNetV3, RegNet, DenseNet). Returns a copy where any is split (and updates `targets`)."""
    split = [path for path in set(targets.values()) if isinstance(model.get_submodule(path), BatchNormAct2d)]
    if not split:
        return model
    model = copy.deepcopy(model)
    for path in split:
        parent, _, name = path.rpartition('.')
        setattr(model.get_submodule(parent), name, _NormThenAct(model.get_submodule(path)))
    for layer, path in targets.items():
        if path in split:
            targets[layer] = f'{path}.norm'
    return model


def _qkv_called_as_module(model: nn.Module) -> nn.Module:
    """`model`, or a copy whose EVA-style attention calls `qkv` as a module and adds its q/v biases after (the same
    function), as the converted model does: a fit targets that module's output in the original."""
    if not any(fuses_qkv_bias(m) for m in model.modules()):
        return model
    model = copy.deepcopy(model)
    separate_qkv_biases(model)
    return model


def _calibrate(model: nn.Module, converted: nn.Module, batches: List[torch.Tensor], report: 'ConversionReport',
               options: ConvertOptions) -> Tuple[List[torch.Tensor], List[torch.Tensor], nn.Module]:
    """ Fit every corrected layer in forward order on the converted prefix's inputs (module docstring); returns the
    original's logits on the batches, the fitted model's, and the original as the fits read it (the same function,
    with each fit's target a module of its own: `LayerFit.target`).

    Both models are traced and walked over all batches together (`GraphWalk`): the converted model up to
    the next corrected layer, the original up to that layer's target; the layer is fitted on the cached
    values there, then both walks go on. Each model's graph thus runs once per batch, whatever its depth.
    """
    generator = torch.Generator().manual_seed(options.seed)
    cache = ActivationCache(options.fit.calib_memory, options.fit.cache_dtype)
    slots = {s.binding.producer: s for s in converted.modules()
             if isinstance(s, PatchNormSlot) and s.binding is not None and s.binding.producer}
    slot_paths = {id(s): n for n, s in converted.named_modules()}
    layers = [(n, m) for n, m in converted.named_modules() if isinstance(m, (PatchNormConv2d, AffineDivLinear))]
    targets = {name: slot_paths[id(slots[name])] if name in slots else name for name, _ in layers}
    model = _pre_activation_targets(_qkv_called_as_module(model), targets)
    with torch.no_grad():
        analytic = [converted(x) for x in batches[:options.fit.analytic_batches]]
        walk = GraphWalk(trace(converted), batches, cache)
        original = GraphWalk(trace(model, targets.values()), batches, cache)
        layers = sorted([(n, m) for n, m in layers if walk.calls(n)], key=lambda item: walk.index[walk.node(item[0])])
        bar = None
        if options.progress:
            from tqdm import tqdm
            bar = tqdm(total=len(layers), desc='calibrating', unit='layer', leave=False)
        try:
            for name, layer in layers:
                fit = _fit_layer(name, layer, slots.get(name), targets[name], walk, original, options.fit, generator)
                report.layers.append(fit)
                if bar is not None:
                    bar.update()
            walk.run_until(None)
            original.run_until(None)
        finally:
            cache.close()
            if bar is not None:
                bar.close()
    if analytic:
        report.top1_agreement_analytic = compare_logits(analytic, original.outputs).top1
        report.analytic_images = sum(len(a) for a in analytic)
    report.top1_agreement_calibrated = compare_logits(walk.outputs, original.outputs).top1
    report.output_error_calibrated = relative_squared_error(walk.outputs, original.outputs)
    return original.outputs, walk.outputs, model


def _reconstruct(model: nn.Module, converted: nn.Module, batches: List[torch.Tensor],
                 original_logits: List[torch.Tensor], outputs: List[torch.Tensor], report: 'ConversionReport',
                 options: ConvertOptions) -> List[torch.Tensor]:
    """ Block reconstruction after the fit (`reconstruct.py`), on the blocks whose error is above the threshold,
    where the fitted model's output (its logits' relative squared error on the calibration batches, which the fit
    measured at no cost) is above it too: checking the blocks costs a forward pass of each model, and a model whose
    output the fit reproduces (ResNet, ConvNeXt, ViT) needs no more, whatever its blocks' errors. Returns the
    converted model's logits on the batches after it (`outputs`, the fitted model's, where it did not run)."""
    if report.output_error_calibrated <= options.reconstruct.threshold:
        return outputs
    cache = ActivationCache(options.fit.calib_memory, options.fit.cache_dtype)
    try:
        with torch.no_grad():
            report.blocks, outputs = reconstruct_blocks(model, converted, batches, cache, options.reconstruct,
                                                        options.seed)
    finally:
        cache.close()
    report.top1_agreement_reconstructed = compare_logits(outputs, original_logits).top1
    return outputs


def positions_per_batch_for(unknowns: int, batches: int, per_batch: int, per_unknown: Optional[float]) -> int:
    """The positions drawn from each batch for a fit of `unknowns` unknowns: at most `per_batch`, and at most
    `per_unknown` per unknown over all `batches`."""
    if per_unknown is None:
        return per_batch
    return max(1, min(per_batch, math.ceil(per_unknown * unknowns / batches)))


def _fit_layer(name: str, layer: nn.Module, slot: Optional[PatchNormSlot], target_path: str, walk: GraphWalk,
               original: GraphWalk, options: FitOptions, generator: torch.Generator) -> 'LayerFit':
    """Fit one layer on the inputs the converted walk gives it, to the original walk's values at `target_path`."""
    node, target = walk.node(name), original.node(target_path)
    walk.run_until(node)
    original.run_until(target, inclusive=True)
    conv = isinstance(layer, PatchNormConv2d)
    channels = layer.weight.shape[0]
    unknowns = layer.weight[0].numel() + (layer.bias is not None) + (slot is not None)
    positions_per_batch = positions_per_batch_for(
        unknowns, len(walk.batches), options.positions_per_batch, options.positions_per_unknown)
    equations = NormalEquations()
    for b in range(len(walk.batches)):
        out = original.value(target, b)
        positions = out.numel() // channels
        keep = None
        if positions > positions_per_batch:  # the draw, per batch in forward order, of the layer-by-layer fit
            keep = torch.randperm(positions, generator=generator)[:positions_per_batch].to(out.device)
        z = output_targets(out, channels, conv, keep)
        u = patch_features(layer, walk.value(node.args[0], b), keep, shift=slot is not None)
        z = z.unflatten(1, (u.shape[0], -1)).transpose(0, 1)                      # (G, positions, out/G)
        equations.add(u, z)
    v, before, after = equations.fit(layer_params(layer, slot), options.ridge, free_last=slot is not None)
    set_layer_params(layer, slot, v)
    _logger.debug(f'{name}: rel. err {before[0]:.4f} -> {after[0]:.4f}')
    return LayerFit(name, target_path, equations.count, *before, *after)

""" The conversion's entry point: `convert_model`, its options and its report (see the package docstring) """
import copy
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, List, Optional, Tuple

import torch
import torch.nn as nn
from timm.layers import BatchNormAct2d

from ..device import resolve_device
from ..errors import ConversionError
from ..layers.affine_div import AffineDivLinear, PatchNormConv2d
from ..layers.binding import fuses_qkv_bias, separate_qkv_biases
from ..layers.slot import PatchNormSlot
from .distill import DistillationFit, DistillationOptions, distill_logits
from .features import layer_params, output_targets, patch_features, set_layer_params
from .graph import ActivationCache, GraphWalk, trace
from .rebuild import architecture, build_converted, carry_weights, check_norms, model_in_chans
from .reconstruct import BlockFit, ReconstructionOptions, reconstruct_blocks, relative_squared_error
from .solver import NormalEquations

__all__ = ['convert_model', 'ConversionReport', 'LayerFit', 'CalibrationOptions', 'positions_per_batch_for']

_logger = logging.getLogger(__name__)


@dataclass
class CalibrationOptions:
    """ How the corrected layers are fitted to the original (`convert_model`'s keyword arguments of the same names).

    Args:
        ridge: strength of the pull towards the analytic map, relative to the mean diagonal of the normal equations.
        positions_per_batch: output positions sampled per batch and layer for the fit, at most.
        positions_per_unknown: at most this many sampled positions per unknown of a layer's fit, over all batches
            (None: `positions_per_batch` from every batch).
        analytic_batches: the first calibration batches the analytic map's top-1 agreement is measured on
            (None: all; 0: not measured).
        calib_memory: bytes of activations kept between two steps of the calibration walk; beyond, they spill to disk.
        cache_dtype: the dtype those activations are kept in (None: as computed).
        reconstruct_steps: Adam steps per block at most of the block-wise reconstruction after the fit
            (`reconstruct.py`; 0: none).
        reconstruct_threshold: where the fitted model's logits have a relative squared error above this, the blocks
            whose output has one above it are reconstructed.
        reconstruct_lr: its learning rate.
        distill_epochs: epochs of logit distillation of the whole model after the fit (`distill.py`; 0: none).
        distill_threshold: it runs where the fitted model's logits have a relative squared error above this.
        distill_lr: its peak learning rate.
        progress: show a progress bar.
        seed: seed of the positions' draw and of the reconstruction's and distillation's batch order.
    """
    ridge: float = 1e-2
    positions_per_batch: int = 2048
    positions_per_unknown: Optional[float] = 32.
    analytic_batches: Optional[int] = 1
    calib_memory: int = 4 << 30
    cache_dtype: Optional[torch.dtype] = None
    reconstruct_steps: int = 0
    reconstruct_threshold: float = 0.1
    reconstruct_lr: float = 3e-3
    distill_epochs: int = 6
    distill_threshold: float = 0.01
    distill_lr: float = 1e-4
    progress: bool = False
    seed: int = 0


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
    architecture: str
    norm: str
    calibration_batches: int
    calibration_images: int
    seconds: float
    top1_agreement_analytic: Optional[float] = None
    analytic_images: int = 0
    top1_agreement_calibrated: Optional[float] = None
    top1_agreement_reconstructed: Optional[float] = None
    top1_agreement_distilled: Optional[float] = None
    output_error_calibrated: Optional[float] = None
    output_error_refitted: Optional[float] = None
    layers: List[LayerFit] = field(default_factory=list)
    blocks: List[BlockFit] = field(default_factory=list)
    reconstruct_threshold: Optional[float] = None
    distillation: Optional[DistillationFit] = None
    distill_threshold: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """ What the conversion did, in one sentence: the fit, which blocks were reconstructed (steps each), whether
        the whole model was distilled, and the converted model's top-1 agreement with the original on the calibration
        images (the model card's recipe)."""
        text = f'{len(self.layers)} divergence-corrected layers fitted by ridge least squares'
        trained = [b for b in self.blocks if b.steps]
        if self.blocks:
            text += (f'; {len(trained)} of {len(self.blocks)} blocks had a relative squared output error above '
                     f'{self.reconstruct_threshold:g} after the fit and were reconstructed'
                     + (' (' + ', '.join(f'{b.block}: {b.steps} Adam steps, error {b.rel_err_before:.3f} -> '
                                         f'{b.rel_err_after:.3f}' for b in trained) + ')' if trained else ''))
        elif self.reconstruct_threshold is not None:
            text += (f"; the fitted model's output (relative squared error {self.output_error_calibrated:.3f}) was "
                     f'within {self.reconstruct_threshold:g} of the original\'s, so no block was reconstructed')
        if self.distill_threshold is not None:
            text += (f"; the {'reconstructed' if self.blocks else 'fitted'} model's output (relative squared error "
                     f'{self.output_error_refitted:.3f}) was ')
            d = self.distillation
            text += (f'within {self.distill_threshold:g} of the original\'s, so it was not distilled' if d is None else
                     f"above {self.distill_threshold:g}, so the whole model was distilled on the original's logits "
                     f'for {d.epochs} epochs ({d.steps} Adam steps, mean KL {d.kl_before:.4f} -> {d.kl_after:.4f})')
        agreement = next((a for a in (self.top1_agreement_distilled, self.top1_agreement_reconstructed,
                                      self.top1_agreement_calibrated) if a is not None), None)
        if agreement is not None:
            text += (f'; top-1 agreement with the original on the {self.calibration_images} calibration images '
                     f'{100 * agreement:.1f}%')
        return text

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
            lines.append(f'top-1 agreement with the original: analytic map {100 * self.top1_agreement_analytic:.2f}% '
                         f'(first {self.analytic_images} images)'
                         + ('' if self.top1_agreement_calibrated is None else
                            f', calibrated {100 * self.top1_agreement_calibrated:.2f}%')
                         + ('' if self.top1_agreement_reconstructed is None else
                            f', reconstructed {100 * self.top1_agreement_reconstructed:.2f}%')
                         + ('' if self.top1_agreement_distilled is None else
                            f', distilled {100 * self.top1_agreement_distilled:.2f}%'))
        lines.append(f'{self.architecture} -> {self.norm}, {self.calibration_batches} calibration batches '
                     f'({self.calibration_images} images), {self.seconds:.1f} s')
        return '\n'.join(lines)


def _images(batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _check_batch(images, in_chans: int) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != in_chans:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ConversionError(
            f'calibration batches must be image tensors (N, {in_chans}, H, W) (or (images, labels) pairs), '
            f'got {shape}: use data with {in_chans} channel(s) and the size the model was trained at')


def _agreement(logits: List[torch.Tensor], other: List[torch.Tensor]) -> float:
    """Top-1 agreement over the batches both lists have (`other` may cover only the first ones)."""
    pairs = list(zip(logits, other))
    return sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in pairs) / sum(len(a) for a, _ in pairs)


@torch.inference_mode(False)  # the distillation trains the converted model, whatever mode the caller is in
def convert_model(
        model: nn.Module,
        norm: str = 'patchnorm',
        calibration: Optional[Iterable] = None,
        *,
        ridge: float = 1e-2,
        positions_per_batch: int = 2048,
        positions_per_unknown: Optional[float] = 32.,
        analytic_batches: Optional[int] = 1,
        device: Optional[str] = None,
        calib_memory: int = 4 << 30,
        cache_dtype: Optional[torch.dtype] = None,
        reconstruct_steps: int = 0,
        reconstruct_threshold: float = 0.1,
        reconstruct_lr: float = 3e-3,
        distill_epochs: int = 6,
        distill_threshold: float = 0.01,
        distill_lr: float = 1e-4,
        progress: bool = False,
        seed: int = 0,
        **model_kwargs,
) -> Tuple[nn.Module, ConversionReport]:
    """ Rebuild `model` (a BatchNorm/LayerNorm timm model) with `norm` ("patchnorm" or "affinediv").

    Args:
        model: the trained timm model; it is not modified (it is moved to `device` and back).
        norm: "patchnorm" (norm slots bound to their convolutions), or "affinediv" (every Conv2d/Linear
            divergence corrected, the slots only affine).
        calibration: an iterable of image batches (or (images, labels) pairs). Without it, the
            analytic map only.
        ridge: strength of the pull towards the analytic map, relative to the mean diagonal of the
            normal equations.
        positions_per_batch: output positions sampled per batch and layer for the fit, at most.
        positions_per_unknown: at most this many sampled positions per unknown of a layer's fit (its fan-in, plus
            the bias and the slot's shift), over all batches: a least-squares fit needs a multiple of its unknowns,
            and `U^T U` costs positions x unknowns^2, which would dwarf the forward passes in a wide layer (None:
            `positions_per_batch` from every batch).
        analytic_batches: the first calibration batches the analytic map's top-1 agreement with the original is
            measured on, in a forward pass of its own (None: all; 0: not measured). It is a diagnostic (how much
            the calibration does), so by default one batch: with a few large images, more would cost a large part
            of a forward pass. The calibrated model's agreement is measured on all of them, at no cost: the
            calibration walk computes its output.
        device: where the forward passes run and the normal equations are accumulated (float32 products) and
            solved (float64): 'cpu', 'cuda', or 'auto'/None (CUDA when available).
        calib_memory: bytes of activations kept between two steps of the calibration walk; beyond it
            they spill to a temporary folder.
        cache_dtype: the dtype those activations are kept in (None: as computed, exact; torch.float16
            halves the memory at float16 precision).
        reconstruct_steps: after the fit, Adam steps per block of block-wise reconstruction (`reconstruct.py`):
            the layers of each block trained together to reproduce the original block's output on the calibration
            images, no labels; 0 (default): none. Distillation (below) did better at a lower cost on every family
            measured (docs/families.md). Holds one block's inputs and outputs on all batches in memory at a time.
        reconstruct_threshold: where the fitted model's logits have a relative squared error above this, the blocks
            whose output has one above it are reconstructed.
        reconstruct_lr: the reconstruction's learning rate.
        distill_epochs: after the fit (and any reconstruction), epochs of logit distillation (`distill.py`): every
            parameter of the converted model trained so that its class distribution matches the original's on the
            calibration images (KL divergence, Adam, the learning rate warmed up then decayed by a cosine; no
            labels), where the model's logits there have a relative squared error above `distill_threshold`. Each
            epoch costs about four forward passes of the original over the calibration images; where the fit is
            enough (ResNet, ConvNeXt, ViT trained at full width) it does not run. 0: never.
        distill_threshold: the logits' relative squared error above which the model is distilled.
        distill_lr: the distillation's peak learning rate.
        progress: show a progress bar.
        **model_kwargs: passed to `timm.create_model`, over the arguments `model` was created with.

    Returns:
        The converted model (in eval mode, on the device and in the memory format of `model`) and the report.
    """
    start = time.perf_counter()
    was_training = model.training
    home = next(model.parameters()).device
    device = resolve_device(device)
    converted = build_converted(model, norm, **model_kwargs).eval()
    norms = check_norms(model, converted)
    carry_weights(model, converted, norms)
    batches = [_images(b) for b in calibration] if calibration is not None else []
    in_chans = model_in_chans(model)
    for x in batches:
        _check_batch(x, in_chans)
    report = ConversionReport(
        architecture=architecture(model), norm=norm, calibration_batches=len(batches),
        calibration_images=sum(x.shape[0] for x in batches), seconds=0.0)
    if batches:
        model.eval().to(device)
        converted.to(device)
        options = CalibrationOptions(
            ridge=ridge, positions_per_batch=positions_per_batch, positions_per_unknown=positions_per_unknown,
            analytic_batches=analytic_batches, calib_memory=calib_memory, cache_dtype=cache_dtype,
            reconstruct_steps=reconstruct_steps, reconstruct_threshold=reconstruct_threshold,
            reconstruct_lr=reconstruct_lr, distill_epochs=distill_epochs, distill_threshold=distill_threshold,
            distill_lr=distill_lr, progress=progress, seed=seed)
        try:
            # a batch made in inference mode cannot be saved for a backward pass: a copy of it can
            batches = [x.to(device).clone() if x.is_inference() else x.to(device) for x in batches]
            original_logits, outputs = _calibrate(model, converted, batches, report, options)
            if options.reconstruct_steps:
                outputs = _reconstruct(model, converted, batches, original_logits, outputs, report, options)
            if options.distill_epochs:
                _distill(converted, batches, original_logits, outputs, report, options)
        finally:
            model.to(home)
        converted.to(home)
    converted.to(memory_format=_memory_format(model))
    report.seconds = time.perf_counter() - start
    model.train(was_training)
    return converted, report


def _memory_format(model: nn.Module) -> torch.memory_format:
    """`torch.channels_last` where `model`'s convolution weights are in it (`model.to(memory_format=...)`)."""
    channels_last = any(p.dim() == 4 and not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
                        for p in model.parameters())
    return torch.channels_last if channels_last else torch.contiguous_format


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
               options: CalibrationOptions) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """ Fit every corrected layer in forward order on the converted prefix's inputs (module docstring); returns the
    original's logits on the batches and the fitted model's.

    Both models are traced and walked over all batches together (`GraphWalk`): the converted model up to
    the next corrected layer, the original up to that layer's target; the layer is fitted on the cached
    values there, then both walks go on. Each model's graph thus runs once per batch, whatever its depth.
    """
    generator = torch.Generator().manual_seed(options.seed)
    cache = ActivationCache(options.calib_memory, options.cache_dtype)
    slots = {s.binding.producer: s for s in converted.modules()
             if isinstance(s, PatchNormSlot) and s.binding is not None and s.binding.producer}
    slot_paths = {id(s): n for n, s in converted.named_modules()}
    layers = [(n, m) for n, m in converted.named_modules() if isinstance(m, (PatchNormConv2d, AffineDivLinear))]
    targets = {name: slot_paths[id(slots[name])] if name in slots else name for name, _ in layers}
    model = _pre_activation_targets(_qkv_called_as_module(model), targets)
    with torch.no_grad():
        analytic = [converted(x) for x in batches[:options.analytic_batches]]
        walk = GraphWalk(trace(converted), batches, cache)
        original = GraphWalk(trace(model, targets.values()), batches, cache)
        layers = sorted([(n, m) for n, m in layers if walk.calls(n)], key=lambda item: walk.index[walk.node(item[0])])
        bar = None
        if options.progress:
            from tqdm import tqdm
            bar = tqdm(total=len(layers), desc='calibrating', unit='layer', leave=False)
        try:
            for name, layer in layers:
                fit = _fit_layer(name, layer, slots.get(name), targets[name], walk, original, options, generator)
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
        report.top1_agreement_analytic = _agreement(original.outputs, analytic)
        report.analytic_images = sum(len(a) for a in analytic)
    report.top1_agreement_calibrated = _agreement(original.outputs, walk.outputs)
    report.output_error_calibrated = relative_squared_error(walk.outputs, original.outputs)
    return original.outputs, walk.outputs


def _reconstruct(model: nn.Module, converted: nn.Module, batches: List[torch.Tensor],
                 original_logits: List[torch.Tensor], outputs: List[torch.Tensor], report: 'ConversionReport',
                 options: CalibrationOptions) -> List[torch.Tensor]:
    """ Block reconstruction after the fit (`reconstruct.py`), on the blocks whose error is above the threshold,
    where the fitted model's output (its logits' relative squared error on the calibration batches, which the fit
    measured at no cost) is above it too: checking the blocks costs a forward pass of each model, and a model whose
    output the fit reproduces (ResNet, ConvNeXt, ViT) needs no more, whatever its blocks' errors. Returns the
    converted model's logits on the batches after it (`outputs`, the fitted model's, where it did not run)."""
    report.reconstruct_threshold = options.reconstruct_threshold
    if report.output_error_calibrated <= options.reconstruct_threshold:
        return outputs
    cache = ActivationCache(options.calib_memory, options.cache_dtype)
    try:
        with torch.no_grad():
            report.blocks, outputs = reconstruct_blocks(model, converted, batches, cache, ReconstructionOptions(
                max_steps=options.reconstruct_steps, threshold=options.reconstruct_threshold,
                lr=options.reconstruct_lr, seed=options.seed))
    finally:
        cache.close()
    report.top1_agreement_reconstructed = _agreement(original_logits, outputs)
    return outputs


def _distill(converted: nn.Module, batches: List[torch.Tensor], original_logits: List[torch.Tensor],
             outputs: List[torch.Tensor], report: 'ConversionReport', options: CalibrationOptions) -> None:
    """ Logit distillation of the whole converted model (`distill.py`) where its logits `outputs` on the batches,
    after the fit and any reconstruction, have a relative squared error above the threshold."""
    report.distill_threshold = options.distill_threshold
    report.output_error_refitted = relative_squared_error(outputs, original_logits)
    if report.output_error_refitted <= options.distill_threshold:
        return
    report.distillation, outputs = distill_logits(converted, batches, original_logits, outputs, DistillationOptions(
        epochs=options.distill_epochs, lr=options.distill_lr, seed=options.seed))
    report.top1_agreement_distilled = _agreement(original_logits, outputs)


def positions_per_batch_for(unknowns: int, batches: int, per_batch: int, per_unknown: Optional[float]) -> int:
    """The positions drawn from each batch for a fit of `unknowns` unknowns: at most `per_batch`, and at most
    `per_unknown` per unknown over all `batches`."""
    if per_unknown is None:
        return per_batch
    return max(1, min(per_batch, math.ceil(per_unknown * unknowns / batches)))


def _fit_layer(name: str, layer: nn.Module, slot: Optional[PatchNormSlot], target_path: str, walk: GraphWalk,
               original: GraphWalk, options: CalibrationOptions, generator: torch.Generator) -> 'LayerFit':
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

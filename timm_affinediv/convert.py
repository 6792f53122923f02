""" Converting a pretrained BatchNorm/LayerNorm timm model to PatchNorm without losing what it learned

`convert_model(model, norm="patchnorm", calibration=batches)` rebuilds the model's architecture with
`timm.create_model(arch, norm_layer=norm)`, carries every weight over, and maps each norm onto
its slot analytically. Swapping a normaliser changes every activation, so the analytic map alone
loses most of the accuracy; with calibration data the divergence-corrected layers are then fitted,
one after the other in forward order, each on the inputs the converted prefix gives it, so that its
output reproduces the original model's at the same place (the norm's output for a producer, the
layer's own output for a consumer).

Each fit is a ridge-regularised least squares problem, exact and closed form: a corrected layer
computes, for each output channel `o` and position `p`,

    z_o,p = v_o . u_p + beta_o,     u_p = [P_p; 1] / s(P_p)

(`v_o = g_o [W_o, b_o]` with the slot's gain `g_o` folded in, `beta_o` the slot's shift, present
only where a slot follows), linear in `(v_o, beta_o)`. The normal equations are accumulated over
the calibration batches (a random subset of positions per batch), and solved with a penalty
`lambda |v_o - v_o^0|^2` pulling towards the analytic map, as post-training quantisation methods do.
The fitted `v_o` is split back into the slot's gain (the ratio of `|v_o|` to the original
convolution's row norm, so that the weights keep their scale) and the layer's weight and bias.

The analytic map (also the starting point of the fit): with BatchNorm `z = gamma (W x + b - mu) /
sigma + beta`, the slot gets `gamma / sigma` and `beta`, the convolution keeps `W` and gets the
pre-division bias `b - mu`: exact wherever the patch's root mean square `s(P)` is 1. With
LayerNorm the slot takes `gamma` and `beta` as they are.
"""
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models._input import get_model_args

from .layers.affine_div import AffineDivLinear, PatchNormConv2d
from .layers.slot import PatchNormSlot

__all__ = ['convert_model', 'ConversionError', 'ConversionReport', 'LayerFit', 'CONVERSION_NORMS']

_logger = logging.getLogger(__name__)

CONVERSION_NORMS = ('patchnorm', 'affinediv')
_BATCHNORMS = (nn.BatchNorm2d, nn.BatchNorm1d)
_LAYERNORMS = (nn.LayerNorm, nn.GroupNorm)


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; the message lists what and why."""


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
    top1_agreement_calibrated: Optional[float] = None
    layers: List[LayerFit] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format_table(self) -> str:
        """The per-layer fidelity as a markdown table, then the whole-model agreement."""
        lines = ['| layer | target | rel. err before | cos before | rel. err after | cos after |',
                 '|---|---|---:|---:|---:|---:|']
        lines += [f'| {f.layer} | {f.target} | {f.rel_err_before:.4f} | {f.cos_before:.4f} | '
                  f'{f.rel_err_after:.4f} | {f.cos_after:.4f} |' for f in self.layers]
        lines.append('')
        if self.top1_agreement_analytic is not None:
            lines.append(f'top-1 agreement with the original: analytic map {100 * self.top1_agreement_analytic:.2f}%'
                         + ('' if self.top1_agreement_calibrated is None else
                            f', calibrated {100 * self.top1_agreement_calibrated:.2f}%'))
        lines.append(f'{self.architecture} -> {self.norm}, {self.calibration_batches} calibration batches '
                     f'({self.calibration_images} images), {self.seconds:.1f} s')
        return '\n'.join(lines)


def _architecture(model: nn.Module) -> str:
    arch = getattr(model, 'pretrained_cfg', {}).get('architecture')
    if not arch:
        raise ConversionError(
            f'{type(model).__name__} has no pretrained_cfg["architecture"]: create it with timm.create_model.')
    return arch


def model_in_chans(model: nn.Module) -> int:
    """The input channels of a model: those of its first convolution."""
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if first is None:
        raise ConversionError(f'{type(model).__name__} has no Conv2d: nothing to convert to PatchNorm.')
    return first.in_channels


def build_converted(model: nn.Module, norm: str = 'patchnorm', **model_kwargs) -> nn.Module:
    """`timm.create_model(arch, norm_layer=norm)` with the arguments `model` was created with (timm records them)."""
    if norm not in CONVERSION_NORMS:
        raise ConversionError(f'norm must be one of {CONVERSION_NORMS}, got {norm!r}')
    kwargs = dict(num_classes=getattr(model, 'num_classes', 1000), in_chans=model_in_chans(model))
    kwargs.update({k: v for k, v in get_model_args(model).items() if k != 'norm_layer'})
    kwargs.update(model_kwargs)
    return timm.create_model(_architecture(model), norm_layer=norm, **kwargs)


def _check_norms(model: nn.Module, converted: nn.Module) -> Dict[str, nn.Module]:
    """The original norm module at each slot's path; lists what cannot be converted."""
    original = dict(model.named_modules())
    slots = {n: m for n, m in converted.named_modules() if isinstance(m, PatchNormSlot)}
    problems = []
    for name, slot in slots.items():
        norm = original.get(name)
        if not isinstance(norm, _BATCHNORMS + _LAYERNORMS):
            problems.append(f'{name}: the original has {type(norm).__name__}, not a BatchNorm/LayerNorm')
        elif not slot.bound:
            problems.append(f'{name}: the slot is standalone ({slot.binding.note})')
    left = [n for n, m in model.named_modules() if isinstance(m, _BATCHNORMS + _LAYERNORMS) and n not in slots]
    problems += [f'{n}: {type(original[n]).__name__} has no patchnorm slot in the rebuilt model' for n in left]
    if problems:
        raise ConversionError('cannot convert every norm of {}:\n  {}'.format(
            _architecture(model), '\n  '.join(problems)))
    return {name: original[name] for name in slots}


def _carry_weights(model: nn.Module, converted: nn.Module, norms: Dict[str, nn.Module]) -> None:
    """Copy every weight whose name and shape match, then map each norm analytically onto its slot."""
    source = model.state_dict()
    target = converted.state_dict()
    mismatched = [k for k in target if k in source and source[k].shape != target[k].shape]
    if mismatched:
        raise ConversionError(f'shapes differ between the original and the rebuilt model: {mismatched[:10]}')
    with torch.no_grad():
        for key, value in target.items():
            if key in source:
                value.copy_(source[key])
        modules = dict(converted.named_modules())
        for name, norm in norms.items():
            slot = modules[name]
            if isinstance(norm, _BATCHNORMS):
                inv_sigma = (norm.running_var + norm.eps).rsqrt()
                slot.weight.copy_(norm.weight * inv_sigma if norm.affine else inv_sigma)
                slot.bias.copy_(norm.bias if norm.affine else torch.zeros_like(slot.bias))
                producer = slot.binding.producer
                if producer is not None:
                    modules[producer].bias.sub_(norm.running_mean)
            elif norm.weight is not None:
                slot.weight.copy_(norm.weight)
                slot.bias.copy_(norm.bias)


class _Stop(Exception):
    pass


def _capture(model: nn.Module, module: nn.Module, x: torch.Tensor, want: str) -> torch.Tensor:
    """`module`'s input (`want="input"`) or output in `model(x)`, stopping the forward there."""
    captured = []

    def hook(_, args, out=None):
        captured.append((args[0] if want == 'input' else out).detach())
        raise _Stop
    handle = (module.register_forward_pre_hook(hook) if want == 'input' else module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    except _Stop:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ConversionError(f'{type(module).__name__} is not reached by the forward pass')
    return captured[0]


def _features(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`u = [P; 1] / s(P)` for every output position: (groups, positions, K (+1))."""
    bias = layer.bias is not None
    c = layer.divergence_constant
    if isinstance(layer, AffineDivLinear):
        cols = x.reshape(-1, x.shape[-1]).unsqueeze(0)                          # (1, L, K)
    else:
        mode = 'constant' if layer.padding_mode == 'zeros' else layer.padding_mode
        x = F.pad(x, layer._reversed_padding_repeated_twice, mode=mode)
        cols = F.unfold(x, layer.kernel_size, dilation=layer.dilation, stride=layer.stride)
        cols = cols.unflatten(1, (layer.groups, -1)).permute(1, 0, 3, 2).flatten(1, 2)   # (G, N*L, K)
    if bias:
        cols = torch.cat([cols, torch.ones_like(cols[..., :1])], -1)
    sq = cols.square().sum(-1, keepdim=True)
    return cols * (c / (sq if bias else sq + layer.eps)).sqrt()


def _as_channels(out: torch.Tensor, channels: int, conv: bool) -> torch.Tensor:
    """Targets as (groups-free) (positions, channels), whatever layout the original produced them in."""
    if conv and out.dim() == 4 and out.shape[1] != channels:
        out = out.permute(0, 3, 1, 2)                                            # channels-last norm output
    if conv:
        return out.permute(0, 2, 3, 1).reshape(-1, channels)
    return out.reshape(-1, channels)


class _NormalEquations:
    """Running sums `U^T U`, `U^T Z`, `Z^T Z` per group, over sampled positions."""

    def __init__(self):
        self.gram = self.cross = self.target_sq = None
        self.count = 0

    def add(self, u: torch.Tensor, z: torch.Tensor) -> None:
        u, z = u.double(), z.double()
        gram, cross = u.transpose(1, 2) @ u, u.transpose(1, 2) @ z
        sq = z.square().sum((1, 2))
        if self.gram is None:
            self.gram, self.cross, self.target_sq = gram, cross, sq
        else:
            self.gram += gram
            self.cross += cross
            self.target_sq += sq
        self.count += u.shape[1]

    def fidelity(self, v: torch.Tensor) -> Tuple[float, float]:
        """Relative error and cosine similarity of `U v` against `Z`, from the sums alone."""
        fit_sq = torch.einsum('gko,gkl,glo->', v, self.gram, v)
        inner = torch.einsum('gko,gko->', v, self.cross)
        target_sq = self.target_sq.sum().clamp_min(1e-30)  # a zero target: a zero-initialised gain
        err_sq = (fit_sq - 2 * inner + target_sq).clamp_min(0)
        return (err_sq / target_sq).sqrt().item(), (inner / (fit_sq * target_sq).sqrt().clamp_min(1e-30)).item()

    def solve(self, v0: torch.Tensor, ridge: float, free_last: bool) -> torch.Tensor:
        """argmin |U v - Z|^2 + lambda |v - v0|^2, lambda = ridge * mean diag(U^T U); the last row free if asked."""
        k = self.gram.shape[-1]
        penalty = torch.ones(k, dtype=self.gram.dtype)
        if free_last:
            penalty[-1] = 0
        lam = ridge * self.gram.diagonal(dim1=1, dim2=2).mean(1).clamp_min(1e-12)           # per group
        reg = lam.view(-1, 1, 1) * torch.diag(penalty)
        return torch.linalg.solve(self.gram + reg, self.cross + reg @ v0)


def _layer_params(layer: nn.Module, slot: Optional[PatchNormSlot]) -> torch.Tensor:
    """The current map as `v`: (groups, K (+1 bias) (+1 shift), out per group), the slot's gain folded in."""
    w = layer.weight.detach().double()
    groups = getattr(layer, 'groups', 1)
    w = w.flatten(1)                                                             # (O, K)
    cols = [w] + ([layer.bias.detach().double()[:, None]] if layer.bias is not None else [])
    v = torch.cat(cols, 1)
    if slot is not None:
        v = v * slot.weight.detach().double()[:, None]
        v = torch.cat([v, slot.bias.detach().double()[:, None]], 1)
    return v.unflatten(0, (groups, -1)).transpose(1, 2)


def _set_layer_params(layer: nn.Module, slot: Optional[PatchNormSlot], v: torch.Tensor) -> None:
    v = v.transpose(1, 2).flatten(0, 1)                                          # (O, K (+1) (+1))
    with torch.no_grad():
        if slot is not None:
            shift, v = v[:, -1], v[:, :-1]
            reference = layer.weight.detach().double().flatten(1).norm(dim=1)
            gain = (v[:, :layer.weight[0].numel()].norm(dim=1) / reference.clamp_min(1e-12))
            gain = torch.where(gain > 0, gain, torch.ones_like(gain))
            v = v / gain[:, None]
            slot.weight.copy_(gain)
            slot.bias.copy_(shift)
        k = layer.weight[0].numel()
        layer.weight.copy_(v[:, :k].view_as(layer.weight))
        if layer.bias is not None:
            layer.bias.copy_(v[:, k])


def _corrected_layers(converted: nn.Module, x: torch.Tensor) -> List[Tuple[str, nn.Module]]:
    """The divergence-corrected layers of `converted` in the order the forward pass calls them."""
    order, handles = [], []
    for name, m in converted.named_modules():
        if isinstance(m, (PatchNormConv2d, AffineDivLinear)):
            handles.append(m.register_forward_pre_hook(lambda mod, args, name=name: order.append((name, mod))))
    try:
        with torch.no_grad():
            converted(x)
    finally:
        for h in handles:
            h.remove()
    return order


def _images(batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _check_batch(images, in_chans: int) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != in_chans:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ConversionError(
            f'calibration batches must be image tensors (N, {in_chans}, H, W) (or (images, labels) pairs), '
            f'got {shape}: use data with {in_chans} channel(s) and the size the model was trained at')


def _agreement(model: nn.Module, converted: nn.Module, batches: List[torch.Tensor]) -> float:
    agree = total = 0
    with torch.no_grad():
        for x in batches:
            agree += (model(x).argmax(-1) == converted(x).argmax(-1)).sum().item()
            total += x.shape[0]
    return agree / total


def convert_model(
        model: nn.Module,
        norm: str = 'patchnorm',
        calibration: Optional[Iterable] = None,
        *,
        ridge: float = 1e-2,
        positions_per_batch: int = 2048,
        progress: bool = False,
        seed: int = 0,
        **model_kwargs,
) -> Tuple[nn.Module, ConversionReport]:
    """ Rebuild `model` (a BatchNorm/LayerNorm timm model) with `norm` ("patchnorm" or "affinediv").

    Args:
        model: the trained timm model; it is not modified.
        norm: "patchnorm" (norm slots bound to their convolutions), or "affinediv" (every Conv2d/Linear
            divergence corrected, the slots only affine).
        calibration: an iterable of image batches (or (images, labels) pairs). Without it, the
            analytic map only.
        ridge: strength of the pull towards the analytic map, relative to the mean diagonal of the
            normal equations.
        positions_per_batch: output positions sampled per batch and layer for the fit.
        progress: show a progress bar.
        **model_kwargs: passed to `timm.create_model`, over the arguments `model` was created with.

    Returns:
        The converted model (in eval mode) and the report.
    """
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    converted = build_converted(model, norm, **model_kwargs).eval()
    norms = _check_norms(model, converted)
    _carry_weights(model, converted, norms)
    batches = [_images(b) for b in calibration] if calibration is not None else []
    in_chans = model_in_chans(model)
    for x in batches:
        _check_batch(x, in_chans)
    report = ConversionReport(
        architecture=_architecture(model), norm=norm, calibration_batches=len(batches),
        calibration_images=sum(x.shape[0] for x in batches), seconds=0.0)
    if batches:
        report.top1_agreement_analytic = _agreement(model, converted, batches)
        _calibrate(model, converted, batches, report, ridge, positions_per_batch, progress, seed)
        report.top1_agreement_calibrated = _agreement(model, converted, batches)
    report.seconds = time.perf_counter() - start
    model.train(was_training)
    return converted, report


def _calibrate(model, converted, batches, report, ridge, positions_per_batch, progress, seed) -> None:
    """Fit every corrected layer in forward order on the converted prefix's inputs (module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    original = dict(model.named_modules())
    slots = {s.binding.producer: s for s in converted.modules()
             if isinstance(s, PatchNormSlot) and s.binding is not None and s.binding.producer}
    slot_paths = {id(s): n for n, s in converted.named_modules()}
    layers = _corrected_layers(converted, batches[0])
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(layers) * len(batches), desc='calibrating', unit='batch', leave=False)
    for name, layer in layers:
        slot = slots.get(name)
        target_path = slot_paths[id(slot)] if slot is not None else name
        equations = _NormalEquations()
        conv = isinstance(layer, PatchNormConv2d)
        for x in batches:
            u = _features(layer, _capture(converted, layer, x, 'input'))
            z = _as_channels(_capture(model, original[target_path], x, 'output'), layer.weight.shape[0], conv)
            z = z.unflatten(1, (u.shape[0], -1)).transpose(0, 1)                  # (G, positions, out/G)
            if slot is not None:
                u = torch.cat([u, torch.ones_like(u[..., :1])], -1)
            if u.shape[1] > positions_per_batch:
                keep = torch.randperm(u.shape[1], generator=generator)[:positions_per_batch]
                u, z = u[:, keep], z[:, keep]
            equations.add(u, z)
            if bar is not None:
                bar.update()
        v0 = _layer_params(layer, slot)
        before = equations.fidelity(v0)
        v = equations.solve(v0, ridge, free_last=slot is not None)
        after = equations.fidelity(v)
        _set_layer_params(layer, slot, v.float())
        report.layers.append(LayerFit(name, target_path, equations.count, *before, *after))
        _logger.debug(f'{name}: rel. err {before[0]:.4f} -> {after[0]:.4f}')
    if bar is not None:
        bar.close()

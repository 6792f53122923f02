""" The converted model's architecture, and the trained weights carried into it

`build_converted` rebuilds a timm model with a `patchnorm`/`affinediv` norm layer from the arguments timm recorded;
`carry_weights` copies every weight and maps each norm analytically onto its slot: with BatchNorm
`z = gamma (W x + b - mu) / sigma + beta`, the slot gets `gamma / sigma` and `beta`, the convolution keeps `W` and
gets the pre-division bias `b - mu`: exact wherever the patch's root mean square `s(P)` is 1. With LayerNorm the
slot takes `gamma` and `beta` as they are.
"""
from typing import Dict

import timm
import torch
import torch.nn as nn

from .._timm_compat import get_model_args
from ..errors import ConversionError, SlotLayoutError
from ..layers.register import NORM_LAYERS, factory_key
from ..layers.slot import PatchNormSlot

__all__ = ['CONVERSION_NORMS', 'architecture', 'model_in_chans', 'build_converted', 'check_norms', 'carry_weights']

CONVERSION_NORMS = ('patchnorm', 'affinediv')
_BATCHNORMS = (nn.BatchNorm2d, nn.BatchNorm1d)
_LAYERNORMS = (nn.LayerNorm, nn.GroupNorm)


def architecture(model: nn.Module) -> str:
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
    """`timm.create_model(arch, norm_layer=norm)` with the arguments `model` was created with (timm records them),
    on `model`'s device and in its dtype (the weights carried over are then copied, and combined, where they are)."""
    if getattr(NORM_LAYERS.get(factory_key(norm)), 'standardises_producer', False):
        raise ConversionError(f"norm {norm!r} standardises each producer's weight, so a trained model's weights would "
                              "compute another function: convert to 'patchnorm', or train 'patchnorm_ws' from scratch")
    if norm not in CONVERSION_NORMS:
        raise ConversionError(f'norm must be one of {CONVERSION_NORMS}, got {norm!r}')
    kwargs = dict(num_classes=getattr(model, 'num_classes', 1000), in_chans=model_in_chans(model))
    kwargs.update({k: v for k, v in get_model_args(model).items() if k != 'norm_layer'})
    kwargs.update(model_kwargs)
    try:
        reference = next(model.parameters())
        return timm.create_model(architecture(model), norm_layer=norm, **kwargs).to(reference.device, reference.dtype)
    except SlotLayoutError as e:
        raise ConversionError(f'cannot convert {architecture(model)}: {e}') from e


def check_norms(model: nn.Module, converted: nn.Module) -> Dict[str, nn.Module]:
    """The original norm module at each slot's path; lists what cannot be converted."""
    original = dict(model.named_modules())
    slots = {n: m for n, m in converted.named_modules() if isinstance(m, PatchNormSlot)}
    problems = []
    for name, slot in slots.items():
        norm = original.get(name)
        if not isinstance(norm, _BATCHNORMS + _LAYERNORMS):
            problems.append(f'{name}: the original has {type(norm).__name__}, not a BatchNorm/LayerNorm')
        elif slot.normalises:
            problems.append(f'{name}: the slot normalises its input ({slot.binding.note or "standalone"})')
    left = [n for n, m in model.named_modules() if isinstance(m, _BATCHNORMS + _LAYERNORMS) and n not in slots]
    problems += [f'{n}: {type(original[n]).__name__} has no patchnorm slot in the rebuilt model' for n in left]
    if problems:
        raise ConversionError('cannot convert every norm of {}:\n  {}'.format(
            architecture(model), '\n  '.join(problems)))
    return {name: original[name] for name in slots}


def carry_weights(model: nn.Module, converted: nn.Module, norms: Dict[str, nn.Module]) -> None:
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
                    bias = modules[producer].bias
                    bias.sub_(norm.running_mean.to(bias.device))
            elif norm.weight is not None:
                slot.weight.copy_(norm.weight)
                slot.bias.copy_(norm.bias)

""" Registration with timm's factories, on `import timm_affinediv`

Adds, without changing any of timm's own entries:
- `patchnorm` (`PatchNorm2d` slot), `patchnorm_ws` (`PatchNormWS2d`: its producer's weight standardised),
  `affinediv` (`AffineDivNorm2d` slot: every affine map corrected), `l2norm` (`L2Norm`) and `l2norm2d`
  (`L2Norm2d`) to the norm factory (`get_norm_layer`/`create_norm_layer`; timm drops the underscore);
- `patchnorm`, `patchnorm_ws` and `affinediv` norm-act slots to the norm+act factory (`get_norm_act_layer`);
- `patchnorm`, `patchnorm_ws`, `affinediv` and `l2norm` to ConvNeXt's own (NCHW, channels-last) norm map, so
  `convnext_*` takes them in both MLP layouts;
- a step inside `timm.create_model` (timm's model builder, after construction and before
  pretrained weights load) that binds the model's `patchnorm` slots and opens the residual branches timm's
  `zero_init_last` closed (`residual_init`);
- for the families whose constructor calls `norm_layer` as a class and never resolves a string (EVA, Swin,
  PVT-v2, XCiT, Mixer, ...), `create_model(..., norm_layer="patchnorm")` passes them the slot class the string
  names, so the string works wherever the class does; for the entrypoints that fix `norm_layer` themselves
  (MobileNetV3's), the BatchNorms of the model they build are swapped for slots.
Idempotent.
"""
import functools

import torch.nn as nn
from timm.layers import BatchNormAct2d

from .. import _timm_compat as compat
from ..errors import RegistrationError
from .binding import bind_patchnorm
from .norm import L2Norm, L2Norm2d
from .residual_init import get_residual_init, init_residual_branches
from .slot import (
    AffineDivNorm,
    AffineDivNorm2d,
    AffineDivNormAct2d,
    PatchNorm,
    PatchNorm2d,
    PatchNormAct2d,
    PatchNormWS,
    PatchNormWS2d,
    PatchNormWSAct2d,
)

__all__ = ['register', 'norm_layer_refusal', 'factory_key', 'NORM_LAYERS']

# timm looks its factories up with the name's underscores dropped: `patchnorm_ws` finds `patchnormws`
NORM_LAYERS = dict(patchnorm=PatchNorm2d, patchnorm2d=PatchNorm2d, patchnormws=PatchNormWS2d,
                   patchnormws2d=PatchNormWS2d, affinediv=AffineDivNorm2d, affinedivnorm2d=AffineDivNorm2d,
                   l2norm=L2Norm, l2norm2d=L2Norm2d)
NORM_ACT_LAYERS = dict(patchnorm=PatchNormAct2d, patchnorm2d=PatchNormAct2d, patchnormws=PatchNormWSAct2d,
                       patchnormws2d=PatchNormWSAct2d, affinediv=AffineDivNormAct2d,
                       affinedivnorm2d=AffineDivNormAct2d)
# ConvNeXt's (N, C, H, W) slots return channels-last memory, as its LayerNorm2d does
CONVNEXT_NORM_LAYERS = dict(patchnorm=(functools.partial(PatchNorm2d, channels_last=True), PatchNorm),
                            patchnormws=(functools.partial(PatchNormWS2d, channels_last=True), PatchNormWS),
                            affinediv=(functools.partial(AffineDivNorm2d, channels_last=True), AffineDivNorm),
                            l2norm=(L2Norm2d, L2Norm))


def factory_key(name: str) -> str:
    """The key timm's norm factories look `name` up by: lower case, underscores dropped."""
    return name.replace('_', '').lower()


def _add_entries(table: dict, entries: dict, where: str) -> None:
    for name, layer in entries.items():
        if table.setdefault(name, layer) != layer:
            raise RegistrationError(
                f"timm's {where} already has a different '{name}' ({table[name]!r}); "
                "timm_affinediv will not replace timm's own entries")


def _binding_init_model_traits(init_model_traits):
    @functools.wraps(init_model_traits)
    def init_model_traits_and_bind(model, *args, **kwargs):
        traits = init_model_traits(model, *args, **kwargs)
        bind_patchnorm(model)  # after the traits: the slots' shape check reads the model's input size from them
        init_residual_branches(model, get_residual_init())  # before pretrained weights, which replace it
        return traits
    init_model_traits_and_bind.binds_patchnorm = True
    return init_model_traits_and_bind


# what a constructor that calls `norm_layer(dim)` or `partial(norm_layer, ...)` raises for a string
_NOT_CALLABLE = ("'str' object is not callable", 'the first argument must be callable')


def norm_layer_refusal(error: Exception) -> str:
    """ How a model entrypoint refused a norm layer's name: 'class' where its constructor only calls a class (it
    called the string), 'swapped' where the entrypoint sets `norm_layer` itself (MobileNetV3's
    `dict(norm_layer=..., **kwargs)`: a TypeError or, Python 3.11's dict merge, a KeyError naming it), '' for any
    other error."""
    if isinstance(error, KeyError):
        return 'swapped' if error.args == ('norm_layer',) else ''
    message = str(error)
    if "got multiple values for keyword argument 'norm_layer'" in message:
        return 'swapped'
    return 'class' if any(m in message for m in _NOT_CALLABLE) else ''


def _swap_batchnorms(model: nn.Module, norm: str) -> nn.Module:
    """ `model` with its BatchNorm2d and BatchNormAct2d layers replaced by `norm` slots (the norm-act slot keeps
    the layer's activation and dropout), then bound: for the entrypoints that fix `norm_layer` themselves."""
    for path, module in list(model.named_modules()):
        if isinstance(module, BatchNormAct2d):
            slot = NORM_ACT_LAYERS[norm](module.num_features, apply_act=False)
            slot.act, slot.drop = module.act, module.drop
        elif type(module) is nn.BatchNorm2d:
            slot = NORM_LAYERS[norm](module.num_features)
        else:
            continue
        parent, _, name = path.rpartition('.')
        setattr(model.get_submodule(parent), name, slot)
    bind_patchnorm(model)
    return model


def _with_slot_class(create_fn):
    """ `create_fn`, for a slot's name as `norm_layer` where its family cannot take the string: with the slot class
    where the constructor only calls a class, with its BatchNorms swapped for slots where the entrypoint fixes
    `norm_layer` itself."""
    @functools.wraps(create_fn)
    def create(*args, **kwargs):
        try:
            return create_fn(*args, **kwargs)
        except (TypeError, KeyError) as e:
            norm = kwargs.get('norm_layer')
            norm = factory_key(norm) if isinstance(norm, str) else norm
            refusal = norm_layer_refusal(e) if norm in NORM_LAYERS else ''
            if refusal == 'swapped':
                return _swap_batchnorms(create_fn(*args, **{k: v for k, v in kwargs.items() if k != 'norm_layer'}),
                                        norm)
            if refusal != 'class':
                raise
        return create_fn(*args, **dict(kwargs, norm_layer=NORM_LAYERS[norm]))
    return create


def _slot_class_entrypoints(model_entrypoint):
    @functools.wraps(model_entrypoint)
    def entrypoint(*args, **kwargs):
        return _with_slot_class(model_entrypoint(*args, **kwargs))
    entrypoint.takes_slot_names = True
    return entrypoint


def register() -> None:
    """Register the layers with timm's factories and bind `patchnorm` slots in `create_model`."""
    _add_entries(compat.NORM_MAP, NORM_LAYERS, 'norm factory')
    compat.NORM_TYPES.update(NORM_LAYERS.values())
    _add_entries(compat.NORM_ACT_MAP, NORM_ACT_LAYERS, 'norm-act factory')
    compat.NORM_ACT_TYPES.update(NORM_ACT_LAYERS.values())
    compat.NORM_ACT_REQUIRES_ARG.update(NORM_ACT_LAYERS.values())
    # the norm-act factory maps a norm class to its norm-act twin by the class name
    _add_entries(compat.NORM_TO_NORM_ACT_MAP,
                 dict(patchnorm2d=PatchNormAct2d, patchnormws2d=PatchNormWSAct2d,
                      affinedivnorm2d=AffineDivNormAct2d), 'norm-act factory')
    _add_entries(compat.CONVNEXT_NORM_MAP, CONVNEXT_NORM_LAYERS, 'ConvNeXt norm map')
    compat.wrap_init_model_traits(_binding_init_model_traits, marker='binds_patchnorm')
    compat.wrap_model_entrypoint(_slot_class_entrypoints, marker='takes_slot_names')

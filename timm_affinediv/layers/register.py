""" Registration with timm's factories, on `import timm_affinediv`

Adds, without changing any of timm's own entries:
- `patchnorm` (`PatchNorm2d` slot), `affinediv` (`AffineDivNorm2d` slot: every affine map
  corrected), `l2norm` (`L2Norm`) and `l2norm2d` (`L2Norm2d`) to the norm factory
  (`get_norm_layer`/`create_norm_layer`);
- `patchnorm` and `affinediv` norm-act slots to the norm+act factory (`get_norm_act_layer`);
- `patchnorm`, `affinediv` and `l2norm` to ConvNeXt's own (NCHW, channels-last) norm map, so
  `convnext_*` takes them in both MLP layouts;
- a step inside `timm.create_model` (timm's model builder, after construction and before
  pretrained weights load) that binds the model's `patchnorm` slots.
Idempotent.
"""
import functools

from .. import _timm_compat as compat
from .binding import bind_patchnorm
from .norm import L2Norm, L2Norm2d
from .slot import AffineDivNorm, AffineDivNorm2d, AffineDivNormAct2d, PatchNorm, PatchNorm2d, PatchNormAct2d

__all__ = ['register']

NORM_LAYERS = dict(patchnorm=PatchNorm2d, patchnorm2d=PatchNorm2d, affinediv=AffineDivNorm2d,
                   affinedivnorm2d=AffineDivNorm2d, l2norm=L2Norm, l2norm2d=L2Norm2d)
NORM_ACT_LAYERS = dict(patchnorm=PatchNormAct2d, patchnorm2d=PatchNormAct2d, affinediv=AffineDivNormAct2d,
                       affinedivnorm2d=AffineDivNormAct2d)
# ConvNeXt's (N, C, H, W) slots return channels-last memory, as its LayerNorm2d does
CONVNEXT_NORM_LAYERS = dict(patchnorm=(functools.partial(PatchNorm2d, channels_last=True), PatchNorm),
                            affinediv=(functools.partial(AffineDivNorm2d, channels_last=True), AffineDivNorm),
                            l2norm=(L2Norm2d, L2Norm))


def _add_entries(table: dict, entries: dict, where: str) -> None:
    for name, layer in entries.items():
        if table.setdefault(name, layer) != layer:
            raise RuntimeError(
                f"timm's {where} already has a different '{name}' ({table[name]!r}); "
                "timm_affinediv will not replace timm's own entries")


def _binding_init_model_traits(init_model_traits):
    @functools.wraps(init_model_traits)
    def init_model_traits_and_bind(model, *args, **kwargs):
        traits = init_model_traits(model, *args, **kwargs)
        bind_patchnorm(model)  # after the traits: the slots' shape check reads the model's input size from them
        return traits
    init_model_traits_and_bind.binds_patchnorm = True
    return init_model_traits_and_bind


def register() -> None:
    """Register the layers with timm's factories and bind `patchnorm` slots in `create_model`."""
    _add_entries(compat.NORM_MAP, NORM_LAYERS, 'norm factory')
    compat.NORM_TYPES.update(NORM_LAYERS.values())
    _add_entries(compat.NORM_ACT_MAP, NORM_ACT_LAYERS, 'norm-act factory')
    compat.NORM_ACT_TYPES.update(NORM_ACT_LAYERS.values())
    compat.NORM_ACT_REQUIRES_ARG.update(NORM_ACT_LAYERS.values())
    # the norm-act factory maps a norm class to its norm-act twin by the class name
    _add_entries(compat.NORM_TO_NORM_ACT_MAP,
                 dict(patchnorm2d=PatchNormAct2d, affinedivnorm2d=AffineDivNormAct2d), 'norm-act factory')
    _add_entries(compat.CONVNEXT_NORM_MAP, CONVNEXT_NORM_LAYERS, 'ConvNeXt norm map')
    compat.wrap_init_model_traits(_binding_init_model_traits, marker='binds_patchnorm')

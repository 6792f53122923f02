""" The models of the paper experiments: the ablation MLP, narrow timm ResNet/ConvNeXt, and one model of every
README family, by norm variant """
import functools
from typing import Any, Callable, Dict, List, Tuple

import timm
import torch.nn as nn
from timm.layers import GroupNorm

import timm_affinediv  # noqa: F401  (registers norm_layer='patchnorm')
from timm_affinediv import AffineDivLinear, L2NormLinear, residual_init

__all__ = ['MLP_VARIANTS', 'BATCH_VARIANTS', 'RESNET_VARIANTS', 'CONVNEXT_VARIANTS', 'CONV_MODELS', 'ACTIVATIONS',
           'LABELS', 'FAMILIES', 'FAMILY_RECIPES', 'OPENED_FAMILIES', 'family_variants', 'native_norm', 'mlp_model',
           'conv_model', 'family_model']

MLP_VARIANTS = ('linear', 'batchnorm', 'layernorm', 'rmsnorm', 'l2normlinear', 'affinediv')
BATCH_VARIANTS = ('linear', 'batchnorm', 'l2normlinear', 'affinediv')
RESNET_VARIANTS = ('batchnorm', 'groupnorm', 'layernorm2d', 'identity', 'patchnorm')
CONVNEXT_VARIANTS = ('layernorm', 'rmsnorm', 'patchnorm')
CONV_MODELS = dict(resnet10t=RESNET_VARIANTS, convnext_atto=CONVNEXT_VARIANTS)
ACTIVATIONS: Dict[str, Callable[[], nn.Module]] = dict(tanh=nn.Tanh, leaky_relu=nn.LeakyReLU)
#: One model per README family, narrow where timm's smallest is too large to train in minutes on a 2-core CPU at
#: 32x32; ResNet-50 at full width. The conversion measurements (scripts/measure_family_conversion.py) use them too.
FAMILIES: Dict[str, Dict[str, Any]] = {
    'resnet18': dict(channels=(16, 32, 64, 128), stem_width=16),
    'resnet50': dict(),
    'convnext_atto': dict(dims=(16, 32, 64, 128)),
    'vit_tiny_patch16_224': dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2),
    'deit_tiny_patch16_224': dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2),
    'eva02_tiny_patch14_224': dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2),
    'swin_tiny_patch4_window7_224': dict(img_size=32, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4)),
    'tinynet_e': dict(),
    'regnetx_002': dict(),
    'mobilenetv3_small_050': dict(),
    'densenet121': dict(growth_rate=12, block_config=(2, 2, 2, 2)),
}
#: The optimiser a timm user would pick for each family from scratch: SGD (Nesterov) for the ResNet-era CNNs,
#: AdamW for ConvNeXt, the token models and the depthwise mobile networks (timm's recipes for them are AdamW/LAMB)
FAMILY_RECIPES: Dict[str, str] = {
    name: 'sgd' if name.startswith(('resnet', 'regnet', 'densenet')) else 'adamw' for name in FAMILIES}
_LAYERNORM_FAMILIES = ('convnext', 'vit', 'deit', 'eva', 'swin')
#: The families whose residual branches timm closes (`zero_init_last`) and `patchnorm`'s default opens
#: (`timm_affinediv.residual_init`): trained with timm's own initialisation too, beside the default
OPENED_FAMILIES = ('resnet18', 'resnet50', 'regnetx_002')


def native_norm(family: str) -> str:
    """The norm a family is built with by default: 'LayerNorm' or 'BatchNorm'."""
    return 'LayerNorm' if family.startswith(_LAYERNORM_FAMILIES) else 'BatchNorm'


def family_variants(family: str) -> Tuple[str, ...]:
    """The norms a family is trained with: its own, `patchnorm`; where the default opens residual branches (the
    ResNets and RegNet), `patchnorm` under timm's initialisation (`patchnorm_timm_init`) and GroupNorm (4 groups),
    a normaliser without batch statistics in BatchNorm's place; and on the families trained with SGD, whose
    rates `patchnorm` caps, `patchnorm_ws` (producers' weights standardised)."""
    opened = ('patchnorm_timm_init', 'groupnorm') if family in OPENED_FAMILIES else ()
    return ('native', 'patchnorm') + opened + (('patchnorm_ws',) if FAMILY_RECIPES[family] == 'sgd' else ())


LABELS = dict(native='native', linear='plain Linear', batchnorm='BatchNorm', layernorm='LayerNorm', rmsnorm='RMSNorm',
              l2normlinear='norm-like (L2NormLinear)', affinediv='affine-like (AffineDivLinear)',
              groupnorm='GroupNorm', layernorm2d='LayerNorm2d', identity='none', patchnorm='patchnorm',
              patchnorm_timm_init="patchnorm, timm's init", patchnorm_ws='patchnorm_ws')


def mlp_model(variant: str, width: int = 256, depth: int = 2, act: str = 'leaky_relu', in_features: int = 784,
              num_classes: int = 10) -> nn.Module:
    """ The ablation MLP: `depth` hidden blocks of `width` units, then a head; no norm has parameters.

    `linear`: `Linear -> act`; `batchnorm` / `layernorm` / `rmsnorm`: `Linear -> norm -> act` with
    `BatchNorm1d(affine=False)` / `LayerNorm(elementwise_affine=False)` / `RMSNorm(elementwise_affine=False)`
    and a plain head; `l2normlinear` / `affinediv`: every affine map, the head included, is
    `L2NormLinear` (scale "l2": `W x / |x| + b`) / `AffineDivLinear` (scale "rms"), and no norm.
    """
    norms: Dict[str, Callable[[int], nn.Module]] = dict(
        linear=nn.Identity, batchnorm=functools.partial(nn.BatchNorm1d, affine=False),
        layernorm=functools.partial(nn.LayerNorm, elementwise_affine=False),
        rmsnorm=functools.partial(nn.RMSNorm, elementwise_affine=False),
        l2normlinear=nn.Identity, affinediv=nn.Identity)
    if variant not in norms:
        raise ValueError(f"unknown MLP variant {variant!r}; choose from {MLP_VARIANTS}")
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; choose from {tuple(ACTIVATIONS)}")
    affine = dict(l2normlinear=L2NormLinear, affinediv=AffineDivLinear).get(variant, nn.Linear)
    layers: List[nn.Module] = [nn.Flatten()]
    features = in_features
    for _ in range(depth):
        layers += [affine(features, width), norms[variant](width), ACTIVATIONS[act]()]
        features = width
    layers.append(affine(features, num_classes))
    return nn.Sequential(*layers)


def conv_model(variant: str, model: str = 'resnet10t', num_classes: int = 10) -> nn.Module:
    """ A narrow timm `resnet10t` or `convnext_atto` (1 input channel) with the given norm.

    resnet10t: channels 16-128, stem 16; `identity` has no norm (and `zero_init_last=False`, as there is
    no norm weight to zero), `groupnorm` 4 groups. convnext_atto: its depths, dims 16-128; `layernorm`
    (native), `rmsnorm` (timm's RmsNorm2d) or `patchnorm`, through ConvNeXt's own norm map. Every norm starts
    from timm's initialisation (`residual_init('timm')`), as the experiment was recorded.
    """
    if model == 'convnext_atto':
        if variant not in CONVNEXT_VARIANTS:
            raise ValueError(f"unknown convnext variant {variant!r}; choose from {CONVNEXT_VARIANTS}")
        return timm.create_model('convnext_atto', in_chans=1, num_classes=num_classes, dims=(16, 32, 64, 128),
                                 norm_layer=variant)
    if model != 'resnet10t':
        raise ValueError(f"unknown conv model {model!r}; choose from {tuple(CONV_MODELS)}")
    norms = dict(
        batchnorm='batchnorm', groupnorm=functools.partial(GroupNorm, num_groups=4),
        layernorm2d='layernorm2d', identity=nn.Identity, patchnorm='patchnorm')
    if variant not in norms:
        raise ValueError(f"unknown resnet variant {variant!r}; choose from {RESNET_VARIANTS}")
    extra = dict(zero_init_last=False) if variant == 'identity' else {}
    with residual_init('timm'):
        return timm.create_model(
            'resnet10t', in_chans=1, num_classes=num_classes, channels=(16, 32, 64, 128), stem_width=16,
            norm_layer=norms[variant], **extra)


def family_model(variant: str, family: str, num_classes: int = 10) -> nn.Module:
    """ The model of a README family (`FAMILIES`, 1 input channel) with its own norm (`native`), `patchnorm`
    (its default initialisation), `patchnorm_timm_init` (timm's), `groupnorm` (4 groups) or `patchnorm_ws`
    (`family_variants` says which family takes which). """
    if family not in FAMILIES:
        raise ValueError(f"unknown family model {family!r}; choose from {tuple(FAMILIES)}")
    if variant not in family_variants(family):
        raise ValueError(f"unknown {family} variant {variant!r}; choose from {family_variants(family)}")
    norm = dict(native={}, patchnorm=dict(norm_layer='patchnorm'), patchnorm_timm_init=dict(norm_layer='patchnorm'),
                groupnorm=dict(norm_layer=functools.partial(GroupNorm, num_groups=4)),
                patchnorm_ws=dict(norm_layer='patchnorm_ws'))[variant]
    with residual_init('timm' if variant == 'patchnorm_timm_init' else 'skipinit'):
        return timm.create_model(family, in_chans=1, num_classes=num_classes, **FAMILIES[family], **norm)

""" The `patchnorm` norm slot: what `norm_layer="patchnorm"` builds in a timm model

timm constructs a norm layer knowing only its channel count, but PatchNorm divides a
convolution by the norms of *its input's* patches. So the norm layer timm builds is a slot:
a per-channel affine (`weight`, `bias`, so BatchNorm/LayerNorm checkpoints map onto it)
that `bind_patchnorm` binds to the affine maps beside it, turning the convolution or linear
that feeds it into `PatchNormConv2d`/`AffineDivLinear` (with a pre-division bias) and the one
it feeds into its divergence-corrected form too. A bound slot computes

    y = weight * x + bias

and where a producer feeds it, the producer applies this affine in the same pass as its
division by `s` (the slot's parameters stay the slot's; the slot passes its input through).

A `patchnorm_ws` slot binds the same way and also standardises its producer's weight (`standardise_weight`): a
scale-invariant producer, a different function from the paper's PatchNorm.

An unbound slot (nothing affine beside it, or not yet bound) takes the standalone form, the
RMS normaliser over channels followed by the affine (`rmsnorm`, the affine divergence's
solution (a)): `y = weight * x / sqrt(mean_c(x^2) + eps) + bias`.
"""
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Type

import torch
import torch.nn as nn
from timm.layers import register_notrace_module
from timm.layers.typing import LayerType

from .._timm_compat import create_act
from ..errors import NormMismatchError, ShapeError
from .affine_div import check_scale
from .kernels import functional, use_triton
from .norm import channel_affine, l2_normalise
from .patches import portable_ops

__all__ = ['PatchNorm', 'PatchNorm2d', 'PatchNormAct2d', 'PatchNormWS', 'PatchNormWS2d', 'PatchNormWSAct2d',
           'AffineDivNorm', 'AffineDivNorm2d', 'AffineDivNormAct2d', 'SlotBinding', 'NormMismatchError']

# what a BatchNorm layer's state dict holds beyond the affine a slot shares with it
_BATCHNORM_STATISTICS = ('running_mean', 'running_var', 'num_batches_tracked')


def _refuse_batchnorm_statistics(
        module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
        missing_keys: Any, unexpected_keys: Any, error_msgs: Any) -> None:
    """Raise `NormMismatchError` when the state dict holds BatchNorm running statistics for this slot, strict or
    not: loading only the shared `weight`/`bias` would make a model without the checkpoint's normalisation.
    A fused slot is also its producer's `fused_slot`, but there its prefix matches no key, so this fires once."""
    found = [prefix + name for name in _BATCHNORM_STATISTICS if prefix + name in state_dict]
    if found:
        raise NormMismatchError(
            f"the state dict is a BatchNorm model's: it holds {', '.join(found)} for the '{module.norm_name}' slot "
            f"{prefix[:-1] or '(root)'}, whose running statistics this model has no place for (loading it "
            f"would drop them and give a different model). Convert the BatchNorm model instead: "
            f"`timm-affinediv convert --model NAME --checkpoint FILE --output DIR`, or "
            f"`timm_affinediv.convert_model(model)` in Python.")


@dataclass(frozen=True)
class SlotBinding:
    """ What a slot is bound to, by module path in the model that was bound.

    `producer` is the convolution/linear feeding the slot, `consumers` those it feeds; both
    were made divergence corrected. A slot with neither is standalone, and `note` says why.
    `normalises`: the slot reaches its consumers only through an elementwise activation (CrossViT's
    `norm -> GELU -> Linear`), so it keeps normalising the activation's input, as a standalone slot does.
    """
    slot: str
    producer: Optional[str] = None
    consumers: Tuple[str, ...] = ()
    note: str = ''
    normalises: bool = False

    @property
    def bound(self) -> bool:
        return self.producer is not None or bool(self.consumers)


class PatchNormSlot(nn.Module):
    """ Base of the `patchnorm` slots: per-channel affine once bound, RMS normaliser + affine before.

    `scale` ("rms" or "l2") is the scaling the bound affine maps get.
    """
    channel_dim = 1
    __constants__ = ['channel_dim']
    # `affinediv` slots: every affine map of the model is corrected, the slot is only an affine
    corrects_all_affine = False
    # `patchnorm_ws` slots: the producer's weight is standardised (`standardise_weight`)
    standardises_producer = False
    norm_name = 'patchnorm'

    def __init__(self, num_features: int, eps: float = 1e-6, scale: str = 'rms', device=None, dtype=None):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.scale = check_scale(scale)
        self.weight = nn.Parameter(torch.ones(num_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(num_features, device=device, dtype=dtype))
        self.binding: Optional[SlotBinding] = None
        # plain bools, so torch.compile guards on them cheaply
        self.bound = False
        self.normalises = True
        self.fused = False
        # set by the producer's `fuse_post_affine`: whether its Triton path applies this slot's activation
        self.activation_in_producer = False
        self.register_load_state_dict_pre_hook(_refuse_batchnorm_statistics)

    def bind(self, binding: SlotBinding, fused: bool = False) -> None:
        """Record the binding; `fused`: the producer applies this slot's affine (`fuse_post_affine`)."""
        self.binding = binding
        self.bound = binding.bound or self.corrects_all_affine
        self.normalises = not self.bound or binding.normalises and not self.corrects_all_affine
        self.fused = fused

    @torch.jit.unused
    def kernel_activation(self) -> str:
        """The activation the fused producer's Triton kernel applies for this slot ('relu', 'silu', 'gelu'), or
        'none' (the slot applies its own): the one place that decides it, read by the producer and the slot."""
        if not (self.fused and self.activation_in_producer):
            return 'none'
        return functional.fused_activation(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.slot_forward(x)

    def slot_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The slot's function; subclasses wrap it (TorchScript compiles no `super().forward`)."""
        if x.dim() < 2 or x.shape[self.channel_dim] != self.num_features:
            raise ShapeError(
                f"the norm slot expects {self.num_features} channels in dim {self.channel_dim}, "
                f"got shape {list(x.shape)}")
        if self.fused:  # the producer applied this affine, in the pass that divided by s
            return x
        if self.normalises:
            x = l2_normalise(x, self.channel_dim, 'rms', self.eps)
        return channel_affine(x, self.weight, self.bias, self.channel_dim)

    def extra_repr(self) -> str:
        state = 'standalone' if self.binding is not None and not self.bound else (
            ('bound, normalising' if self.normalises else 'bound') if self.bound else 'unbound')
        return f'{self.num_features}, scale={self.scale}, {state}'


@register_notrace_module
class PatchNorm2d(PatchNormSlot):
    """ The `patchnorm` slot for (N, C, H, W) tensors (ResNet's `bn`, ConvNeXt's `conv_mlp` norms).

    `channels_last=True`: the output is in channels-last memory, as that of timm's `LayerNorm2d` (a permute
    around `layer_norm`) is. ConvNeXt's slots take it, so that the model runs channels-last from its stem
    on, as with LayerNorm, and its blocks' permutes to (N, H, W, C) cost nothing.
    """
    channel_dim = 1

    def __init__(self, num_features: int, eps: float = 1e-6, scale: str = 'rms', channels_last: bool = False,
                 device=None, dtype=None):
        super().__init__(num_features, eps=eps, scale=scale, device=device, dtype=dtype)
        self.channels_last = channels_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.slot_forward(x)
        if self.channels_last and self.channel_dim == 1 and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def extra_repr(self) -> str:
        return super().extra_repr() + (', channels_last' if self.channels_last else '')


@register_notrace_module
class PatchNorm(PatchNormSlot):
    """The `patchnorm` slot over the last dimension (channels-last ConvNeXt blocks, `norm -> Linear`)."""
    channel_dim = -1


@register_notrace_module
class PatchNormAct2d(PatchNorm2d):
    """ `patchnorm` slot + optional dropout + activation, for timm's norm-act factory.

    Takes the arguments of timm's `BatchNormAct2d` that apply to it.
    """

    def __init__(
            self,
            num_features: int,
            eps: float = 1e-6,
            scale: str = 'rms',
            apply_act: bool = True,
            act_layer: LayerType = nn.ReLU,
            act_kwargs: Optional[Dict[str, Any]] = None,
            inplace: bool = True,
            drop_layer: Optional[Type[nn.Module]] = None,
            device=None,
            dtype=None,
    ):
        super().__init__(num_features, eps=eps, scale=scale, device=device, dtype=dtype)
        self.drop = drop_layer() if drop_layer is not None else nn.Identity()
        self.act = create_act(act_layer, act_kwargs=act_kwargs, inplace=inplace, apply_act=apply_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.slot_forward(x)
        if self.fused and self.activation_in_producer and not portable_ops() and self._activation_applied(x):
            return x
        return self.act(self.drop(x))

    @torch.jit.unused
    def _activation_applied(self, x: torch.Tensor) -> bool:
        """Whether the fused producer's Triton kernel applied this slot's activation (TorchScript skips it)."""
        return use_triton(x) and self.kernel_activation() != 'none'


@register_notrace_module
class AffineDivNorm2d(PatchNorm2d):
    """ The `affinediv` slot (N, C, H, W): binds like `patchnorm`, and also makes every other Conv2d/Linear
    of the model divergence corrected; never normalises, only `weight * x + bias` (the paper's
    alternative to normalisation)."""
    corrects_all_affine = True
    norm_name = 'affinediv'


@register_notrace_module
class AffineDivNorm(PatchNorm):
    """The `affinediv` slot over the last dimension (see `AffineDivNorm2d`)."""
    corrects_all_affine = True
    norm_name = 'affinediv'


@register_notrace_module
class AffineDivNormAct2d(PatchNormAct2d):
    """The `affinediv` slot + dropout + activation, for timm's norm-act factory."""
    corrects_all_affine = True
    norm_name = 'affinediv'


@register_notrace_module
class PatchNormWS2d(PatchNorm2d):
    """ The `patchnorm_ws` slot (N, C, H, W): binds like `patchnorm`, and its producer applies its weight
    standardised per output channel, `(W - mean W) / sqrt(n (var W + 1e-6))` over the fan-in `n`, so the producer's
    output no longer grows with its weight's scale (timm's `ScaledStdConv2d`, gain 1: the slot's `weight` is the
    gain). A different function from `patchnorm`'s: for training from scratch, not for converting trained weights."""
    standardises_producer = True
    norm_name = 'patchnorm_ws'


@register_notrace_module
class PatchNormWS(PatchNorm):
    """The `patchnorm_ws` slot over the last dimension (see `PatchNormWS2d`)."""
    standardises_producer = True
    norm_name = 'patchnorm_ws'


@register_notrace_module
class PatchNormWSAct2d(PatchNormAct2d):
    """The `patchnorm_ws` slot + dropout + activation, for timm's norm-act factory."""
    standardises_producer = True
    norm_name = 'patchnorm_ws'

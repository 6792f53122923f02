"""timm-affinediv: the layers of "The Affine Divergence" (ICLR 2026 GRaM workshop) for timm.

Importing the package registers `norm_layer="patchnorm"` (and `l2norm`, `l2norm2d`) with timm.
"""
from .convert import ConversionError, ConversionReport, convert_model
from .diagnostics import LayerFactorStats, divergence_report, format_report, plot_report, update_factor
from .errors import AffineDivError
from .hub import HubError, push_to_hub, save_hub_folder
from .layers.affine_div import AffineDivLinear, PatchNormConv2d, divergence_constant, patch_sq_norm
from .layers.binding import bind_patchnorm, describe_slots, divergence_corrected
from .layers.norm import L2Norm, L2Norm2d, L2NormLinear, l2_normalise
from .layers.register import register
from .layers.slot import (
    AffineDivNorm,
    AffineDivNorm2d,
    AffineDivNormAct2d,
    NormMismatchError,
    PatchNorm,
    PatchNorm2d,
    PatchNormAct2d,
    SlotBinding,
)
from .version import __version__

register()

"""The layers of the affine divergence and their binding into timm models, as `timm.layers` holds timm's own."""
from .affine_div import AffineDivLinear, PatchNormConv2d, divergence_constant, standardised_weight
from .binding import bind_patchnorm, describe_kernel_paths, describe_slots, divergence_corrected, layer_kernel_paths
from .norm import L2Norm, L2Norm2d, L2NormLinear, l2_normalise
from .patches import patch_sq_norm
from .recurrent import AffineDivLSTM
from .register import register
from .residual_init import RESIDUAL_INITS, get_residual_init, init_residual_branches, residual_init
from .slot import (
    AffineDivNorm,
    AffineDivNorm2d,
    AffineDivNormAct2d,
    NormMismatchError,
    PatchNorm,
    PatchNorm2d,
    PatchNormAct2d,
    PatchNormWS,
    PatchNormWS2d,
    PatchNormWSAct2d,
    SlotBinding,
)

__all__ = [
    'AffineDivLinear', 'AffineDivLSTM', 'PatchNormConv2d', 'divergence_constant', 'standardised_weight',
    'patch_sq_norm', 'bind_patchnorm',
    'describe_kernel_paths', 'describe_slots', 'divergence_corrected', 'layer_kernel_paths', 'L2Norm', 'L2Norm2d',
    'L2NormLinear', 'l2_normalise', 'register', 'RESIDUAL_INITS', 'get_residual_init', 'init_residual_branches',
    'residual_init', 'AffineDivNorm', 'AffineDivNorm2d', 'AffineDivNormAct2d',
    'NormMismatchError', 'PatchNorm', 'PatchNorm2d', 'PatchNormAct2d', 'PatchNormWS', 'PatchNormWS2d',
    'PatchNormWSAct2d', 'SlotBinding',
]

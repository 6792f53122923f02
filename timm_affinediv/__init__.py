"""timm-affinediv: the layers of "The Affine Divergence" (ICLR 2026 GRaM workshop) for timm.

Importing the package registers `norm_layer="patchnorm"` (and `l2norm`, `l2norm2d`) with timm.
"""
from ._timm_version import check_timm_version, refuse_in_command
from .errors import TimmVersionError

try:
    check_timm_version()  # first: an untested timm is refused before any module reaches into its internals
except TimmVersionError as error:
    refuse_in_command(error)
    raise

from ._pillow_compat import install_posterize_shim
from .convert import ConversionError, ConversionReport, ConvertOptions, convert_model
from .diagnostics import LayerFactorStats, divergence_report, format_report, plot_report, update_factor
from .errors import AffineDivError
from .hub import HubError, push_to_hub, save_hub_folder
from .layers import *  # noqa: F403  the layers and their binding (`layers.__all__`)
from .layers import register
from .recover import RecoverOptions, RecoveryReport, recover_model
from .version import __version__

register()
install_posterize_shim()  # timm's RandAugment posterize to 0 bits under Pillow 13, train.py's included

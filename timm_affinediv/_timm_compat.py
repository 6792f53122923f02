""" Every private timm name timm-affinediv uses, in one place, with the timm versions it is tested with

timm keeps its norm factories' tables, its model builder's traits step and a few helpers private (leading
underscore): they may change in any release. The package reaches them only through this module, and refuses a
timm outside `TESTED_TIMM` on import, before this module is imported (`_timm_version`), with one line saying which
versions work. `TIMM_AFFINEDIV_ALLOW_UNTESTED_TIMM=1` turns the refusal into a warning (at your own risk).
"""
from typing import Callable

import timm

# the package's __init__ has run `check_timm_version` before this module is imported: these private names are
# those of a tested timm
import timm.layers.create_norm as _create_norm
import timm.layers.create_norm_act as _create_norm_act
import timm.models._builder as _builder
import timm.models._factory as _factory
import timm.models._hub as _hub
import timm.models.convnext as _convnext
from timm.layers.norm_act import _create_act
from timm.models._input import get_model_args, get_model_input_config

from ._timm_version import ALLOW_UNTESTED_ENV, TESTED_TIMM, check_timm_version
from .errors import TimmVersionError

__all__ = [
    'TESTED_TIMM', 'ALLOW_UNTESTED_ENV', 'check_timm_version', 'get_model_args', 'get_model_input_config',
    'create_act', 'NORM_MAP', 'NORM_TYPES', 'NORM_ACT_MAP', 'NORM_ACT_TYPES', 'NORM_ACT_REQUIRES_ARG',
    'NORM_TO_NORM_ACT_MAP', 'CONVNEXT_NORM_MAP', 'save_config_for_hf', 'download_from_hf', 'wrap_init_model_traits',
    'wrap_model_entrypoint']


#: `timm.layers.norm_act._create_act`: the activation of a norm+act layer, as timm's own norm-act layers build it.
create_act: Callable = _create_act

# the norm factories' tables (the same objects: entries added here are timm's)
NORM_MAP: dict = _create_norm._NORM_MAP
NORM_TYPES: set = _create_norm._NORM_TYPES
NORM_ACT_MAP: dict = _create_norm_act._NORM_ACT_MAP
NORM_ACT_TYPES: set = _create_norm_act._NORM_ACT_TYPES
NORM_ACT_REQUIRES_ARG: set = _create_norm_act._NORM_ACT_REQUIRES_ARG
NORM_TO_NORM_ACT_MAP: dict = _create_norm_act._NORM_TO_NORM_ACT_MAP
CONVNEXT_NORM_MAP: dict = _convnext._NORM_MAP

#: `timm.models._hub.save_config_for_hf`: the `config.json` half of timm's `save_for_hf`, whose weights half hands
#: the state dict to safetensors as it is (which refuses a channels-last model's weights)
save_config_for_hf: Callable = _hub.save_config_for_hf
#: `timm.models._hub.download_from_hf`: one file of a Hub repo, through timm's cache (the file timm would read)
download_from_hf: Callable = _hub.download_from_hf


def wrap_init_model_traits(wrap: Callable[[Callable], Callable], marker: str) -> None:
    """Replace the step of `timm.create_model` that runs after construction (`_builder._init_model_traits`) by
    `wrap(step)`, once: a step carrying the attribute `marker` is already wrapped."""
    step = getattr(_builder, '_init_model_traits', None)
    if step is None:
        low, high = TESTED_TIMM
        raise TimmVersionError(f"this timm ({timm.__version__}) has no model-builder traits step, where "
                               f'timm_affinediv binds patchnorm slots: install timm>={low},<{high}')
    if not getattr(step, marker, False):
        _builder._init_model_traits = wrap(step)


def wrap_model_entrypoint(wrap: Callable[[Callable], Callable], marker: str) -> None:
    """Replace the lookup `timm.create_model` gets a model's entrypoint with (`_factory.model_entrypoint`) by
    `wrap(lookup)`, once: a lookup carrying the attribute `marker` is already wrapped."""
    if not getattr(_factory.model_entrypoint, marker, False):
        _factory.model_entrypoint = wrap(_factory.model_entrypoint)

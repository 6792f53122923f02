""" Every private timm name timm-affinediv uses, in one place, with the timm versions it is tested with

timm keeps its norm factories' tables, its model builder's traits step and a few helpers private (leading
underscore): they may change in any release. The package reaches them only through this module, and refuses a
timm outside `TESTED_TIMM` on import with one line saying which versions work, rather than failing somewhere a
user meets first. `TIMM_AFFINEDIV_ALLOW_UNTESTED_TIMM=1` turns the refusal into a warning (at your own risk).
"""
import os
import warnings
from typing import Callable, Optional

import timm
import timm.layers.create_norm as _create_norm
import timm.layers.create_norm_act as _create_norm_act
import timm.models._builder as _builder
import timm.models._factory as _factory
import timm.models.convnext as _convnext
from packaging.version import Version
from timm.layers.norm_act import _create_act
from timm.models._input import get_model_args, get_model_input_config

from .errors import TimmVersionError

__all__ = [
    'TESTED_TIMM', 'check_timm_version', 'get_model_args', 'get_model_input_config', 'create_act', 'NORM_MAP',
    'NORM_TYPES', 'NORM_ACT_MAP', 'NORM_ACT_TYPES', 'NORM_ACT_REQUIRES_ARG', 'NORM_TO_NORM_ACT_MAP',
    'CONVNEXT_NORM_MAP', 'wrap_init_model_traits', 'wrap_model_entrypoint']

#: The timm releases this package is tested with (also `dependencies` in pyproject.toml): >= first, < second.
TESTED_TIMM = ('1.0.31', '1.1')
ALLOW_UNTESTED_ENV = 'TIMM_AFFINEDIV_ALLOW_UNTESTED_TIMM'


def check_timm_version(version: Optional[str] = None) -> None:
    """Raise `TimmVersionError` unless timm `version` (default: the installed one) is in `TESTED_TIMM`."""
    version = timm.__version__ if version is None else version
    low, high = TESTED_TIMM
    release = Version(Version(version).base_version)  # a pre-release of 1.1 is 1.1's code, not 1.0's
    if Version(low) <= release < Version(high):
        return
    message = (f'timm {version} is not supported by timm-affinediv, which reaches into timm internals tested only '
               f'with timm>={low},<{high}: pip install "timm>={low},<{high}" (or set {ALLOW_UNTESTED_ENV}=1 to try)')
    if os.environ.get(ALLOW_UNTESTED_ENV) == '1':
        warnings.warn(message, stacklevel=2)
    else:
        raise TimmVersionError(message)


check_timm_version()

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

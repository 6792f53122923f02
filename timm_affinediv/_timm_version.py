""" The timm releases timm-affinediv is tested with, checked before anything reaches into timm's internals

`import timm_affinediv` calls `check_timm_version` first, before any module imports a private timm name
(`_timm_compat`), so a timm whose internals moved is refused in one line rather than failing in an import.
`TIMM_AFFINEDIV_ALLOW_UNTESTED_TIMM=1` turns the refusal into a warning (at your own risk).
"""
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import timm  # public and self-consistent in any release: the private names come after the check
from packaging.version import Version

from .errors import TimmVersionError

__all__ = ['TESTED_TIMM', 'ALLOW_UNTESTED_ENV', 'check_timm_version', 'refuse_in_command']

#: The timm releases this package is tested with (also `dependencies` in pyproject.toml): >= first, < second.
TESTED_TIMM = ('1.0.31', '1.1')
ALLOW_UNTESTED_ENV = 'TIMM_AFFINEDIV_ALLOW_UNTESTED_TIMM'



def check_timm_version(version: Optional[str] = None) -> None:
    """Raise `TimmVersionError` unless timm `version` (default: the installed one) is in `TESTED_TIMM`; with
    `TIMM_AFFINEDIV_ALLOW_UNTESTED_TIMM=1` warn instead."""
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


def refuse_in_command(error: Exception) -> None:
    """In the `timm-affinediv` command (or `python -m timm_affinediv`), print `error` as one line and exit with
    status 2, as the command does for any bad input; elsewhere return, so that the import raises it."""
    # the package is imported before the command's code runs: while `-m` locates the package, sys.argv[0] is '-m'
    if Path(sys.argv[0]).name == 'timm-affinediv' or sys.argv[0] == '-m':
        print(f'timm-affinediv: error: {error}', file=sys.stderr)
        sys.exit(2)

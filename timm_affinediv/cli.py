""" The command lines' shared argument checks and error handling

Every command (`timm_affinediv.commands`) parses its flags with `ArgumentParser` and these `argparse` types, so bad
input stops before any work with one line (`timm-affinediv finetune: error: argument --train-subset: -1 is not a
positive integer`) and exit status 2, and runs its `main` through `run_main`, which turns the package's user-facing
errors (a checkpoint that does not fit, a folder that is not a Hub folder, data that is missing, ...) into one line
on stderr and exit status 2 instead of a traceback. `refuse_existing_output` is the one check that a command would
overwrite earlier results.
"""
import argparse
import os
import sys
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence

import timm

from . import _timm_compat as compat
from .errors import AffineDivError

__all__ = [
    'USER_ERRORS', 'ArgumentParser', 'positive_int', 'non_negative_int', 'positive_float', 'non_negative_float',
    'unit_interval', 'existing_path', 'existing_file', 'existing_dir', 'data_source', 'norm_name', 'timm_model_name',
    'model_name',
    'refuse_existing_output', 'run_main']

#: Errors that report bad input (arguments, files, data), not a bug: one line and exit status 2, no traceback
#: (`TIMM_AFFINEDIV_DEBUG=1` shows the traceback instead).
USER_ERRORS = (AffineDivError, FileExistsError, FileNotFoundError)
DEBUG_ENV = 'TIMM_AFFINEDIV_DEBUG'


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line (what was wrong, and where the usage is) and exit 2."""

    def error(self, message: str):
        self.exit(2, f'{self.prog}: error: {message} (see --help)\n')


def _number(parse: Callable[[str], float], ok: Callable[[float], bool], what: str) -> Callable[[str], float]:
    def check(text: str):
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f'{text!r} is not {what}') from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f'{text} is not {what}')
        return value
    check.__name__ = what  # argparse names the type in its messages
    return check


positive_int = _number(int, lambda v: v >= 1, 'a positive integer')
non_negative_int = _number(int, lambda v: v >= 0, 'an integer >= 0')
positive_float = _number(float, lambda v: v > 0, 'a number > 0')
non_negative_float = _number(float, lambda v: v >= 0, 'a number >= 0')
unit_interval = _number(float, lambda v: 0 <= v <= 1, 'a number in [0, 1]')


def existing_path(text: str) -> str:
    """A file or folder that exists."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f'{text} does not exist')
    return text


def existing_file(text: str) -> str:
    """A file that exists."""
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f'{text} is not a file' if Path(text).exists() else f'{text} does not exist')
    return text


def existing_dir(text: str) -> str:
    """A folder that exists."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f'{text} is not a folder' if Path(text).exists() else f'{text} does not exist')
    return text


def data_source(*names: str) -> Callable[[str], str]:
    """One of the built-in data `names` (e.g. 'fashion-mnist'), or an existing image folder."""
    def check(text: str) -> str:
        return text if text in names else existing_dir(text)
    return check


def norm_names() -> List[str]:
    """The norm layer names timm's factories know (timm's own and those `import timm_affinediv` registers)."""
    return sorted(set(compat.NORM_MAP) | set(compat.NORM_ACT_MAP))


def norm_name(text: str) -> str:
    """A `norm_layer` name of timm's norm factories, e.g. batchnorm, layernorm2d, patchnorm."""
    if text.lower() not in norm_names():
        raise argparse.ArgumentTypeError(f"unknown norm layer '{text}'; choose one of {', '.join(norm_names())}")
    return text


def timm_model_name(text: str) -> str:
    """An architecture in timm's registry (`timm.list_models()`)."""
    if not timm.is_model(text):
        raise argparse.ArgumentTypeError(f"unknown timm model '{text}'; list the names with timm.list_models()")
    return text


def model_name(text: str) -> str:
    """A timm architecture, `hf-hub:org/name`, or `local-dir:PATH` of an existing Hub-format folder."""
    if text.startswith('local-dir:'):
        folder = Path(text[len('local-dir:'):])
        if not (folder / 'config.json').is_file():
            raise argparse.ArgumentTypeError(
                f'{folder} is not a Hub-format model folder (no config.json)'
                if folder.is_dir() else f'{folder} does not exist')
        return text
    if text.startswith('hf-hub:'):
        return text
    if not timm.is_model(text):
        raise argparse.ArgumentTypeError(
            f"unknown model '{text}'; give a timm model name (timm.list_models()), hf-hub:org/name or local-dir:PATH")
    return text


def refuse_existing_output(path: str | Path, flag: str = '--overwrite', names: Optional[Iterable[str]] = None) -> None:
    """ Raise `FileExistsError` if `path` holds earlier results: any entry, or one of `names` when the command writes
    only those files into a folder that may hold others. Call it before any work starts, unless told to overwrite.
    """
    path = Path(path)
    if names is not None:
        found = [name for name in names if (path / name).exists()]
    else:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else ([path.name] if path.exists() else [])
    if found:
        shown = ', '.join(found[:5]) + (f' and {len(found) - 5} more' if len(found) > 5 else '')
        raise FileExistsError(f'{path} holds earlier results ({shown}); pass {flag} to replace them, '
                              'or choose another --output.')


def run_main(main: Callable[[Optional[Sequence[str]]], int], argv: Optional[Sequence[str]] = None,
             prog: Optional[str] = None) -> int:
    """Run a command's `main`; a user-facing error becomes `<prog>: error: <message>` on stderr and status 2
    (`prog` defaults to the name of `main`'s file); with `TIMM_AFFINEDIV_DEBUG=1` the error propagates, traceback
    and all."""
    try:
        return main(argv)
    except USER_ERRORS as e:
        if os.environ.get(DEBUG_ENV, '') not in ('', '0'):
            raise
        message = ' '.join(str(e).split())  # one line: some messages span several
        print(f'{prog or Path(main.__code__.co_filename).name}: error: {message}', file=sys.stderr)
        return 2

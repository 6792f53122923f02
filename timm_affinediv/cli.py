""" The command lines' shared argument checks and error handling

Every command (`timm_affinediv.commands`) parses its flags with `ArgumentParser` and these `argparse` types, so bad
input stops before any work with one line (`timm-affinediv finetune: error: argument --train-subset: -1 is not a
positive integer`) and exit status 2, and runs its `main` through `run_main`, which turns the package's user-facing
errors (a checkpoint that does not fit, a folder that is not a Hub folder, data that is missing, ...) into one line
on stderr and exit status 2 instead of a traceback. `refuse_existing_output` (the library's, from
`timm_affinediv.files`) is the one check that a command would overwrite earlier results.
"""
import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import timm
from timm.utils import ParseKwargs

from . import _timm_compat as compat
from .errors import AffineDivError, DataError
from .files import refuse_existing_output
from .layers.register import factory_key

__all__ = [
    'USER_ERRORS', 'ArgumentParser', 'positive_int', 'non_negative_int', 'positive_float', 'non_negative_float',
    'unit_interval', 'existing_path', 'existing_file', 'existing_dir', 'data_source', 'norm_name', 'timm_model_name',
    'model_name', 'add_model_args', 'create_model_kwargs', 'add_data_args', 'add_deprecated_alias', 'data_location',
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
    if factory_key(text) not in norm_names():
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


def add_model_args(
        parser: argparse.ArgumentParser,
        *,
        model_type: Callable[[str], str] = model_name,
        default: Optional[str] = None,
        pretrained: bool = True,
        checkpoint: Sequence[str] = ('--checkpoint',),
        checkpoint_type: Callable[[str], str] = existing_file,
        head: bool = True,
        help: Optional[Dict[str, str]] = None,
) -> argparse._ArgumentGroup:
    """ The model flags every command shares, in a 'model' group: `--model`, `--pretrained`, `--checkpoint`,
    `--num-classes`, `--in-chans`, `--model-kwargs` (timm's train.py names; `create_model_kwargs` turns them into
    `timm.create_model` arguments). A command leaves out `--pretrained` or the head flags (`head`), names the
    checkpoint flag(s) (`checkpoint`, dest of the first), and rewords a flag's help through `help` (flag -> text).
    Returns the group, for the command's own model flags.
    """
    texts = {
        '--model': 'timm model name (with --checkpoint or --pretrained), hf-hub:org/name or local-dir:PATH',
        '--pretrained': "timm's pretrained weights for the model name",
        '--checkpoint': 'weights for a timm model name: .safetensors or a timm/PyTorch checkpoint',
        '--num-classes': 'classes of the head (timm model name only)',
        '--in-chans': 'input channels (timm model name only)',
        '--model-kwargs': 'more timm.create_model arguments',
    }
    texts.update(help or {})
    group = parser.add_argument_group('model')
    group.add_argument('--model', type=model_type, default=default, required=default is None, help=texts['--model'])
    if pretrained:
        group.add_argument('--pretrained', action='store_true', help=texts['--pretrained'])
    if checkpoint:
        group.add_argument(*checkpoint, type=checkpoint_type, metavar='PATH', help=texts['--checkpoint'])
    if head:
        group.add_argument('--num-classes', type=positive_int, help=texts['--num-classes'])
        group.add_argument('--in-chans', type=positive_int, help=texts['--in-chans'])
    # one default for every command: no --model-kwargs is an empty mapping, never None
    group.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs,
                       metavar='KEY=VALUE', help=texts['--model-kwargs'])
    return group


def create_model_kwargs(args: argparse.Namespace, **more: Any) -> Dict[str, Any]:
    """The `timm.create_model` arguments of `add_model_args`' flags: `--model-kwargs`, then `--num-classes` and
    `--in-chans` where given, then `more` (e.g. `norm_layer`) where not None."""
    kwargs = dict(getattr(args, 'model_kwargs', None) or {})
    for key in ('num_classes', 'in_chans'):
        if getattr(args, key, None) is not None:
            kwargs[key] = getattr(args, key)
    kwargs.update({k: v for k, v in more.items() if v is not None})
    return kwargs


def _warn_deprecated(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    print(f'{parser.prog}: warning: {old} is deprecated and goes in the next version; use {new}', file=sys.stderr)


class _DeprecatedAlias(argparse.Action):
    """An old flag name of `new`: stores the value as `new` does, with one deprecation line on stderr."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        _warn_deprecated(parser, option_string, self.new)
        setattr(namespace, self.dest, values)


class _DeprecatedDataSource(argparse.Action):
    """An old flag that named the data in one value, a built-in dataset or an image folder: sets `--dataset` and
    `--data-dir` from it, with one deprecation line on stderr."""

    def __init__(self, option_strings, dest, builtins: Sequence[str] = (), **kwargs):
        self.builtins = tuple(builtins)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if values in self.builtins:
            _warn_deprecated(parser, option_string, f'--dataset {values}')
            namespace.dataset = values
        else:
            _warn_deprecated(parser, option_string, "--dataset '' --data-dir PATH")
            namespace.dataset, namespace.data_dir = '', values


def add_deprecated_alias(group: argparse._ActionsContainer, old: str, new: str, dest: str,
                         type: Callable[[str], Any] = str) -> None:
    """Accept `old`, hidden from --help, as the flag `new` (destination `dest`) for one more version, with one
    deprecation line on stderr when used."""
    group.add_argument(old, dest=dest, type=type, action=_DeprecatedAlias, new=new, help=argparse.SUPPRESS)


def add_data_args(
        parser: argparse.ArgumentParser,
        *,
        builtins: Sequence[str] = ('fashion-mnist',),
        default: str = 'fashion-mnist',
        any_dataset: bool = False,
        old_source_flags: Sequence[str] = (),
        old_dir_flags: Sequence[str] = (),
) -> argparse._ArgumentGroup:
    """ The data flags every command shares, in a 'data' group, with timm's train.py names: `--dataset` (one of
    `builtins`, or '' for an image folder; any timm `create_dataset` name if `any_dataset`) and `--data-dir` (the
    folder). `old_source_flags` (one value: a built-in name or a folder) and `old_dir_flags` (the folder) are the
    names earlier versions used, accepted for one more version with a deprecation line.
    Returns the group, for the command's own data flags.
    """
    def dataset(text: str) -> str:
        if any_dataset or text in ('', *builtins):
            return text
        raise argparse.ArgumentTypeError(
            f"unknown dataset {text!r}: use one of {', '.join(builtins)}, or '' for an image folder at --data-dir")
    dataset.__name__ = 'dataset'
    names = ', '.join(repr(b) for b in builtins)
    group = parser.add_argument_group('data')
    group.add_argument('--dataset', default=default, type=dataset,
                       help=f"{names} (built in), or '' for an image folder at --data-dir (<dir>/<class>/* or "
                            "<dir>/train/<class>/* and <dir>/validation/<class>/*)")
    group.add_argument('--data-dir', type=existing_dir, metavar='PATH',
                       help='the image folder, or the Fashion-MNIST files when not the Debian default '
                            '(/usr/share/datasets/fashion-mnist)')
    for flag in old_source_flags:
        group.add_argument(flag, dest='dataset', type=data_source(*builtins), action=_DeprecatedDataSource,
                           builtins=builtins, help=argparse.SUPPRESS)
    for flag in old_dir_flags:
        add_deprecated_alias(group, flag, '--data-dir', 'data_dir', type=existing_dir)
    return group


def data_location(args: argparse.Namespace) -> str:
    """The data of `add_data_args`' flags in one value: the built-in dataset's name, or the image folder."""
    if not args.dataset and not args.data_dir:
        raise DataError("--dataset '' reads an image folder: pass --data-dir PATH")
    return args.dataset if args.dataset else args.data_dir


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

""" The `timm-affinediv` command: one subcommand per module of this package, each a `main(argv) -> exit status`

    timm-affinediv convert --model local-dir:runs/demo/baseline --output runs/converted
    python -m timm_affinediv convert ...      # the same
"""
import argparse
import copy
import importlib
from typing import List, Optional

from ..cli import ArgumentParser, run_main
from ..version import __version__

__all__ = ['main', 'command_parser', 'COMMANDS']

# subcommand -> (module of this package, one line of help)
COMMANDS = {
    'pipeline': ('pipeline', 'the demo job: a BatchNorm model -> PatchNorm -> fine-tuned -> Hub-ready folder'),
    'convert': ('convert', 'convert a trained BatchNorm/LayerNorm timm model and write a Hub-ready folder'),
    'finetune': ('finetune', 'train or fine-tune a timm model (with distillation, DDP under torchrun)'),
    'push': ('push', 'upload a Hub-ready folder to the Hugging Face Hub'),
    'report': ('report', 'measure the affine divergence of every affine layer of a timm model'),
    'export': ('export', 'export a model to ONNX, validated against eager with ONNX Runtime'),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; every option that has a default names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help = action.help or ''
        if action.default not in (None, False, argparse.SUPPRESS) and '%(default)' not in help \
                and 'default' not in help and (action.option_strings or action.nargs in ('?', '*')):
            help += ' (default: %(default)s)'
        return help

    def _format_action(self, action: argparse.Action) -> str:
        # argparse leaves out the help, and so the default, of an option that has no help text
        if not action.help and action.default not in (None, False, argparse.SUPPRESS):
            action = copy.copy(action)
            action.help = '(default: %(default)s)'
        return super()._format_action(action)


def command_parser(command: str, doc: str, prog: Optional[str] = None) -> ArgumentParser:
    """The parser of `timm-affinediv <command>` (or of the script `prog`): `doc`'s first paragraph describes it, the
    rest (examples) follows."""
    description, _, epilog = doc.strip().partition('\n\n')
    return ArgumentParser(
        prog=prog or f'timm-affinediv {command}', description=description, epilog=epilog and 'examples:\n' + epilog,
        formatter_class=HelpFormatter)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='timm-affinediv', formatter_class=argparse.RawDescriptionHelpFormatter,
        description='The Affine Divergence (ICLR 2026 GRaM workshop) layers for timm: convert, fine-tune, publish, '
                    'export and measure.',
        epilog='commands:\n' + '\n'.join(f'  {name:20s}{text}' for name, (_, text) in COMMANDS.items())
               + "\n\n`timm-affinediv COMMAND --help` shows the command's options, their defaults and an example, "
               'e.g.\n'
               '  timm-affinediv pipeline --output runs/demo\n\n'
               'The benchmarks and the paper experiments are scripts of the source tree: scripts/*.py.')
    parser.add_argument('--version', action='version', version=f'%(prog)s {__version__}')
    parser.add_argument('command', choices=COMMANDS, metavar='COMMAND', help='one of: ' + ', '.join(COMMANDS))
    parser.add_argument('args', nargs=argparse.REMAINDER, help='the command\'s own arguments')
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run `timm-affinediv COMMAND ARGS...`; returns the command's exit status."""
    args = _parser().parse_args(argv)
    module = importlib.import_module(f'{__name__}.{COMMANDS[args.command][0]}')
    return run_main(module.main, args.args, prog=f'timm-affinediv {args.command}')


"""The package as a user installs it: the templates, license and commands ship, and under CI the tests import the
installed package, not the checkout."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import timm_affinediv
from timm_affinediv.cli import COMMANDS
from timm_affinediv.hub import model_card_template

CHECKOUT = Path(__file__).resolve().parents[1]
# CI, and `make test` everywhere, run the tests against the installed wheel
WHEEL_RUN = bool(os.environ.get('CI') or os.environ.get('TIMM_AFFINEDIV_WHEEL_TEST'))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=Path(sys.executable).parent)


@pytest.mark.skipif(not WHEEL_RUN, reason='make test and CI run the tests against the installed wheel; a checkout may not')
def test_ci_imports_the_installed_package_not_the_checkout():
    package = Path(timm_affinediv.__file__).resolve()
    assert not package.is_relative_to(CHECKOUT), f'{package} is the checkout: install the wheel (make test)'
    dist = importlib.metadata.distribution('timm-affinediv')
    assert dist.version == timm_affinediv.__version__
    assert not dist.read_text('direct_url.json') or '"editable": true' not in dist.read_text('direct_url.json')
    assert any(f.name == 'LICENSE' for f in dist.files), 'the wheel ships no LICENSE'
    assert (Path(sys.executable).parent / 'timm-affinediv').is_file(), 'the console command is not installed'


def test_model_card_template_ships_with_the_package_and_is_the_checkouts():
    template = model_card_template()
    assert '$model_name' in template and '$model_args' in template
    assert template == (CHECKOUT / 'model_cards' / 'patchnorm.md').read_text(encoding='utf-8')


def test_version_and_help_of_every_command():
    """`python -m timm_affinediv` (and the installed `timm-affinediv`, in a wheel run) names the version and each command's
    defaults and an example; run from outside the checkout."""
    launchers = [[sys.executable, '-m', 'timm_affinediv']]
    if WHEEL_RUN:
        launchers.append([str(Path(sys.executable).parent / 'timm-affinediv')])
    for launcher in launchers:
        version = _run(*launcher, '--version')
        assert version.returncode == 0 and version.stdout.strip() == f'timm-affinediv {timm_affinediv.__version__}'
    for command in COMMANDS:
        result = _run(*launchers[-1], command, '--help')
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(f'usage: timm-affinediv {command} ')
        assert '(default: ' in result.stdout and f'examples:\n    timm-affinediv {command}' in result.stdout, result.stdout
    unknown = _run(*launchers[-1], 'no-such-command')
    assert unknown.returncode == 2 and 'invalid choice' in unknown.stderr

"""The package as a user installs it: the templates, license and commands ship, and under CI the tests import the
installed package, not the checkout."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import timm_affinediv
from timm_affinediv.commands import COMMANDS, main
from timm_affinediv.hub import model_card_template

CHECKOUT = Path(__file__).resolve().parents[1]
# CI, and `make test` everywhere, run the tests against the installed wheel
WHEEL_RUN = bool(os.environ.get('CI') or os.environ.get('TIMM_AFFINEDIV_WHEEL_TEST'))


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=Path(sys.executable).parent)


@pytest.mark.skipif(not WHEEL_RUN,
                    reason='make test and CI run the tests against the installed wheel; a checkout may not')
def test_ci_imports_the_installed_package_not_the_checkout():
    package = Path(timm_affinediv.__file__).resolve()
    assert not package.is_relative_to(CHECKOUT / 'timm_affinediv'), \
        f'{package} is the checkout: install the wheel (make test)'
    dist = importlib.metadata.distribution('timm-affinediv')
    assert dist.version == timm_affinediv.__version__
    assert not dist.read_text('direct_url.json') or '"editable": true' not in dist.read_text('direct_url.json')
    assert any(f.name == 'LICENSE' for f in dist.files), 'the wheel ships no LICENSE'
    assert (Path(sys.executable).parent / 'timm-affinediv').is_file(), 'the console command is not installed'


def test_model_card_template_ships_with_the_package_and_is_the_checkouts():
    template = model_card_template()
    assert '$model_name' in template and '$model_args' in template
    assert template == (CHECKOUT / 'model_cards' / 'patchnorm.md').read_text(encoding='utf-8')


def test_version_from_outside_the_checkout():
    """`python -m timm_affinediv` (and, in a wheel run, the installed `timm-affinediv`) names the version, run from a
    directory outside the checkout."""
    launchers = [[sys.executable, '-m', 'timm_affinediv']]
    if WHEEL_RUN:
        launchers.append([str(Path(sys.executable).parent / 'timm-affinediv')])
    for launcher in launchers:
        version = _run(*launcher, '--version')
        assert version.returncode == 0, version.stderr
        assert version.stdout.strip() == f'timm-affinediv {timm_affinediv.__version__}'


def test_unknown_command_is_refused(capsys):
    with pytest.raises(SystemExit) as exit:
        main(['no-such-command'])
    assert exit.value.code == 2 and "invalid choice: 'no-such-command'" in capsys.readouterr().err


@pytest.mark.parametrize('command', COMMANDS)
def test_help_of_every_command_names_defaults_and_an_example(command, capsys):
    with pytest.raises(SystemExit) as exit:
        main([command, '--help'])
    assert exit.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f'usage: timm-affinediv {command} ')
    assert '(default: ' in text and '\nexamples:\n' in text and f'    timm-affinediv {command} ' in text, text


def test_a_report_without_its_options_still_describes_itself():
    """`ConversionReport.options` may be None (a report built by hand, or read from an older one): the description
    leaves out the thresholds it would have named."""
    from timm_affinediv.convert import ConversionReport
    from timm_affinediv.convert.distill import Agreement
    report = ConversionReport('resnet18', 'patchnorm', calibration_batches=1, calibration_images=8, seconds=1.0,
                              agreement_fitted=Agreement(top1=0.9, kl=0.01))
    assert report.describe() == ('0 divergence-corrected layers fitted by ridge least squares; top-1 agreement with '
                                 'the original on the 8 calibration images (no held-out images given) 90.0% '
                                 '(mean KL 0.0100) after the fit')

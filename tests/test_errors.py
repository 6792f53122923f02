"""One error base for the package, its one-line report on the command line, the timm version check, atomic writes."""
import os
import re
import subprocess
import sys

import pytest
import timm
import torch

import timm_affinediv  # noqa: F401
from timm_affinediv import _timm_compat
from timm_affinediv.cli import USER_ERRORS, run_main
from timm_affinediv.errors import (
    AffineDivError,
    BindingError,
    CheckpointError,
    ConfigError,
    ConversionError,
    DataError,
    DeviceError,
    ExportError,
    HubError,
    KernelError,
    MissingFileError,
    NonFiniteLossError,
    OptionError,
    OutputExistsError,
    RegistrationError,
    ShapeError,
    SlotLayoutError,
    TimmVersionError,
    TrainingError,
    UnsupportedTypeError,
)
from timm_affinediv.files import atomic_dir, atomic_write
from timm_affinediv.model_io import load_trained_model


@pytest.mark.parametrize('error, builtin', [
    (ConversionError, ValueError), (SlotLayoutError, ValueError), (DataError, RuntimeError),
    (TrainingError, RuntimeError), (ConfigError, ValueError), (CheckpointError, RuntimeError),
    (NonFiniteLossError, RuntimeError), (HubError, RuntimeError), (ExportError, RuntimeError),
    (MissingFileError, FileNotFoundError), (TimmVersionError, ImportError), (DeviceError, ValueError),
    (KernelError, RuntimeError), (OptionError, ValueError), (ShapeError, ValueError),
    (UnsupportedTypeError, TypeError), (OutputExistsError, FileExistsError), (BindingError, RuntimeError),
    (RegistrationError, RuntimeError)])
def test_every_error_is_an_affinediv_error_and_keeps_its_builtin(error, builtin):
    assert issubclass(error, AffineDivError) and issubclass(error, builtin)
    assert issubclass(error, USER_ERRORS)


def test_old_import_locations_are_the_same_classes():
    from timm_affinediv.convert import ConversionError as convert_error
    from timm_affinediv.data import DataError as data_error
    from timm_affinediv.export import ExportError as export_error
    from timm_affinediv.hub import HubError as hub_error
    from timm_affinediv.layers.binding import SlotLayoutError as slot_error
    from timm_affinediv.layers.kernels import KernelError as kernel_error
    from timm_affinediv.train import CheckpointError as checkpoint_error
    from timm_affinediv.train import TrainingError as training_error
    assert (convert_error, data_error, export_error, hub_error, kernel_error, slot_error, checkpoint_error,
            training_error) == (ConversionError, DataError, ExportError, HubError, KernelError, SlotLayoutError,
                                CheckpointError, TrainingError)


def _failing(error):
    def main(argv):
        raise error
    return main


def test_run_main_reports_any_package_error_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv('TIMM_AFFINEDIV_DEBUG', raising=False)
    for error in (ExportError('the export differs\nfrom eager'), HubError('no token'), MissingFileError('gone')):
        assert run_main(_failing(error), [], prog='cmd') == 2
        err = capsys.readouterr().err
        assert err == f"cmd: error: {' '.join(str(error).split())}\n"
    with pytest.raises(KeyError):  # a bug is not a user error: its traceback shows
        run_main(_failing(KeyError('bug')), [], prog='cmd')


def test_debug_env_shows_the_traceback(monkeypatch):
    monkeypatch.setenv('TIMM_AFFINEDIV_DEBUG', '1')
    with pytest.raises(ConversionError, match='cannot convert'):
        run_main(_failing(ConversionError('cannot convert')), [], prog='cmd')
    proc = subprocess.run([sys.executable, '-m', 'timm_affinediv', 'export', '--model', 'resnet18', '--checkpoint',
                           'missing.pth', '--output', 'out.onnx'], capture_output=True, text=True, timeout=120,
                          env={**__import__('os').environ, 'TIMM_AFFINEDIV_DEBUG': '1'})
    assert proc.returncode == 1 and 'Traceback' in proc.stderr and 'MissingFileError' in proc.stderr


def test_missing_checkpoint_is_a_missing_file_not_a_conversion_error(tmp_path):
    with pytest.raises(MissingFileError, match='not found') as info:
        load_trained_model('resnet18', str(tmp_path / 'absent.pth'))
    assert isinstance(info.value, FileNotFoundError) and not isinstance(info.value, ConversionError)
    (tmp_path / 'junk.pth').write_bytes(b'not a checkpoint')
    with pytest.raises(CheckpointError):
        load_trained_model('resnet18', str(tmp_path / 'junk.pth'))


@pytest.mark.parametrize('version, ok', [
    ('1.0.31', True), ('1.0.40', True), ('1.0.99.dev0', True), ('1.0.30', False), ('1.1.0', False),
    ('1.1.0.dev0', False), ('0.9.16', False), ('2.0.0', False)])
def test_untested_timm_is_refused_with_the_tested_range(version, ok, monkeypatch):
    monkeypatch.delenv(_timm_compat.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(timm, '__version__', version)
    if ok:
        _timm_compat.check_timm_version()
        return
    with pytest.raises(TimmVersionError, match=rf'timm {version} is not supported.*timm>=1\.0\.31,<1\.1'):
        _timm_compat.check_timm_version()
    monkeypatch.setenv(_timm_compat.ALLOW_UNTESTED_ENV, '1')
    with pytest.warns(UserWarning, match='not supported'):
        _timm_compat.check_timm_version()


@pytest.mark.parametrize('version', ['1.0.29.dev0', '1.1.0'])
def test_an_untested_timm_is_refused_before_its_internals_are_imported(version, tmp_path):
    """A timm whose private modules differ (here: none at all) is refused by the version check, not by an import
    error: one line, exit status 2 from the command."""
    fake = tmp_path / 'timm'
    fake.mkdir()
    (fake / '__init__.py').write_text(f'__version__ = {version!r}\n')
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(tmp_path), os.environ.get('PYTHONPATH', '')])}
    env.pop(_timm_compat.ALLOW_UNTESTED_ENV, None)
    imported = subprocess.run([sys.executable, '-c', 'import timm_affinediv'], capture_output=True, text=True,
                              env=env, timeout=120)
    assert imported.returncode == 1 and f'TimmVersionError: timm {version} is not supported' in imported.stderr
    assert 'ModuleNotFoundError' not in imported.stderr
    command = subprocess.run([sys.executable, '-m', 'timm_affinediv', '--version'], capture_output=True, text=True,
                             env=env, timeout=120)
    assert command.returncode == 2 and command.stdout == ''
    assert command.stderr.strip().splitlines() == [
        f'timm-affinediv: error: timm {version} is not supported by timm-affinediv, which reaches into timm '
        'internals tested only with timm>=1.0.31,<1.1: pip install "timm>=1.0.31,<1.1" '
        '(or set TIMM_AFFINEDIV_ALLOW_UNTESTED_TIMM=1 to try)']
    allowed = subprocess.run([sys.executable, '-c', 'import timm_affinediv'], capture_output=True, text=True,
                             env={**env, _timm_compat.ALLOW_UNTESTED_ENV: '1'}, timeout=120)
    # warned, then on at the user's risk: this stand-in timm has none of the internals the package uses
    assert f'UserWarning: timm {version} is not supported' in allowed.stderr
    assert 'ModuleNotFoundError' in allowed.stderr


def test_tested_range_is_the_declared_dependency():
    from importlib.metadata import requires
    timm_requirement = [r for r in requires('timm-affinediv') if r.startswith('timm')]
    low, high = _timm_compat.TESTED_TIMM
    assert timm_requirement == [f'timm<{high},>={low}'] or timm_requirement == [f'timm>={low},<{high}']


def test_atomic_write_leaves_nothing_on_failure_and_replaces_whole(tmp_path):
    path = tmp_path / 'f.txt'
    atomic_write(path, 'first')
    atomic_write(path, b'second')
    assert path.read_text() == 'second'

    def half_written(tmp):
        open(tmp, 'w').write('half')
        raise OSError('disk full')
    with pytest.raises(OSError, match='disk full'):
        atomic_write(path, half_written)
    assert path.read_text() == 'second' and sorted(p.name for p in tmp_path.iterdir()) == ['f.txt']
    atomic_write(tmp_path / 'w.pt', lambda tmp: torch.save({'x': 1}, tmp))
    assert torch.load(tmp_path / 'w.pt') == {'x': 1}


def test_atomic_dir_replaces_a_folder_or_leaves_it(tmp_path):
    folder = tmp_path / 'out'
    with atomic_dir(folder) as tmp:
        (tmp / 'a').write_text('1')
    with pytest.raises(RuntimeError):
        with atomic_dir(folder) as tmp:
            (tmp / 'b').write_text('2')
            raise RuntimeError('interrupted')
    assert [p.name for p in folder.iterdir()] == ['a'] and [p.name for p in tmp_path.iterdir()] == ['out']
    with atomic_dir(folder) as tmp:
        (tmp / 'b').write_text('2')
    assert [p.name for p in folder.iterdir()] == ['b'] and [p.name for p in tmp_path.iterdir()] == ['out']


def test_a_checkpoint_that_does_not_fit_is_named_in_a_short_line(tmp_path):
    """The first few mismatched keys of each kind and how many more, not every key of the model."""
    from safetensors.torch import save_file
    small = timm.create_model('resnet18', num_classes=10, in_chans=1, channels=(8, 16, 32, 64), stem_width=8)
    weights = {k: v for k, v in small.state_dict().items() if not k.startswith('layer4.1.')}
    weights['extra.weight'] = torch.zeros(1)
    save_file(weights, str(tmp_path / 'small.safetensors'))
    with pytest.raises(CheckpointError) as info:
        load_trained_model('resnet18', str(tmp_path / 'small.safetensors'), num_classes=10, in_chans=1)
    message = str(info.value)
    assert '\n' not in message and len(message) < 900, message
    assert '12 missing keys (layer4.1.conv1.weight, layer4.1.bn1.weight, layer4.1.bn1.bias and 9 more)' in message
    assert re.search(r'\d+ unexpected \([^)]*extra\.weight', message), message
    assert 'layer1.0.conv1.weight: (8, 64, 3, 3) in the checkpoint, (64, 64, 3, 3) in the model' in message, message


def test_the_layers_and_kernels_report_bad_input_as_affinediv_errors(tmp_path):
    """Each raise site named by its error class, and that class still the builtin callers catch."""
    from torch.nn.utils.rnn import pack_sequence

    from timm_affinediv.files import refuse_existing_output
    from timm_affinediv.layers import AffineDivLSTM, PatchNorm2d, PatchNormConv2d, bind_patchnorm, divergence_corrected
    from timm_affinediv.layers.kernels import set_kernels
    with pytest.raises(OptionError, match="scale must be 'rms' or 'l2'"):
        PatchNormConv2d(3, 4, 3, scale='max')
    with pytest.raises(OptionError, match='padding_mode'):
        PatchNormConv2d(3, 4, 3, padding_mode='mirror')
    with pytest.raises(OptionError, match=r'set_kernels\(mode\) must be one of auto, triton, torch'):
        set_kernels('fast')
    with pytest.raises(ShapeError, match='3 input channels'):
        PatchNormConv2d(3, 4, 3)(torch.randn(1, 5, 8, 8))
    with pytest.raises(ShapeError, match='8 channels in dim 1'):
        PatchNorm2d(8)(torch.randn(2, 4, 3, 3))
    lstm = AffineDivLSTM(5, 3)
    with pytest.raises(ShapeError, match=r'\(N, L, 5\)'):
        lstm(torch.randn(2, 4, 6))
    with pytest.raises(UnsupportedTypeError, match='not PackedSequence'):
        lstm(pack_sequence([torch.randn(3, 5), torch.randn(2, 5)]))
    with pytest.raises(UnsupportedTypeError, match='no divergence-corrected form of ReLU'):
        divergence_corrected(torch.nn.ReLU())

    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = torch.nn.Conv2d(3, 4, 3), PatchNorm2d(4)

        def forward(self, x):
            return self.norm(self.conv(x)) if x.sum() > 0 else x
    with pytest.raises(BindingError, match='could not trace'):
        bind_patchnorm(DataDependent())
    (tmp_path / 'metrics.json').write_text('{}')
    with pytest.raises(OutputExistsError, match=r'holds earlier results \(metrics.json\)'):
        refuse_existing_output(tmp_path)


def test_a_scripted_layer_names_the_error_it_raises():
    """TorchScript compiles the layers' checks with their errors.py classes: the scripted error names the class."""
    from timm_affinediv.layers import PatchNormConv2d
    scripted = torch.jit.script(PatchNormConv2d(3, 4, 3, padding=1).eval())
    with pytest.raises(torch.jit.Error, match='ShapeError: PatchNormConv2d expects 3 input channels'):
        scripted(torch.randn(1, 5, 8, 8))

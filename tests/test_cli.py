"""Every command refuses bad input with one line and exit status 2, before any work, and overwrites nothing unless
told, case by case."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch.nn as nn

import timm_affinediv  # noqa: F401
from timm_affinediv import PatchNorm2d, bind_patchnorm
from timm_affinediv.cli import ArgumentParser, add_data_args
from timm_affinediv.commands import main
from timm_affinediv.layers.binding import SlotLayoutError


def _run(command: str, *argv: str, capsys) -> str:
    """Run `timm-affinediv COMMAND ARGV...` in this process; assert exit status 2 and one line on stderr; return it."""
    try:
        status = main([command, *argv])
    except SystemExit as e:  # argparse
        status = e.code
    captured = capsys.readouterr()
    assert status == 2, captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f'timm-affinediv {command}: error: '), lines
    return lines[0]


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob('*')) if p.is_file()}


@pytest.fixture
def finished_run(tmp_path) -> Path:
    """A folder with what a finished run leaves, and a file of the user's."""
    run = tmp_path / 'run'
    (run / 'model').mkdir(parents=True)
    (run / 'checkpoints').mkdir()
    for name in ('model.safetensors', 'metrics.csv', 'model/README.md', 'checkpoints/last.json', 'notes.txt'):
        (run / name).write_text(f'earlier {name}')
    return run


@pytest.mark.parametrize('argv, message', [
    (('--calib-batches', '-1'), 'argument --calib-batches: -1 is not an integer >= 0'),
    (('--data-dir', 'no/such/folder'), 'argument --data-dir: no/such/folder does not exist'),
    (('--calib-memory', '0'), 'argument --calib-memory: 0 is not a number > 0'),
    (('--model', 'local-dir:no/such/folder'), 'argument --model: no/such/folder does not exist'),
    (('--model', 'resnet18', '--checkpoint', 'missing.safetensors'),
     'argument --checkpoint: missing.safetensors does not exist'),
])
def test_convert_bad_arguments(argv, message, tmp_path, capsys):
    line = _run('convert', *argv, '--output', str(tmp_path / 'out'), capsys=capsys)
    assert message in line and not (tmp_path / 'out').exists()


def test_convert_refuses_existing_output_before_loading(finished_run, capsys):
    before = _snapshot(finished_run)
    line = _run('convert', '--model', 'resnet18', '--checkpoint', str(finished_run / 'model.safetensors'),
                '--output', str(finished_run), capsys=capsys)
    assert 'holds earlier results' in line and '--overwrite' in line
    assert _snapshot(finished_run) == before


@pytest.mark.parametrize('argv, message', [
    (('--train-subset', '-1'), 'argument --train-subset: -1 is not a positive integer'),
    (('--train-subset', '0'), 'argument --train-subset: 0 is not a positive integer'),
    (('--norm-layer', 'foonorm'), "argument --norm-layer: unknown norm layer 'foonorm'; choose one of"),
    (('--epochs', '0'), 'argument --epochs: 0 is not a positive integer'),
    (('--model', 'resnet-18'), "argument --model: unknown timm model 'resnet-18'"),
    (('--resume', 'no/such/run'), 'argument --resume: no/such/run does not exist'),
])
def test_finetune_bad_arguments(argv, message, tmp_path, capsys):
    line = _run('finetune', *argv, '--output', str(tmp_path / 'out'), capsys=capsys)
    assert message in line and not (tmp_path / 'out').exists()


def test_finetune_keeps_a_finished_run(finished_run, capsys):
    before = _snapshot(finished_run)
    line = _run('finetune', '--output', str(finished_run), capsys=capsys)
    assert f'{finished_run} holds earlier results' in line and '--overwrite' in line and '--resume' in line
    assert _snapshot(finished_run) == before


@pytest.mark.parametrize('argv, message', [
    (('--model', 'resnet18', '--norm', 'foonorm'), "argument --norm: unknown norm layer 'foonorm'"),
    (('--model', 'resnet18', '--checkpoint', 'no/such.safetensors'),
     'argument --checkpoint: no/such.safetensors does not exist'),
    (('--model', 'resnet18', '--samples', '0'), 'argument --samples: 0 is not a positive integer'),
])
def test_divergence_report_bad_arguments(argv, message, capsys):
    assert message in _run('report', *argv, capsys=capsys)


def test_divergence_report_keeps_an_earlier_report(tmp_path, capsys):
    (tmp_path / 'report.md').write_text('earlier')
    line = _run('report', '--model', 'resnet18', '--dataset', 'random', '--output', str(tmp_path),
                capsys=capsys)
    assert 'holds earlier results (report.md)' in line
    assert _snapshot(tmp_path) == {Path('report.md'): b'earlier'}


def test_old_data_flags_still_work_with_one_deprecation_line_each(tmp_path, capsys):
    """--data/--data-root (report, experiments) and --calib-data (convert) are the earlier names of --dataset and
    --data-dir: accepted, hidden from --help, one warning line each."""
    (tmp_path / 'report.md').write_text('earlier')
    status = main(['report', '--model', 'resnet18', '--data', 'random', '--data-root', str(tmp_path),
                   '--output', str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and lines == [
        'timm-affinediv report: warning: --data is deprecated and goes in the next version; use --dataset random',
        'timm-affinediv report: warning: --data-root is deprecated and goes in the next version; use --data-dir',
        f'timm-affinediv report: error: {tmp_path} holds earlier results (report.md); pass --overwrite to replace '
        'them, or choose another --output.'], lines

    parser = ArgumentParser(prog='p')
    add_data_args(parser, old_source_flags=('--calib-data',), old_dir_flags=('--data-root',))
    args = parser.parse_args(['--calib-data', str(tmp_path)])  # a folder: an image folder dataset
    assert (args.dataset, args.data_dir) == ('', str(tmp_path))
    args = parser.parse_args(['--calib-data', 'fashion-mnist', '--data-root', str(tmp_path)])
    assert (args.dataset, args.data_dir) == ('fashion-mnist', str(tmp_path))
    assert parser.parse_args([]).dataset == 'fashion-mnist'
    assert capsys.readouterr().err.count('deprecated') == 3
    assert '--calib-data' not in parser.format_help() and '--data-dir' in parser.format_help()


def test_pipeline_and_experiments_keep_earlier_results(finished_run, tmp_path, capsys, run_script):
    before = _snapshot(finished_run)
    assert 'holds earlier results' in _run('pipeline', '--output', str(finished_run), capsys=capsys)
    assert _snapshot(finished_run) == before
    (tmp_path / 'mlp.json').write_text('{}')
    proc = run_script('experiments', '--only', 'mlp', '--quick', '--output', str(tmp_path))
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr
    assert 'holds earlier results (mlp.json)' in proc.stderr.strip()
    assert (tmp_path / 'mlp.json').read_text() == '{}'
    assert 'argument --train-subset: -5' in _run('pipeline', '--train-subset', '-5', capsys=capsys)


def test_push_to_hub_points_a_run_folder_at_its_model_folder(tmp_path, capsys):
    run = tmp_path / 'run'
    (run / 'model').mkdir(parents=True)
    for name in ('config.json', 'model.safetensors', 'README.md'):
        (run / 'model' / name).write_text('x')
    (run / 'checkpoints' / 'epoch-0000').mkdir(parents=True)
    (run / 'checkpoints' / 'epoch-0000' / 'train_state.pt').write_bytes(b'pickle')
    line = _run('push', str(run), '--repo-id', 'org/name', '--dry-run', capsys=capsys)
    assert f'{run} is not a Hub model folder' in line and f'Push its Hub folder {run / "model"} instead' in line


def test_scripts_answer_bad_input_in_one_line_without_traceback(tmp_path):
    """The real entry points: argument errors and user errors raised deep in the work, offline Hub included."""
    env = dict(os.environ, HF_HUB_OFFLINE='1', HF_HOME=str(tmp_path / 'hf'))
    for script, *argv, message in [
            ('convert', '--model', 'hf-hub:org/not-here', '--output', str(tmp_path / 'c'), 'hf-hub:org/not-here'),
            ('finetune', '--train-subset', '-1', '--train-subset'),
            ('report', '--model', 'resnet18', '--norm', 'foonorm', "'foonorm'")]:
        proc = subprocess.run([sys.executable, '-m', 'timm_affinediv', script, *argv], env=env, capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and 'Traceback' not in proc.stderr, (script, proc.stderr)
        assert len(lines) == 1 and 'error' in lines[0] and message in lines[0], (script, lines)


def test_patchnorm_slot_with_its_channels_elsewhere_is_refused_clearly():
    """A slot whose input holds its channels neither in dim 1 nor in the last dim cannot be bound or normalise."""
    class MiddleChannels(nn.Module):
        pretrained_cfg = dict(input_size=(3, 8, 8))

        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(3, 5, 1), PatchNorm2d(5)

        def forward(self, x):
            return self.norm(self.conv(x).permute(0, 2, 1, 3))  # (N, H, C, W)
    with pytest.raises(SlotLayoutError, match=r"shape \(2, 8, 5, 8\), with its 5 channels neither in dim 1"):
        bind_patchnorm(MiddleChannels())


def test_convert_to_folder_refuses_negative_sizes(tmp_path):
    """The library call behind convert.py: a negative count must not turn into 'all but the last N images'."""
    from timm_affinediv.convert import ConversionError
    from timm_affinediv.model_io import convert_to_folder
    with pytest.raises(ConversionError, match='calib_batches must be >= 0'):
        convert_to_folder(timm.create_model('test_resnet'), str(tmp_path / 'out'), calib_batches=-1)
    assert not (tmp_path / 'out').exists()


def test_bench_convert_prints_paired_ratios(run_script):
    """The conversion benchmark's table: forward pass, conversion and their ratio, from paired rounds."""
    proc = run_script('bench_convert', '--models', 'resnet18', '--settings', 'fashion-mnist-32', '--batches', '1', '1',
                      '--batch-size', '2', '2', '--reps', '2', '--device', 'cpu')
    assert proc.returncode == 0, proc.stderr
    row = [line for line in proc.stdout.splitlines() if line.startswith('| resnet18 |')]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip('|').split('|')]
    forward, seconds, ratio = float(cells[3]), float(cells[4]), float(cells[5])
    assert forward > 0 and seconds > forward and ratio > 1
    low, high = (float(v) for v in cells[6].split(' to '))
    assert low <= ratio <= high

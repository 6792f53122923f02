"""Evidence tooling: the divergence report (measured factors, table, plots) and the experiments' quick mode."""
import importlib
import importlib.util
import json
import os
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm'
from timm_affinediv import AffineDivLinear, PatchNormConv2d
from timm_affinediv.diagnostics import divergence_report, format_report
from timm_affinediv.experiments import (
    BATCH_VARIANTS, CONV_VARIANTS, MLP_VARIANTS, QUICK, Splits, mlp_model, train_run)

FASHION_MNIST = '/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz'
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


@pytest.fixture(autouse=True)
def one_thread():
    """One CPU thread, as the experiments run: small ops, and a machine shared with others."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _script(name: str):
    """The module of the command `timm-affinediv <name>`."""
    return importlib.import_module(f'timm_affinediv.commands.{name}')


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def _resnet18_report(norm: str):
    torch.manual_seed(0)
    model = timm.create_model('resnet18', norm_layer=norm, in_chans=1, num_classes=10)
    batch = torch.randn(16, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    return model, divergence_report(model, batch, samples=2, positions_per_sample=2, batch_stats=True)


def test_batchnorm_resnet_shows_a_spread_and_patchnorm_a_single_factor():
    bn_model, bn = _resnet18_report('batchnorm')
    pn_model, pn = _resnet18_report('patchnorm')
    convs = [n for n, m in bn_model.named_modules() if isinstance(m, nn.Conv2d)]
    assert [s.name for s in bn] == convs + ['fc'] == [s.name for s in pn]
    for s in bn + pn:
        assert s.factors.numel() in (2, 4)  # 2 samples x 2 positions, 1 position at 1x1 (layer4, fc)
        assert s.closed_form_error < 1e-9, s.as_dict()
    # plain layers: each sample and position gets its own factor
    assert not any(s.corrected for s in bn)
    assert all(s.spread > 1 + 1e-6 for s in bn), [(s.name, s.spread) for s in bn]
    assert sorted(s.spread for s in bn)[len(bn) // 2] > 1.5
    # patchnorm: every conv is corrected and has one factor, its constant c
    modules = dict(pn_model.named_modules())
    corrected = [s for s in pn if s.corrected]
    assert [s.name for s in corrected] == convs
    for s in corrected:
        assert isinstance(modules[s.name], PatchNormConv2d)
        assert s.spread == pytest.approx(1, abs=1e-9)
        assert s.median == pytest.approx(modules[s.name].divergence_constant, rel=1e-9)


def test_report_is_exact_for_any_geometry_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, padding_mode='reflect'),
        nn.BatchNorm2d(6),
        PatchNormConv2d(6, 6, (3, 1), padding='same', groups=3, bias=False),
        nn.Flatten(2), nn.Linear(16, 5),  # a linear over the last dim of a (N, C, L) tensor
        nn.Flatten(), AffineDivLinear(30, 3),
    )
    state = {k: v.clone() for k, v in model.state_dict().items()}
    report = divergence_report(model, torch.randn(5, 4, 8, 8), samples=4, positions_per_sample=3)
    assert [s.layer_type for s in report] == ['Conv2d', 'PatchNormConv2d', 'Linear', 'AffineDivLinear']
    assert [s.factors.numel() for s in report] == [4 * 3 * 2, 4 * 3 * 3, 4 * 3, 4]
    assert all(s.closed_form_error < 1e-9 for s in report), [s.as_dict() for s in report]
    assert report[0].spread > 1 and report[2].spread > 1
    assert report[1].spread == pytest.approx(1, abs=1e-9)
    assert report[1].median == pytest.approx(6 // 3 * 3, rel=1e-9)  # no bias: c = fan-in
    assert report[3].median == pytest.approx(31, rel=1e-9)
    assert model.training and all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert format_report(report).count('\n') == len(report) + 1


def test_report_refuses_bad_input():
    with pytest.raises(ValueError, match='no nn.Linear/nn.Conv2d'):
        divergence_report(nn.ReLU(), torch.randn(2, 3))
    with pytest.raises(ValueError, match='>= 1'):
        divergence_report(nn.Linear(3, 2), torch.randn(2, 3), samples=0)


def test_divergence_report_script_writes_table_json_and_a_png_per_layer(tmp_path, capsys):
    script = _script('report')
    assert script.main(['--model', 'resnet10t', '--norm', 'patchnorm', '--data', 'random', '--batch-size', '4',
                        '--samples', '2', '--positions', '1', '--output', str(tmp_path)]) == 0
    record = json.loads((tmp_path / 'report.json').read_text())
    layers = record['layers']
    assert len(layers) == 15 and record['norm'] == 'patchnorm'  # 3 stem convs, 4 blocks x 2, 3 downsamples, fc
    table = (tmp_path / 'report.md').read_text()
    assert table.count('\n') == len(layers) + 2 and table in capsys.readouterr().out
    pngs = sorted((tmp_path / 'layers').glob('*.png'))
    assert len(pngs) == len(layers) + 1 and all(_is_png(p) for p in pngs)
    assert all(l['spread'] == pytest.approx(1, abs=1e-9) for l in layers if l['corrected'])


def _synthetic_splits(n: int = 64) -> Splits:
    g = torch.Generator().manual_seed(0)
    images, targets = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return Splits((images, targets), (images[:16], targets[:16]), (images[:16], targets[:16]))


def test_a_run_is_determined_by_its_seed():
    data = _synthetic_splits()
    runs = [train_run('t', 'affinediv', mlp_model, data, 0.05, 16, 2, seed) for seed in (3, 3, 4)]
    assert runs[0].train_loss == runs[1].train_loss and runs[0].test_acc == runs[1].test_acc
    assert runs[0].train_loss != runs[2].train_loss
    assert not runs[0].diverged and runs[0].wall_s > 0


def test_a_diverging_run_is_marked():
    run = train_run('t', 'linear', mlp_model, _synthetic_splits(), 1e6, 16, 1, 0)
    assert run.diverged


@pytest.mark.skipif(not os.path.exists(FASHION_MNIST), reason='needs Debian dataset-fashion-mnist')
@pytest.mark.skipif(importlib.util.find_spec('timm_affinediv.data') is None, reason='needs timm_affinediv.data')
def test_quick_experiments_write_tables_plots_and_records(tmp_path):
    assert _script('experiments').main(['--quick', '--seed', '1', '--output', str(tmp_path)]) == 0
    for experiment, variants in (('mlp', MLP_VARIANTS), ('conv', CONV_VARIANTS), ('batch', BATCH_VARIANTS)):
        config = QUICK[experiment]
        record = json.loads((tmp_path / f'{experiment}.json').read_text())
        rows = record['rows']
        assert [(r['variant'], r['batch_size']) for r in rows] == [
            (v, b) for v in variants for b in config.batch_sizes]
        for r in rows:
            assert r['seeds'] == config.seeds and r['lr'] in config.lrs
            assert 0 <= r['test_mean'] <= 100 and r['test_std'] >= 0 and r['wall_s_per_run'] > 0
            assert set(r['sweep_val']) == {f'{lr:g}' for lr in config.lrs}
        expected_runs = len(rows) * (len(config.lrs) + config.seeds - 1)
        assert len(record['runs']) == expected_runs and {r['seed'] for r in record['runs']} == {1, 2}
        table = (tmp_path / f'{experiment}.md').read_text()
        assert sum(line.startswith('| ') for line in table.splitlines()) == len(rows) + 1
        assert _is_png(tmp_path / f'{experiment}.png')

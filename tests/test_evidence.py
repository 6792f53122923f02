"""Evidence tooling: the divergence report (measured factors, table, plots) and the experiments' quick mode."""
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import timm
import torch
import torch.nn as nn

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm'
from timm_affinediv import AffineDivLinear, L2NormLinear, PatchNormConv2d
from timm_affinediv.diagnostics import divergence_report, format_report
from timm_affinediv.errors import MissingFileError

sys.path.insert(0, str(Path(__file__).parents[1] / 'scripts'))  # the paper experiments: scripts/paper
from paper import (  # noqa: E402
    CONV_MODELS,
    MLP_VARIANTS,
    QUICK,
    RECIPES,
    Config,
    Splits,
    mlp_model,
    run_experiment,
    settings,
    slope_interval,
    t_quantile,
    train_run,
)
from paper.analysis import difference_interval, seed_pair_noise  # noqa: E402

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
    assert script.main(['--model', 'resnet10t', '--norm', 'patchnorm', '--dataset', 'random', '--batch-size', '4',
                        '--in-chans', '1', '--img-size', '32', '--samples', '2', '--positions', '1',
                        '--output', str(tmp_path)]) == 0
    record = json.loads((tmp_path / 'report.json').read_text())
    layers = record['layers']
    assert len(layers) == 15 and record['norm'] == 'patchnorm'  # 3 stem convs, 4 blocks x 2, 3 downsamples, fc
    table = (tmp_path / 'report.md').read_text()
    out = capsys.readouterr().out
    assert table.count('\n') == len(layers) + 2 and table in out
    # on the CPU every corrected layer takes torch's operations, and the report says so
    assert set(record['kernels'].values()) == {'torch'} and len(record['kernels']) == 14
    assert 'kernels: 14 layers on the torch path (cpu); on a CUDA GPU: ' in out
    pngs = sorted((tmp_path / 'layers').glob('*.png'))
    assert len(pngs) == len(layers) + 1 and all(_is_png(p) for p in pngs)
    assert all(layer['spread'] == pytest.approx(1, abs=1e-9) for layer in layers if layer['corrected'])


def _report_status(argv: list) -> int:
    """The exit status of `timm-affinediv report ARGV...`, argument errors included."""
    from timm_affinediv.commands import main
    try:
        return main(['report', *argv])
    except SystemExit as e:  # argparse's checks of the arguments
        return e.code


def test_divergence_report_script_measures_given_weights_or_refuses(tmp_path, capsys):
    model = timm.create_model('resnet10t', num_classes=5)
    torch.save(model.state_dict(), tmp_path / 'weights.pth')
    argv = ['--model', 'resnet10t', '--num-classes', '5', '--dataset', 'random', '--img-size', '40',
            '--batch-size', '2', '--samples', '1', '--positions', '1', '--output', str(tmp_path / 'out')]
    assert _report_status(argv + ['--checkpoint', str(tmp_path / 'weights.pth')]) == 0
    record = json.loads((tmp_path / 'out' / 'report.json').read_text())
    assert record['weights'] == 'trained weights' and record['input_shape'] == [3, 40, 40]
    # weights that do not fit, or are not there: an error, never a random model measured instead
    other_head = argv[:2] + ['--num-classes', '7'] + argv[4:]
    assert _report_status(other_head + ['--checkpoint', str(tmp_path / 'weights.pth')]) == 2
    assert _report_status(argv + ['--checkpoint', str(tmp_path / 'absent.pth')]) == 2
    assert _report_status(['--model', f'local-dir:{tmp_path / "absent"}', '--dataset', 'random']) == 2
    assert capsys.readouterr().err.count('error:') == 3


def _synthetic_splits(n: int = 64) -> Splits:
    g = torch.Generator().manual_seed(0)
    images, targets = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return Splits((images, targets), (images[:16], targets[:16]), (images[:16], targets[:16]))


def test_a_run_is_determined_by_its_seed():
    data = _synthetic_splits()
    build = functools.partial(mlp_model, 'affinediv', 32, 2, 'tanh')
    runs = [train_run(build, data, 0.05, 16, seed, epochs=2) for seed in (3, 3, 4)]
    assert runs[0].train_loss == runs[1].train_loss and runs[0].test_acc == runs[1].test_acc
    assert runs[0].train_loss != runs[2].train_loss
    assert not runs[0].diverged and runs[0].wall_s > 0 and runs[0].steps == 2 * (64 // 16)


def test_fixed_updates_take_that_many_steps_at_any_batch_size():
    data = _synthetic_splits()
    build = functools.partial(mlp_model, 'linear', 8, 1, 'tanh')
    assert [train_run(build, data, 0.01, b, 0, steps=7).steps for b in (8, 32, 64)] == [7, 7, 7]
    with pytest.raises(ValueError, match='epochs or steps'):
        train_run(build, data, 0.01, 8, 0)
    with pytest.raises(ValueError, match='exceeds'):
        train_run(build, data, 0.01, 128, 0, epochs=1)


def test_a_diverging_run_is_marked():
    run = train_run(functools.partial(mlp_model, 'linear'), _synthetic_splits(), 1e6, 16, 0, epochs=1)
    assert run.diverged


@pytest.mark.parametrize('variant', MLP_VARIANTS)
def test_ablation_variants_are_parameterless_but_for_their_affine_maps(variant):
    model = mlp_model(variant, width=16, depth=3, act='leaky_relu')
    affine = {'l2normlinear': L2NormLinear, 'affinediv': AffineDivLinear}.get(variant, nn.Linear)
    maps = [m for m in model if isinstance(m, nn.Linear)]
    assert len(maps) == 4 and all(type(m) is affine for m in maps)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for m in maps for p in m.parameters())
    assert sum(isinstance(m, nn.LeakyReLU) for m in model) == 3
    assert model(torch.randn(5, 1, 28, 28)).shape == (5, 10)
    with pytest.raises(ValueError, match='activation'):
        mlp_model(variant, act='gelu')


def test_slope_interval_is_a_t_interval_over_seeds():
    mean, half = slope_interval([1.0, 2.0, 3.0])
    assert mean == pytest.approx(2.0) and half == pytest.approx(4.303 / 3 ** 0.5, rel=1e-4)
    with pytest.raises(ValueError, match='at least 2 seeds'):
        slope_interval([1.0])


def test_difference_interval_is_welchs():
    diff, half = difference_interval([1.0, 2.0, 3.0], [0.0, 0.0, 3.0])
    # variances 1/3 and 3/3 of the means; Welch's degrees of freedom (4/3)^2 / ((1/9 + 1) / 2) = 3.2, rounded down
    assert diff == pytest.approx(1.0) and half == pytest.approx(3.182 * (4 / 3) ** 0.5, rel=1e-3)
    assert difference_interval([2.0], [1.0, 1.5]) == (pytest.approx(0.75), 0.0)


def test_seed_noise_counts_each_pair_of_seeds_of_a_trained_row_once():
    rows = [dict(test_mean=80.0, test_by_seed=[80.0, 81.0, 79.0]),
            dict(test_mean=80.0, test_by_seed=[80.0, 81.0, 79.0]),  # a repeat (DeiT's rows are ViT's runs)
            dict(test_mean=10.0, test_by_seed=[9.0, 11.0, 10.0])]  # did not train
    assert seed_pair_noise(rows) == dict(pairs=3, median=1.0, p25=1.0, p75=1.5)


def test_the_verdicts_seed_noise_is_no_looser_than_the_recorded_seed_pairs():
    """The convert-or-train-from-scratch verdict calls a difference under `SEED_NOISE` noise: two runs trained
    alike (the families record's seed pairs) must differ by at least that much at the median."""
    from measure_family_recovery import SEED_NOISE
    record = json.loads((Path(__file__).parents[1] / 'docs' / 'results' / 'families.json').read_text())
    noise = record['analysis']['seed_pairs']
    assert noise['pairs'] >= 100 and noise['p25'] <= SEED_NOISE <= noise['median'], noise


def test_t_quantile_matches_the_printed_table():
    """The closed-form Student t against a printed table (3 decimals), and near the normal limit."""
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
             20: 2.086, 30: 2.042}
    for df, value in table.items():
        assert t_quantile(0.975, df) == pytest.approx(value, abs=5e-4), df
    assert t_quantile(0.95, 4) == pytest.approx(2.132, abs=5e-4)
    assert t_quantile(0.975, 2000) == pytest.approx(1.96115, abs=1e-4)


TINY_MLP = Config(128, 32, 32, epochs=1, lrs=(0.1,), seeds=2, batch_sizes=(32,), widths=(8,), depths=(1,),
                  activations=('tanh',))


@pytest.mark.skipif(not os.path.exists(FASHION_MNIST), reason='needs Debian dataset-fashion-mnist')
def test_worker_processes_give_the_runs_of_one_process_and_a_rerun_resumes(tmp_path):
    one = run_experiment('mlp', str(tmp_path / 'one'), config=TINY_MLP, log=lambda line: None)
    lines = []
    two = run_experiment('mlp', str(tmp_path / 'two'), config=TINY_MLP, workers=2, log=lines.append)
    assert [r['test_by_seed'] for r in one] == [r['test_by_seed'] for r in two] and len(lines) == 12
    # a second run into the same folder trains nothing and writes the same tables
    table = (tmp_path / 'two' / 'mlp.md').read_text()
    (tmp_path / 'two' / 'mlp.md').unlink()
    lines.clear()
    again = run_experiment('mlp', str(tmp_path / 'two'), config=TINY_MLP, log=lines.append)
    assert again == two and lines == ['6 of 6 runs already recorded, skipped', '6 of 6 runs already recorded, skipped']
    assert (tmp_path / 'two' / 'mlp.md').read_text() == table
    with pytest.raises(ValueError, match='other data sizes'):
        run_experiment('mlp', str(tmp_path / 'two'), config=dataclasses.replace(TINY_MLP, n_val=16))


@pytest.mark.skipif(not os.path.exists(FASHION_MNIST), reason='needs Debian dataset-fashion-mnist')
def test_quick_experiments_write_tables_plots_and_records(tmp_path, run_script):
    proc = run_script('experiments', '--quick', '--seed', '1', '--output', str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for experiment in ('mlp', 'batch', 'conv'):  # one rate grid for every setting; families: below
        config = QUICK[experiment]
        record = json.loads((tmp_path / f'{experiment}.json').read_text())
        rows = record['rows']
        assert [(r['model'], r['variant'], r['batch_size'], r['width'], r['depth'], r['act'], r['epochs'],
                 r['steps']) for r in rows] == [
            (s.model, s.variant, s.batch_size, s.width, s.depth, s.act, s.epochs, s.steps)
            for s in settings(experiment, config)]
        for r in rows:
            assert r['seeds'] == config.seeds and r['lr'] in config.lrs and len(r['test_by_seed']) == config.seeds
            assert 0 <= r['test_mean'] <= 100 and r['test_std'] >= 0 and r['cpu_s_per_run'] > 0
            assert set(r['sweep_val']) == {f'{lr:g}' for lr in config.lrs}
        expected_runs = len(rows) * (len(config.lrs) + config.seeds - 1)
        assert len(record['runs']) == expected_runs and {r['seed'] for r in record['runs']} == {1, 2}
        assert len(list((tmp_path / 'runs' / experiment).glob('*.json'))) == expected_runs
        assert _is_png(tmp_path / f'{experiment}.png')
    mlp = json.loads((tmp_path / 'mlp.json').read_text())
    cells = len(QUICK['mlp'].widths) * len(QUICK['mlp'].depths) * len(QUICK['mlp'].activations)
    assert len(mlp['analysis']['cells']) == cells and all(
        sorted(c['ranking']) == sorted(MLP_VARIANTS) for c in mlp['analysis']['cells'])
    assert sum(mlp['analysis']['mean_rank'].values()) == pytest.approx(sum(range(1, len(MLP_VARIANTS) + 1)))
    table = (tmp_path / 'mlp.md').read_text()
    assert sum(line.startswith('| ') for line in table.splitlines()) == cells + 2  # header, cells, mean rank
    slopes = json.loads((tmp_path / 'batch.json').read_text())['analysis']['slopes']
    assert set(slopes) == {'epochs', 'updates'}
    for schedule in slopes.values():
        assert len(schedule['affinediv']['per_seed']) == QUICK['batch'].seeds and schedule['affinediv']['ci95'] >= 0
    conv = json.loads((tmp_path / 'conv.json').read_text())['rows']
    assert [(r['model'], r['variant']) for r in conv] == [(m, v) for m, vs in CONV_MODELS.items() for v in vs]
    _check_quick_families(tmp_path)


def _check_quick_families(out: Path) -> None:
    """The families protocol's steps: every norm of every family swept on its optimiser's rates, the grid grown past
    the edge its best rate was at, the seeds at the chosen rate, and the longer budget at that rate."""
    config = QUICK['families']
    record = json.loads((out / 'families.json').read_text())
    short = [r for r in record['rows'] if r['epochs'] == config.epochs]
    longer = [r for r in record['rows'] if r['epochs'] == config.epochs * config.long_factor]
    assert [(r['model'], r['variant']) for r in short] == [(s.model, s.variant) for s in settings('families', config)]
    assert [(r['model'], r['variant'], r['lr']) for r in longer] == [(r['model'], r['variant'], r['lr']) for r in short]
    for r in short:
        rates = [RECIPES[r['recipe']].lr * m for m in config.lrs]
        swept = sorted(float(lr) for lr in r['sweep_val'])
        assert len(swept) == len(rates) + config.edge_steps and r['lr'] in swept
        grown = [lr for lr in swept if not any(lr == pytest.approx(x) for x in rates)]
        assert grown == [pytest.approx(2 * max(rates))] or grown == [pytest.approx(min(rates) / 2)], swept
    long_seeds = dict(config.long_seeds)
    assert long_seeds and all(n > config.seeds for n in long_seeds.values())
    for r in longer:
        assert r['sweep_val'] == {} and not r['lr_at_grid_edge']
        assert r['seeds'] == long_seeds.get(r['model'], config.seeds)
    runs = len(short) * (len(config.lrs) + config.edge_steps + config.seeds - 1) + sum(r['seeds'] for r in longer)
    assert len(record['runs']) == runs == len(list((out / 'runs' / 'families').glob('*.json')))
    cells = record['analysis']['cells']
    assert len(cells) == len(record['rows']) // 2 and sum(record['analysis']['counts'].values()) == len(cells)
    means = {(r['model'], r['epochs'], r['variant']): r['test_mean'] for r in record['rows']}
    for c in cells:
        assert c['diff'] == pytest.approx(means[c['model'], c['epochs'], 'patchnorm']
                                          - means[c['model'], c['epochs'], 'native'])
        assert c['verdict'] in ('held', 'not held', 'within noise') and c['ci95'] >= 0
    spreads = record['analysis']['spreads']  # the native model's layers by kind
    assert set(spreads) == set(config.models) == {'mobilenetv3_small_050'}
    mobilenet = spreads['mobilenetv3_small_050']
    assert mobilenet['depthwise conv']['layers'] > 5 and mobilenet['dense conv']['layers'] > 5
    assert mobilenet['linear']['layers'] == 1
    assert all(v['median'] >= 1 for s in spreads.values() for v in s.values() if v['layers'])
    assert len(list((out / 'runs' / 'families' / 'spread').glob('*.json'))) == len(config.models)
    table = (out / 'families.md').read_text()
    # the verdicts' header and rows, then the spreads' header and rows
    assert sum(line.startswith('| ') for line in table.splitlines()) == len(cells) + 1 + len(spreads) + 1
    assert _is_png(out / 'families.png')
    # without workers nothing trains: the same tables, then without the setting whose record is gone
    lines = []
    assert run_experiment('families', str(out), seed=1, quick=True, workers=0, log=lines.append) == record['rows']
    assert (out / 'families.md').read_text() == table and not any('val ' in line for line in lines)
    lost = short[-1]
    for path in (out / 'runs' / 'families').glob(f"{lost['model']}-{lost['variant']}-bs*-ep{lost['epochs']}-*.json"):
        path.unlink()
        break
    rows = run_experiment('families', str(out), seed=1, quick=True, workers=0, log=lines.append)
    kept = {(r['model'], r['variant'], r['epochs']) for r in rows}
    assert (lost['model'], lost['variant'], lost['epochs']) not in kept
    assert len(rows) < len(record['rows']) and any('not recorded' in line for line in lines)
    with pytest.raises(MissingFileError, match='no setting of families whose runs are all recorded'):
        run_experiment('families', str(out / 'empty'), quick=True, workers=0, log=lines.append)

"""Recovery with labels after the conversion (`timm_affinediv.recover`, `convert --recover`): the budget and its
schedule, the stop rule, exact resume, the report and the card, the command line and the measurement script, on a
narrow ResNet-18 and a few hundred Fashion-MNIST images."""
import copy
import dataclasses
import json
import math
import os
import signal

import pytest
import timm
import torch
from conftest import SCRIPTS
from safetensors.torch import load_file, save_file

import timm_affinediv.recover as recover
from timm_affinediv import RecoverOptions, convert_model, recover_model
from timm_affinediv.commands import main as command
from timm_affinediv.data import FASHION_MNIST_DIR, create_eval_loader, resolve_dataset_data_config
from timm_affinediv.errors import OptionError
from timm_affinediv.train import TrainConfig, TrainingInterrupted

TINY = dict(channels=(16, 32, 64, 128), stem_width=16)

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_MNIST_DIR, 'train-images-idx3-ubyte.gz')),
    reason='Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)')


@pytest.fixture(scope='module')
def models():
    """A narrow BatchNorm ResNet-18 and its PatchNorm conversion on 64 training images."""
    torch.manual_seed(0)
    original = timm.create_model('resnet18', num_classes=10, in_chans=1, **TINY).eval()
    cfg = resolve_dataset_data_config('fashion-mnist', original, in_chans=1)
    batches = [x for x, _ in create_eval_loader('fashion-mnist', None, cfg, 32, split='train', subset=64, workers=0)]
    converted, _ = convert_model(original, calibration=batches)
    return original, converted


def run(models, output, **options):
    """`recover_model` on 256 training images (8 updates an epoch) and 128 held-out ones, batch 32."""
    original, converted = models
    train = TrainConfig(dataset='fashion-mnist', train_subset=256, val_subset=128, workers=0, progress=False,
                        output=str(output))
    settings = dict(batch_size=32, warmup=0., patience=None, keep_converted=False)
    return recover_model(copy.deepcopy(original), copy.deepcopy(converted), RecoverOptions(**{**settings, **options}),
                         train=train)


def test_half_an_epoch_runs_its_images_on_a_schedule_spanning_them_and_reports_them(models, tmp_path):
    """epochs=0.5 of 8 updates an epoch: 4 updates, 128 images, a cosine from the peak to 0 at the 4th update; the
    report (run folder and Hub folder) and the card give the three top-1s and the images."""
    _, report = run(models, tmp_path, epochs=0.5, evaluations=4, lr=1e-3)
    assert (report.images, report.budget_images, report.stopped, report.kept_images) == (128, 128, 'budget', 128)
    assert [p['images'] for p in report.curve] == [32, 64, 96, 128]
    assert [p['lr'] for p in report.curve] == pytest.approx([1e-3 * (1 + math.cos(math.pi * k / 4)) / 2
                                                             for k in range(1, 5)], abs=1e-12)
    assert report.recovered_top1 == report.curve[-1]['top1']
    saved = json.loads((tmp_path / 'recovery_report.json').read_text())
    assert saved == json.loads((tmp_path / 'model' / 'recovery_report.json').read_text()) == report.to_dict()
    assert saved['options']['epochs'] == 0.5
    card = (tmp_path / 'model' / 'README.md').read_text()
    for line in (f'| original | {report.original_top1:.2f} |',
                 f'| converted (no labels) | {report.converted_top1:.2f} |',
                 f'| recovered (128 training images) | {report.recovered_top1:.2f} |'):
        assert line in card
    assert ('after 128 of 128 training images at a peak rate of 0.001; stopped at the end of its budget'
            in ' '.join(card.split()))
    assert f'standard error of the recovered figure is {report.top1_se:.2f} points' in ' '.join(card.split())
    assert report.eval_images == 128 and report.lr_sweep == [] and report.sweep_images == 0


def test_target_stops_at_the_first_evaluation_that_reaches_it(models, tmp_path):
    _, report = run(models, tmp_path, epochs=0.5, evaluations=4, target_top1=0.5, lr=1e-3)
    assert (report.stopped, len(report.curve), report.images, report.kept_images) == ('target', 1, 32, 32)
    assert 'stopped on reaching the target top-1' in report.describe()


def test_plateau_stops_and_returns_the_best_evaluations_weights(models, tmp_path):
    """A learning rate too small to change a prediction: on top-1 without a noise margin, the second evaluation does
    not better the first, so the run stops there (patience 1) and returns the first one's weights."""
    model, report = run(models, tmp_path, epochs=0.5, evaluations=4, patience=1, lr=1e-12, metric='top1',
                        stop_noise=None)
    assert (report.stopped, len(report.curve), report.images, report.kept_images) == ('plateau', 2, 64, 32)
    assert report.recovered_top1 == report.curve[0]['top1'] == report.curve[1]['top1']
    best = load_file(str(tmp_path / 'checkpoints' / 'epoch-0000-000001' / 'model.safetensors'))
    assert all(torch.equal(v.cpu(), best[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(v, best[k]) for k, v in load_file(str(tmp_path / 'model' / 'model.safetensors')).items())


def _adding_after_each_update(delta: float):
    """The trainer, each update adding `delta` to every parameter after the optimiser's step."""

    class _AddingTrainer(recover.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            step = self.optimizer.step

            def step_then_add(*a, **k):
                result = step(*a, **k)
                with torch.no_grad():
                    for p in self.model.parameters():
                        p.add_(delta)
                return result
            self.optimizer.step = step_then_add
    return _AddingTrainer


#: weights that differ from the conversion's without a prediction changing
_NudgingTrainer = _adding_after_each_update(1e-6)
#: a trained model worse than the conversion
_SpoilingTrainer = _adding_after_each_update(0.3)


def test_a_recovery_that_betters_no_evaluation_returns_the_conversion(models, tmp_path, monkeypatch):
    """Updates that change no prediction, judged on top-1: the trained model is not above the converted model's
    held-out top-1 (a tie is not above), so its weights (not the trained ones) and top-1 are returned, written and
    published, and the report says so."""
    monkeypatch.setattr(recover, 'Trainer', _NudgingTrainer)
    model, report = run(models, tmp_path, epochs=0.5, evaluations=2, lr=1e-12, keep_converted=True, metric='top1')
    assert max(p['top1'] for p in report.curve) <= report.converted_top1
    trained = load_file(str(next((tmp_path / 'checkpoints').glob('*/model.safetensors'))))
    assert not all(torch.equal(v, models[1].state_dict()[k]) for k, v in trained.items())
    assert (report.stopped, report.kept_images, report.recovered_top1) == ('converted', 0, report.converted_top1)
    converted = models[1].state_dict()
    assert all(torch.equal(v.cpu(), converted[k]) for k, v in model.state_dict().items())
    for weights in (tmp_path / 'model.safetensors', tmp_path / 'model' / 'model.safetensors'):
        assert all(torch.equal(v, converted[k]) for k, v in load_file(str(weights)).items())
    assert 'with the converted model better on held-out top-1, which is kept' in report.describe()
    assert f'| recovered (128 training images) | {report.converted_top1:.2f} |' in (
        tmp_path / 'model' / 'README.md').read_text()


def test_judged_on_loss_a_worse_trained_model_returns_the_conversion(models, tmp_path, monkeypatch):
    monkeypatch.setattr(recover, 'Trainer', _SpoilingTrainer)
    model, report = run(models, tmp_path, epochs=0.25, evaluations=1, lr=1e-3, keep_converted=True)
    assert report.curve[-1]['loss'] > report.curve[-1]['loss_se'] > 0
    assert (report.stopped, report.kept_images, report.recovered_top1) == ('converted', 0, report.converted_top1)
    converted = models[1].state_dict()
    assert all(torch.equal(v.cpu(), converted[k]) for k, v in model.state_dict().items())
    assert 'with the converted model better on held-out loss, which is kept' in report.describe()


def test_the_sweep_picks_the_rate_with_the_lowest_held_out_loss_and_counts_its_images(models, tmp_path):
    """Two rates, each in a run of a quarter of the half-epoch budget (1 update of 32 images): the run goes on at
    the rate whose held-out loss was lower; the sweep's images are reported beside the run's and on the card; the
    record in the run folder has the rows."""
    _, report = run(models, tmp_path, epochs=0.5, evaluations=2, lr_sweep=(1e-12, 3e-3), sweep_share=0.5)
    rows = report.lr_sweep
    assert [r['lr'] for r in rows] == [1e-12, 3e-3] and [r['images'] for r in rows] == [32, 32]
    assert report.lr == min(rows, key=lambda r: r['loss'])['lr'] and rows[0]['loss'] != rows[1]['loss']
    assert max(p['lr'] for p in report.curve) == pytest.approx(report.lr)
    assert (report.images, report.sweep_images) == (128, 64)
    assert json.loads((tmp_path / recover.SWEEP_RECORD).read_text()) == rows
    assert '| recovered (192 training images) |' in (tmp_path / 'model' / 'README.md').read_text()
    assert 'chosen by 64 images of short runs at 1e-12, 0.003' in report.describe()


def test_plateau_with_a_noise_margin_needs_evaluations_worse_beyond_it():
    from timm_affinediv.train import plateau_reached
    flat = [0.50, 0.49, 0.495, 0.50]
    errors = [0.02] * 4
    assert plateau_reached(flat, errors, 2) and not plateau_reached(flat, errors, 2, noise=2.)
    rising = [0.50, 0.40, 0.50, 0.52]
    assert plateau_reached(rising, errors, 2, noise=2., lower_is_better=True)
    assert not plateau_reached(rising, errors, 3, noise=2., lower_is_better=True)
    assert not plateau_reached([0.50, 0.40, 0.44, 0.52], errors, 2, noise=2., lower_is_better=True)
    assert plateau_reached([80., 84., 80.], [1., 1., 1.], 1, noise=2.)
    assert not plateau_reached([80., 84., 82.], [1., 1., 1.], 1, noise=2.)


class _InterruptedTrainer(recover.Trainer):
    """The trainer, with SIGINT sent to this process after its 3rd optimiser update (as Ctrl-C would)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        step, count = self.optimizer.step, [0]

        def step_then_interrupt(*a, **k):
            result = step(*a, **k)
            count[0] += 1
            if count[0] == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return result
        self.optimizer.step = step_then_interrupt


class _SeeingTrainer(recover.Trainer):
    """The trainer, recording the training images the model and the teacher see at each update."""
    seen = {'model': [], 'teacher': []}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, module in (('model', self.model), ('teacher', self.teacher)):
            module.register_forward_pre_hook(lambda m, inputs, name=name: self.seen[name].append(inputs[0].clone())
                                             if m.training or name == 'teacher' else None)


def test_mixup_lever_shows_the_original_the_same_mixed_images(models, tmp_path, monkeypatch):
    """With mixup, each update's batch is a blend of two images per sample (soft labels), and the teacher is given
    exactly the batch the converted model trains on."""
    monkeypatch.setattr(recover, 'Trainer', _SeeingTrainer)
    _SeeingTrainer.seen = {'model': [], 'teacher': []}
    _, report = run(models, tmp_path, epochs=0.25, evaluations=1, mixup=0.4, lr=1e-3)
    seen = _SeeingTrainer.seen
    assert report.options['mixup'] == 0.4 and len(seen['model']) == 2
    assert all(torch.equal(a, b) for a, b in zip(seen['model'], seen['teacher'][-2:]))


def test_resume_after_an_interrupt_gives_the_uninterrupted_result(models, tmp_path, monkeypatch):
    """6 updates, evaluated after the 2nd, 4th and 6th; interrupted after the 3rd and resumed: the same weights, bit
    for bit, and the same report."""
    options = dict(epochs=0.75, evaluations=3)
    full_model, full = run(models, tmp_path / 'full', **options)
    with monkeypatch.context() as patch:
        patch.setattr(recover, 'Trainer', _InterruptedTrainer)
        with pytest.raises(TrainingInterrupted):
            run(models, tmp_path / 'cut', **options)
    assert not (tmp_path / 'cut' / 'model').exists()
    original, converted = models
    train = TrainConfig(dataset='fashion-mnist', train_subset=256, val_subset=128, workers=0, progress=False,
                        output=str(tmp_path / 'cut'), resume=str(tmp_path / 'cut'))
    resumed_model, resumed = recover_model(
        copy.deepcopy(original), copy.deepcopy(converted),
        RecoverOptions(batch_size=32, warmup=0., patience=None, **options), train=train)
    assert resumed.curve == full.curve and resumed.images == full.images == 192
    assert resumed.lr_sweep == full.lr_sweep and resumed.lr == full.lr and len(full.lr_sweep) == 3
    assert (resumed.original_top1, resumed.converted_top1) == (full.original_top1, full.converted_top1)
    full_weights = full_model.state_dict()
    assert all(torch.equal(v, full_weights[k]) for k, v in resumed_model.state_dict().items())


def test_options_refuse_values_that_cannot_work():
    from timm_affinediv.errors import AffineDivError
    for bad in (dict(epochs=0), dict(target_top1=101), dict(patience=0), dict(warmup=1.), dict(metric='top5'),
                dict(stop_noise=-1), dict(lr_sweep=()), dict(sweep_share=1.)):
        with pytest.raises(AffineDivError, match=next(iter(bad)).split('_')[0]):
            RecoverOptions(**bad).validate()


@pytest.fixture
def checkpoint(models, tmp_path):
    path = tmp_path / 'original.safetensors'
    save_file(models[0].state_dict(), str(path))
    return path


def _convert_args(checkpoint, output):
    return ['convert', '--model', 'resnet18', '--checkpoint', str(checkpoint), '--num-classes', '10', '--in-chans',
            '1', '--model-kwargs', 'channels=(16,32,64,128)', 'stem_width=16', '--calib-images', '64', '-b', '32',
            '--heldout-images', '0', '--distill-images', '0', '--eval-images', '64', '--device', 'cpu', '--output',
            str(output), '--recover', '--recover-epochs', '0.5', '--recover-train-images', '256',
            '--recover-val-images', '64', '--recover-batch-size', '32', '--recover-evaluations', '2', '--workers', '0']


def test_convert_recover_command_and_its_resume(checkpoint, tmp_path, capsys):
    """`convert --recover`: the conversion's folder, the run and the recovered Hub folder in --output; `--resume`
    reads the conversion back and finishes the run where it stands."""
    out = tmp_path / 'out'
    assert command(_convert_args(checkpoint, out)) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / 'recovery_report.json').read_text())
    assert (out / 'converted' / 'conversion_report.json').is_file() and (out / 'model' / 'config.json').is_file()
    assert report['images'] == 128 and [p['images'] for p in report['curve']] == [64, 128]
    assert report['options']['distill_weight'] == RecoverOptions.distill_weight
    assert f"recovered {report['recovered_top1']:.2f}% after 128 of 128 training images" in printed
    converted = (out / 'converted' / 'model.safetensors').read_bytes()
    assert command([*_convert_args(checkpoint, out), '--resume']) == 0
    assert json.loads((out / 'recovery_report.json').read_text())['curve'] == report['curve']
    assert (out / 'converted' / 'model.safetensors').read_bytes() == converted
    assert 'conversion_report.json beside the weights' not in capsys.readouterr().out


@pytest.mark.parametrize('argv, message', [
    (('--resume',), '--resume continues an interrupted recovery: add --recover'),
    (('--recover', '--resume'), 'holds no converted model'),
    (('--recover', '--recover-target', '150'), 'argument --recover-target: 150 is not a top-1 in %'),
    (('--recover', '--recover-epochs', '0'), 'argument --recover-epochs: 0 is not a number > 0'),
])
def test_convert_recover_bad_input_is_one_line(argv, message, tmp_path, capsys):
    try:
        status = command(['convert', '--model', 'resnet18', '--output', str(tmp_path / 'out'), *argv])
    except SystemExit as e:  # argparse
        status = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / 'out').exists()


def test_fractional_epochs_need_an_update_stepped_schedule(tmp_path):
    from timm_affinediv.train import ConfigError
    with pytest.raises(ConfigError, match='--sched-on-updates'):
        dataclasses.replace(TrainConfig(output=str(tmp_path)), epochs=0.5, sched_on_updates=False).validate()


def test_measurement_script_quick_appends_rows_and_skips_measured_ones(run_script, tmp_path):
    rows = tmp_path / 'rows.jsonl'
    args = ('--quick', '--output', str(tmp_path / 'runs'), '--json', str(rows))
    first = run_script('measure_family_recovery', *args, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    measured = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [(r['budget'], r['images']) for r in measured] == [(0.5, 64), (1.0, 128)]
    assert all(0 <= r[k] <= 100 for r in measured for k in ('original', 'converted', 'recovered', 'scratch',
                                                             'scratch_full'))
    again = run_script('measure_family_recovery', *args, timeout=300)
    assert again.returncode == 0 and '0 rows measured, 2 already in' in again.stderr, again.stderr[-3000:]
    assert len(rows.read_text().splitlines()) == 2


def test_originals_train_until_held_out_top1_stops_rising_then_decay_to_zero(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measure_family_conversion import Schedule, plateaued
    assert not plateaued([40., 60.])  # too early to tell
    assert not plateaued([60., 70., 70.7])  # 0.35 points an epoch over the last two
    assert plateaued([60., 70., 70.5, 70.1])  # the best rose 0.5 over two epochs
    assert plateaued([60., 70., 69., 69.5])  # no new best
    schedule = Schedule(warmup=4, decay_from=20, total=30)
    assert [schedule(s) for s in (0, 3, 4, 19)] == [0.25, 1., 1., 1.]
    assert schedule(25) == pytest.approx(0.5) and schedule(30) == pytest.approx(0.)
    assert all(schedule(s) >= schedule(s + 1) for s in range(4, 30))
    # from scratch on 3 of the original's updates in 10: each phase the same share of the run
    assert Schedule(warmup=4, decay_from=20, total=30).scaled(9) == Schedule(warmup=1, decay_from=6, total=9)


def test_recovery_images_are_priced_against_scratch_reaching_the_same_top1(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measure_family_recovery import scratch_share
    rows = [dict(budget=b, images=int(4000 * b), scratch=t, recovered=80., original_epochs=10, train_images=4000,
                 scratch_full=85.) for b, t in ((0.5, 60.), (1.0, 70.))]
    # 80 is 2/3 of the way from 70 (4000 images) to 85 (40000), in log images: 4000 x 10^(2/3) = 18566
    assert scratch_share(rows) == '22%'
    rows[-1]['recovered'] = 90.
    assert scratch_share(rows) == '< 10% (not reached)'
    rows[-1]['recovered'] = 65.  # scratch reaches it on 2828 images, fewer than the recovery's 4000
    assert scratch_share(rows) == '141%'


def test_stage_swap_trains_a_hybrid_of_converted_and_frozen_original_parts_then_the_converted_model(
        monkeypatch, models):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measure_recovery_swap import SwapHybrid, swap_groups, swap_units
    original, converted = models
    # a norm alone is never cut from its neighbours: the stem's BatchNorm stays with the stem and the first block
    assert swap_units(original)[0] == ['conv1', 'bn1', 'layer1.0']
    groups = swap_groups(original, 2)
    assert groups[1][0] == 'layer3.0'
    assert [name for group in groups for name in group] == [n for unit in swap_units(original) for n in unit]
    student = copy.deepcopy(converted)
    hybrid = SwapHybrid(original, student, groups)
    x = torch.randn(4, 1, 32, 32)
    hybrid.train()
    late = [student.get_submodule(name) for name in groups[1]]
    assert all(not part.training and not any(p.requires_grad for p in part.parameters()) for part in late)
    with torch.no_grad():
        features = original.forward_head(original.layer4(original.layer3(converted.layer2(converted.layer1(
            converted.maxpool(converted.act1(converted.bn1(converted.conv1(x)))))))))
        hybrid.model.eval()
        assert torch.allclose(student(x), features, atol=1e-5)  # the first group converted, the rest the original's
        hybrid.swap_next()
        assert torch.equal(student(x), converted(x))  # every group swapped in: the converted model itself
    # two updates of two images: the second group, swapped in for the second, is trained too
    from measure_recovery_swap import recover_swapped
    trained = recover_swapped(original, copy.deepcopy(converted), x, torch.arange(4), 4, 2,
                              RecoverOptions(batch_size=2))
    assert not torch.equal(trained.layer4[1].conv2.weight, converted.layer4[1].conv2.weight)
    assert all(not isinstance(m, torch.nn.BatchNorm2d) for m in trained.modules())
    units = len(swap_units(original))
    with pytest.raises(OptionError, match=f'only {units} units'):
        swap_groups(original, units + 1)


def test_recovery_seeds_are_tabled_beside_each_other_and_kept_out_of_the_summary(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measure_family_recovery import seeds_table, summary_table
    base = dict(model='resnet18', model_kwargs='', recipe='adamw', train_images=4000, fixed_epochs=None,
                test_images=10000, convert_options={}, images=4000, original=85., converted=84., scratch=70.,
                scratch_full=84.5, original_epochs=10, budget=1.0)
    rows = [dict(base, options=dict(lr=1e-4, seed=seed), recovered=top1) for seed, top1 in ((0, 84.2), (1, 84.6))]
    assert '| `resnet18` | adamw | 1 | 84.20 / 84.60 | 0.40 |' in seeds_table(rows)
    assert seeds_table(rows[:1]) == ''
    summary = summary_table(rows)
    assert summary.count('`resnet18`') == 1 and '84.20' in summary and '84.60' not in summary


def test_defaults_are_compared_with_the_previous_ones_and_the_stop_rules_replayed_on_their_curves(monkeypatch):
    """Today's defaults against the previous ones on one original, the target (the higher of the original less 0.3
    and from scratch), and the two stop rules on a held-out curve whose top-1 dips within its noise while its loss
    falls: the previous rule stops at the third evaluation though the end is better; today's runs to the end."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measure_family_recovery import OLD_DEFAULTS, comparison_tables, recipe_of, stop_rule_table
    top1s, losses = (80., 79.5, 79.8, 80.6, 81.), (0.60, 0.58, 0.57, 0.55, 0.54)
    curve = [dict(images=64 * k, top1=t, loss=v, loss_se=0.02, lr=1e-4) for k, (t, v) in enumerate(zip(top1s, losses))]
    report = dict(curve=curve, stopped='budget', lr=3e-4, sweep_images=96, budget_images=1000)
    base = dict(model='resnet18', recipe='augmented', budget=1.0, convert_options={}, images=1000, original=80.,
                converted=78., scratch_full=79., val_images=1024, report=report)
    rows = [dict(base, options=recipe_of(RecoverOptions()), recovered=79.8),
            dict(base, options=recipe_of(RecoverOptions(**OLD_DEFAULTS)), recovered=78.5)]
    assert ('| `resnet18` | 80.00 | 78.00 | 78.50 | **79.80** | +1.30 | 0.0003 | 1,096 of 1,000 | 79.00 | yes |'
            in comparison_tables(rows))
    assert 'no (-0.20)' in comparison_tables([dict(rows[0], recovered=79.5)])
    table = stop_rule_table(rows)
    assert '| `resnet18` | augmented | none (5) |  | 3 of 5 | +1.00 |' in table
    assert ("today's rule stops 0 early, 0 of them with the end better on held-out loss; the previous rule stops 1 "
            'early, 1 of them with the end better on held-out top-1, 0 by more than its noise') in table


@pytest.mark.parametrize('recovered, original, scratch_full, expected', [
    (84.2, 84.4, 84.0, 'convert; within 0.3 of the original'),
    (83.9, 85.2, 84.3, 'convert; 1.30 below the original, stopped by the layer: from scratch is 0.90 below the '
                       'original'),
    (83.1, 83.7, 83.4, 'convert; 0.60 below the original, stopped by the recovery'),
    (75.5, 80.0, 81.5, 'from scratch (+6.00); 4.50 below the original, stopped by the recovery'),
    (89.3, 90.0, 10.1, 'convert; 0.70 below the original; PatchNorm from scratch does not train by this recipe '
                       "(chance): the layer's level is not known"),
])
def test_verdict_names_convert_or_scratch_and_what_stops_the_recovery(monkeypatch, recovered, original, scratch_full,
                                                                      expected):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from measure_family_recovery import verdict
    assert verdict(dict(recovered=recovered, original=original, scratch_full=scratch_full)) == expected

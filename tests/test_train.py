"""Tests of the data module and the trainer: tiny timm ResNets on a few hundred Fashion-MNIST images, on CPU."""
import copy
import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
from PIL import Image
from safetensors.torch import load_file, save_file
from torch.utils.data import Subset

from timm_affinediv.data import (
    FASHION_MNIST_CLASSES,
    FASHION_MNIST_DIR,
    DataError,
    FashionMNIST,
    create_image_dataset,
    create_train_loader,
    dataset_class_names,
    resolve_dataset_data_config,
    set_loader_epoch,
)
from timm_affinediv.train import (
    CheckpointError,
    ConfigError,
    NonFiniteLossError,
    TrainConfig,
    Trainer,
    TrainingInterrupted,
    evaluate,
)

TINY = dict(channels=(16, 32, 64, 128), stem_width=16)  # a narrow resnet18: fast on 2 CPU cores

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_MNIST_DIR, 'train-images-idx3-ubyte.gz')),
    reason='Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)')


def tiny_config(output, **overrides) -> TrainConfig:
    """A run of a few seconds: narrow resnet18, 256 train / 128 val images, 32x32, batch 32."""
    settings = dict(
        model='resnet18', model_kwargs=dict(TINY), dataset='fashion-mnist', num_classes=10, epochs=2, train_subset=256,
        val_subset=128, batch_size=32, workers=0, lr=3e-3, output=str(output), progress=False, log_interval=2)
    settings.update(overrides)
    return TrainConfig(**settings)


def tiny_model(num_classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    return timm.create_model('resnet18', num_classes=num_classes, in_chans=1, **TINY)


@torch.no_grad()
def predictions(model: nn.Module, trainer: Trainer) -> torch.Tensor:
    model.eval()
    return torch.cat([model(x).argmax(-1) for x, _ in trainer.val_loader])


@pytest.fixture(scope='module')
def teacher_run(tmp_path_factory):
    """A tiny model trained from scratch for 3 epochs on 512 images: (trainer, accuracy before, result)."""
    cfg = tiny_config(tmp_path_factory.mktemp('teacher'), epochs=3, train_subset=512, val_subset=256)
    trainer = Trainer(cfg)
    before = trainer.evaluate()
    return trainer, before, trainer.fit()


# ---- data

def test_fashion_mnist_reads_idx_files():
    train, test = FashionMNIST(split='train'), FashionMNIST(split='validation')
    assert (len(train), len(test)) == (60000, 10000)
    img, target = test[0]
    assert isinstance(img, Image.Image) and img.mode == 'L' and img.size == (28, 28)
    assert sorted(set(train.targets.tolist())) == list(range(10))
    config = resolve_dataset_data_config('fashion-mnist')
    assert config['input_size'] == (1, 32, 32) and len(config['mean']) == 1
    loader = create_train_loader('fashion-mnist', None, config, 16, subset=64, workers=0)
    set_loader_epoch(loader, 0, seed=1)
    first = next(iter(loader))[1]
    set_loader_epoch(loader, 0, seed=1)
    x, again = next(iter(loader))
    assert x.shape == (16, 1, 32, 32) and torch.equal(first, again)  # the order depends only on (seed, epoch)
    set_loader_epoch(loader, 1, seed=1)
    assert not torch.equal(first, next(iter(loader))[1])


def test_missing_fashion_mnist_says_how_to_install(tmp_path):
    with pytest.raises(DataError, match='apt-get install dataset-fashion-mnist'):
        FashionMNIST(root=str(tmp_path))
    (tmp_path / 'train-images-idx3-ubyte.gz').write_bytes(b'not gzip')
    (tmp_path / 'train-labels-idx1-ubyte.gz').write_bytes(b'not gzip')
    with pytest.raises(DataError, match='cannot read Fashion-MNIST file'):
        FashionMNIST(root=str(tmp_path))


def _image_folder(root, classes=('a', 'b'), per_class=4):
    for c in classes:
        os.makedirs(root / 'train' / c)
        for i in range(per_class):
            Image.fromarray(np.full((8, 8, 3), 40 * i, np.uint8)).save(root / 'train' / c / f'{i}.png')


def test_the_library_has_no_default_dataset(tmp_path):
    """A run, a conversion and a published run say which data they read: no built-in one is assumed."""
    from timm_affinediv.model_io import convert_to_folder
    with pytest.raises(ConfigError, match="no dataset given: pass dataset='fashion-mnist'"):
        TrainConfig(output=str(tmp_path)).validate()
    TrainConfig(data_dir=str(tmp_path), output=str(tmp_path)).validate()  # the image folder there
    with pytest.raises(ConfigError, match='no dataset given'):
        convert_to_folder(tiny_model(), str(tmp_path / 'out'))


def test_image_folder_and_its_errors(tmp_path):
    _image_folder(tmp_path)
    dataset = create_image_dataset('', str(tmp_path), 'train', in_chans=1)
    assert len(dataset) == 8 and dataset[0][0].mode == 'L'
    assert dataset_class_names(dataset) == ('a', 'b') and dataset_class_names(Subset(dataset, [0])) == ('a', 'b')
    assert dataset_class_names(FashionMNIST(split='test')) == FASHION_MNIST_CLASSES
    with pytest.raises(DataError, match='does not exist'):
        create_image_dataset('', str(tmp_path / 'missing'), 'train')
    os.makedirs(tmp_path / 'empty' / 'train' / 'a')
    with pytest.raises(DataError, match='class sub-folders'):
        create_image_dataset('', str(tmp_path / 'empty'), 'train')
    (tmp_path / 'train' / 'b' / '9.png').write_bytes(b'not a png')
    dataset = create_image_dataset('', str(tmp_path), 'train')
    bad = next(i for i in range(len(dataset)) if dataset.dataset.filename(i).endswith('9.png'))
    with pytest.raises(DataError, match='9.png'):
        dataset[bad]


# ---- training

def test_training_raises_accuracy_and_writes_outputs(teacher_run):
    trainer, before, result = teacher_run
    assert result.metrics['val_top1'] > before['top1'] + 25, (before, result.metrics)
    out = result.output_dir
    history = json.load(open(os.path.join(out, 'metrics.json')))
    assert [h['epoch'] for h in history] == [0, 1, 2]
    assert {'train_loss', 'val_loss', 'val_top1', 'val_top5', 'val_img_s', 'train_img_s', 'lr'} <= set(history[0])
    assert len(open(os.path.join(out, 'metrics.csv')).read().splitlines()) == 4
    assert open(os.path.join(out, 'metrics.png'), 'rb').read(8) == b'\x89PNG\r\n\x1a\n'
    assert result.model_args == {**TINY, 'in_chans': 1, 'num_classes': 10}
    rebuilt = timm.create_model(result.model_name, **result.model_args)
    rebuilt.load_state_dict(load_file(result.weights_file))
    assert trainer.evaluate(rebuilt)['top1'] == pytest.approx(result.metrics['val_top1'])
    best = json.load(open(os.path.join(out, 'checkpoints', 'best.json')))['checkpoint']
    assert os.path.isdir(os.path.join(out, 'checkpoints', best))


def _damaged_copy(model: nn.Module, noise: float = 0.5) -> nn.Module:
    """A copy with noise on every convolution weight: a stand-in for a lossy conversion of a trained model."""
    torch.manual_seed(0)
    damaged = copy.deepcopy(model)
    with torch.no_grad():
        for p in damaged.parameters():
            if p.ndim == 4:
                p.add_(noise * p.std() * torch.randn_like(p))
    return damaged


def test_fine_tune_of_damaged_model_with_distillation_raises_accuracy(teacher_run, tmp_path):
    """One epoch of fine-tuning, distilling from the original, recovers much of a damaged copy's accuracy."""
    original = teacher_run[2].model
    cfg = tiny_config(tmp_path, distill_weight=0.5, distill_temperature=1.0, epochs=1, lr=1e-3, train_subset=512,
                      val_subset=256)
    trainer = Trainer(cfg, model=_damaged_copy(original), teacher=original)
    before = trainer.evaluate()['top1']
    after = trainer.fit().metrics['val_top1']
    assert after > before + 10, (before, after)


class _Permuted(nn.Module):
    """A teacher that predicts class c + 1 wherever its model predicts c: it disagrees with the labels."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.num_classes = model, model.num_classes

    def forward(self, x):
        return self.model(x).roll(1, dims=-1)


def test_distillation_lowers_disagreement_with_teacher(teacher_run, tmp_path):
    """Same start, same data: the distilled student agrees with the teacher much more than the hard-label one.

    The teacher's predictions are shifted away from the labels, so only the distillation term can pull the student
    toward them."""
    original = teacher_run[2].model
    teacher = _Permuted(original)
    disagreement = {}
    for weight in (0.0, 0.9):
        cfg = tiny_config(tmp_path / f'w{weight}', distill_weight=weight, distill_temperature=1.0, epochs=2,
                          lr=3e-3, train_subset=512, val_subset=256)
        trainer = Trainer(cfg, model=_damaged_copy(original), teacher=teacher)
        reference = predictions(teacher, trainer)
        initial = (predictions(trainer.model, trainer) != reference).float().mean().item()
        trainer.fit()
        disagreement[weight] = (predictions(trainer.model, trainer) != reference).float().mean().item()
    assert disagreement[0.9] < initial - 0.15, (initial, disagreement)
    assert disagreement[0.9] < disagreement[0.0] - 0.15, disagreement


def _interrupt_at_update(trainer: Trainer, update: int) -> None:
    """Send SIGINT to this process right after the given optimiser update (as Ctrl-C would)."""
    step, count = trainer.optimizer.step, [0]

    def step_then_interrupt(*args, **kwargs):
        result = step(*args, **kwargs)
        count[0] += 1
        if count[0] == update:
            os.kill(os.getpid(), signal.SIGINT)
        return result
    trainer.optimizer.step = step_then_interrupt


def test_resume_after_ctrl_c_equals_uninterrupted_run(tmp_path):
    settings = dict(epochs=2, grad_accum_steps=2, model_ema=True, model_ema_decay=0.9)
    full = Trainer(tiny_config(tmp_path / 'full', **settings)).fit()

    interrupted = Trainer(tiny_config(tmp_path / 'cut', **settings))
    _interrupt_at_update(interrupted, 6)  # 4 updates per epoch: stops in the middle of epoch 1
    with pytest.raises(TrainingInterrupted) as info:
        interrupted.fit()
    assert os.path.basename(info.value.checkpoint) == 'interrupt-0001-000002'
    resumed = Trainer(tiny_config(tmp_path / 'cut', resume=str(tmp_path / 'cut'), **settings))
    assert (resumed.epoch, resumed.update_in_epoch, resumed.num_updates) == (1, 2, 6)
    result = resumed.fit()

    for a, b in zip(full.history, result.history):
        for key in ('train_loss', 'val_loss', 'val_top1', 'val_top5', 'ema_val_loss', 'lr'):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    final_a, final_b = load_file(full.weights_file), load_file(result.weights_file)
    for key in final_a:
        torch.testing.assert_close(final_a[key], final_b[key], rtol=1e-5, atol=1e-6)


def test_resume_rejects_corrupt_or_mismatched_checkpoints(tmp_path):
    Trainer(tiny_config(tmp_path / 'run', epochs=1, train_subset=64, val_subset=32)).fit()
    checkpoint = tmp_path / 'run' / 'checkpoints' / 'epoch-0000'
    with pytest.raises(CheckpointError, match='does not match'):
        Trainer(tiny_config(tmp_path / 'other', train_subset=64, val_subset=32, resume=str(checkpoint),
                            model_kwargs=dict(channels=(8, 16, 32, 64), stem_width=8)))
    with pytest.raises(CheckpointError, match='no checkpoint at'):
        Trainer(tiny_config(tmp_path / 'x', train_subset=64, val_subset=32, resume=str(tmp_path / 'nothing')))
    weights = checkpoint / 'model.safetensors'
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match='unreadable'):
        Trainer(tiny_config(tmp_path / 'run', train_subset=64, val_subset=32, resume=str(tmp_path / 'run')))


def test_class_count_mismatch_needs_num_classes(tmp_path):
    with pytest.raises(ConfigError, match='--num-classes 10'):
        Trainer(tiny_config(tmp_path, num_classes=None), model=tiny_model(num_classes=5))
    with pytest.raises(ConfigError, match='does not match the dataset'):
        Trainer(tiny_config(tmp_path, num_classes=7), model=tiny_model(num_classes=5))
    trainer = Trainer(tiny_config(tmp_path, num_classes=10), model=tiny_model(num_classes=5))
    assert trainer.model.num_classes == 10 and trainer.model.get_classifier().out_features == 10


def test_initial_checkpoint_head_and_num_classes(teacher_run, tmp_path):
    """A 10-class checkpoint loads as it is; a 5-class one needs --num-classes 10, which gives it a new head."""
    weights = teacher_run[2].weights_file
    trainer = Trainer(tiny_config(tmp_path, num_classes=None, initial_checkpoint=os.path.dirname(weights)))
    assert trainer.evaluate()['top1'] == pytest.approx(teacher_run[2].metrics['val_top1'], abs=5)
    five = tiny_model(num_classes=5)
    save_file(five.state_dict(), str(tmp_path / 'five.safetensors'))
    with pytest.raises(ConfigError, match='--num-classes 10'):
        Trainer(tiny_config(tmp_path, num_classes=None, initial_checkpoint=str(tmp_path / 'five.safetensors')))
    trainer = Trainer(tiny_config(tmp_path, num_classes=10, initial_checkpoint=str(tmp_path / 'five.safetensors')))
    torch.testing.assert_close(trainer.model.conv1.weight, five.conv1.weight)
    assert trainer.model.get_classifier().out_features == 10
    with pytest.raises(ConfigError, match='unknown model'):
        Trainer(tiny_config(tmp_path, model='no_such_model'))


def test_trains_on_image_folder(tmp_path):
    """The image-folder path end to end: RGB images of two classes, resized to 32x32 (learning is tested above)."""
    for split in ('train', 'validation'):
        for c, value in (('dark', 30), ('light', 220)):
            os.makedirs(tmp_path / split / c)
            for i in range(8):
                pixels = np.clip(value + np.random.randint(-20, 20, (40, 40, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / c / f'{i}.png')
    cfg = tiny_config(tmp_path / 'out', dataset='', data_dir=str(tmp_path), num_classes=2, img_size=32,
                      in_chans=3, epochs=2, batch_size=8, train_subset=None, val_subset=None)
    trainer = Trainer(cfg)
    assert trainer.data_config['input_size'] == (3, 32, 32)
    result = trainer.fit()
    assert result.model_args['in_chans'] == 3 and result.model_args['num_classes'] == 2
    assert [h['epoch'] for h in result.history] == [0, 1]
    assert result.metrics['val_top5'] == 100.0 and 0 <= result.metrics['val_top1'] <= 100


def test_bfloat16_amp_with_clipping_on_cpu(tmp_path):
    cfg = tiny_config(tmp_path, amp=True, clip_grad=1.0, epochs=1, train_subset=64, val_subset=32)
    trainer = Trainer(cfg)
    assert trainer.amp_dtype == torch.bfloat16 and trainer.loss_scaler is None
    metrics = trainer.fit().metrics
    assert np.isfinite(metrics['train_loss']) and np.isfinite(metrics['val_loss'])
    with pytest.raises(ConfigError, match='bfloat16 on CPU'):
        Trainer(tiny_config(tmp_path, amp=True, amp_dtype='float16', device='cpu'))


def test_adaptive_clipping_leaves_the_classifier_alone_as_timms_train_py_does(tmp_path):
    """AGC bounds a gradient by its weight's norm: on `patchnorm`'s zero classifier it would allow steps of 2e-5 at
    most. timm's train.py leaves the head out of AGC, and so does the Trainer: the classifier learns."""
    cfg = tiny_config(tmp_path, norm_layer='patchnorm', opt='sgd', lr=0.1, clip_grad=0.02, clip_mode='agc', epochs=1,
                      train_subset=128, val_subset=32)
    trainer = Trainer(cfg)
    classifier = trainer.model.get_classifier()
    assert not classifier.weight.any()
    trainer.fit()
    assert classifier.weight.abs().max() > 1e-2


class _PoisonAfter(nn.Module):
    """Wraps a model; its training outputs turn NaN after `after` training forward passes."""

    def __init__(self, model: nn.Module, after: int):
        super().__init__()
        self.model, self.after, self.calls, self.num_classes = model, after, 0, model.num_classes

    def forward(self, x):
        out = self.model(x)
        if self.training:
            self.calls += 1
            if self.calls > self.after:
                out = out * float('nan')
        return out


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path, epochs=3, train_subset=128, val_subset=32, log_interval=100)
    trainer = Trainer(cfg, model=_PoisonAfter(tiny_model(), after=4 + 2))  # 4 batches per epoch: NaN in epoch 1
    with pytest.raises(NonFiniteLossError, match='epoch 1'):
        trainer.fit()
    last = json.load(open(tmp_path / 'checkpoints' / 'last.json'))
    assert last['checkpoint'] == 'epoch-0000'
    weights = load_file(str(tmp_path / 'checkpoints' / 'epoch-0000' / 'model.safetensors'))
    assert all(torch.isfinite(v).all() for v in weights.values() if v.is_floating_point())
    assert not (tmp_path / 'model.safetensors').exists()


def test_cli_bad_input_exits_with_message(tmp_path, capfd):
    proc = subprocess.run(
        [sys.executable, '-m', 'timm_affinediv', 'finetune', '--dataset', '', '--data-dir', str(tmp_path / 'missing'),
         '--output',
         str(tmp_path / 'out')], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and 'does not exist' in proc.stderr


def test_torchrun_two_processes(tmp_path):
    """DDP on CPU (gloo): both ranks train; rank 0 writes; metrics are reduced over the ranks' shards."""
    out = tmp_path / 'ddp'
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
           '-m', 'timm_affinediv', 'finetune', '--model', 'resnet18', '--model-kwargs',
           'channels=(16,32,64,128)', 'stem_width=16', '--num-classes', '10', '--epochs', '2', '-b', '16',
           '--train-subset', '128', '--val-subset', '96', '-j', '0', '--lr', '3e-3', '--log-interval', '2',
           '--no-progress', '--output', str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both workers
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-3000:]
    state = torch.load(out / 'checkpoints' / 'epoch-0001' / 'train_state.pt', weights_only=True)
    assert state['world_size'] == 2 and len(state['ranks']) == 2
    assert state['num_updates'] == 2 * (128 // (16 * 2))
    history = json.load(open(out / 'metrics.json'))
    assert len(history) == 2
    # the reduced top-1 over both ranks' halves equals a one-process evaluation of the saved weights
    trainer = Trainer(tiny_config(tmp_path / 'eval', val_subset=96), model=tiny_model())
    trainer.model.load_state_dict(load_file(str(out / 'model.safetensors')))
    single = trainer.evaluate()
    assert history[-1]['val_top1'] == pytest.approx(single['top1'])
    assert history[-1]['val_loss'] == pytest.approx(single['loss'], rel=1e-4)


def test_evaluate_counts_every_sample_and_restores_the_mode():
    """The one evaluation loop (Trainer and conversion): sample-weighted metrics over uneven batches."""
    torch.manual_seed(0)
    model = nn.Linear(4, 7).train()
    x, target = torch.randn(10, 4), torch.randint(0, 7, (10,))
    batches = [(x[:6], target[:6]), (x[6:], target[6:])]
    metrics = evaluate(model, batches)
    with torch.no_grad():
        logits = model(x)
    top5 = logits.topk(5, dim=1).indices
    assert model.training
    assert metrics['loss'] == pytest.approx(nn.functional.cross_entropy(logits, target).item(), rel=1e-6)
    assert metrics['top1'] == pytest.approx(100 * (logits.argmax(1) == target).float().mean().item())
    assert metrics['top5'] == pytest.approx(100 * (top5 == target[:, None]).any(1).float().mean().item())
    with pytest.raises(ConfigError, match='empty'):
        evaluate(model, [])


@pytest.mark.parametrize('terminal', [True, False])
def test_progress_bars_on_a_terminal_log_lines_otherwise(tmp_path, monkeypatch, caplog, terminal):
    """tqdm writes to stderr: bars there when it is a terminal; in a file, one log line every --log-interval
    updates instead of thousands of carriage-return updates."""
    class Stderr(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    stderr = Stderr()
    monkeypatch.setattr(sys, 'stderr', stderr)
    cfg = tiny_config(tmp_path, epochs=1, train_subset=64, val_subset=16, batch_size=16, log_interval=2, progress=None)
    with caplog.at_level('INFO', logger='timm_affinediv.train.trainer'):
        Trainer(cfg).fit()  # 4 updates
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('train 0 [')]
    if terminal:
        assert '\r' in stderr.getvalue() and 'train 0' in stderr.getvalue() and not lines
    else:
        assert stderr.getvalue() == '' and [line.split(']')[0] for line in lines] == ['train 0 [2/4', 'train 0 [4/4']
        assert all(' loss ' in line and ' lr ' in line for line in lines)

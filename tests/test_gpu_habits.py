"""GPU users' habits on the CPU: `finetune` with `--channels-last`, AMP, EMA, `--grad-checkpointing` and
`--torchcompile` runs to a saved folder that reloads with the run's own logits; a channels-last run resumes bit for
bit; `convert` and `export` take a channels-last model. Narrow patchnorm resnet18s on a few dozen Fashion-MNIST
images."""
import os

import pytest
import timm
import torch
from safetensors.torch import load_file
from test_train import _interrupt_at_update  # SIGINT after an optimiser update, as Ctrl-C

import timm_affinediv.commands.finetune as finetune_command
from timm_affinediv.commands import main
from timm_affinediv.convert import ConvertOptions, DistillOptions, convert_model
from timm_affinediv.data import FASHION_MNIST_DIR
from timm_affinediv.export import export_onnx
from timm_affinediv.hub import save_hub_folder
from timm_affinediv.train import TrainConfig, Trainer, TrainingInterrupted

NARROW = dict(channels=(16, 32, 64, 128), stem_width=16)

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_MNIST_DIR, 'train-images-idx3-ubyte.gz')),
    reason='Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)')


def _images(seed: int = 0) -> torch.Tensor:
    return torch.randn(4, 1, 32, 32, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(x)


def _reloaded(folder) -> torch.nn.Module:
    return timm.create_model(f'local-dir:{folder}', pretrained=True)


# `--torchcompile aot_eager`: the trainer's compiled wrapper and its checkpoint names are those of inductor (timm's
# default backend), which on a CPU spends a minute compiling C++ for a narrow resnet18
@pytest.mark.parametrize('flags', [
    ['--channels-last'],
    ['--channels-last', '--amp', '--model-ema'],
    ['--grad-checkpointing', '--channels-last'],
    ['--torchcompile', 'aot_eager'],
], ids=lambda flags: ' '.join(flags))
def test_finetune_saves_a_folder_that_reloads_with_the_runs_logits(flags, tmp_path, monkeypatch):
    published = {}

    def publish_and_record(result, *args, **kwargs):
        published['model'] = result.model
        published['logits'] = _logits(result.model, _images().to(memory_format=result_format(result)))
        return publish(result, *args, **kwargs)

    def result_format(result):
        return torch.channels_last if '--channels-last' in flags else torch.contiguous_format

    publish = finetune_command.publish_run
    monkeypatch.setattr(finetune_command, 'publish_run', publish_and_record)
    out = tmp_path / 'run'
    status = main(['finetune', '--model', 'resnet18', '--model-kwargs', f"channels={NARROW['channels']}",
                   f"stem_width={NARROW['stem_width']}", '--norm-layer', 'patchnorm', '--num-classes', '10',
                   '--dataset', 'fashion_mnist', '--img-size', '32', '--train-subset', '32', '--val-subset', '16',
                   '-b', '16', '-j', '0', '--epochs', '1', '--output', str(out), *flags])
    assert status == 0
    trained = published['model']
    if '--channels-last' in flags:
        assert trained.layer1[0].conv1.weight.is_contiguous(memory_format=torch.channels_last)
        assert not trained.layer1[0].conv1.weight.is_contiguous()
    reloaded = _reloaded(out / 'model')
    torch.testing.assert_close(_logits(reloaded, _images()), published['logits'], rtol=1e-5, atol=1e-5)
    # the run's own weights file and its last checkpoint hold the same weights as the folder
    folder_weights = load_file(out / 'model' / 'model.safetensors')
    for weights in (load_file(out / 'model.safetensors'),):
        assert weights.keys() == folder_weights.keys()
        assert all(torch.equal(weights[k], folder_weights[k]) for k in weights)
    checkpoint = load_file(out / 'checkpoints' / 'epoch-0000' / 'model.safetensors')
    assert checkpoint.keys() == trained.state_dict().keys()
    if '--model-ema' in flags:
        assert (out / 'checkpoints' / 'epoch-0000' / 'ema.safetensors').is_file()


def _config(output, **overrides) -> TrainConfig:
    settings = dict(model='resnet18', model_kwargs=dict(NARROW), norm_layer='patchnorm', dataset='fashion-mnist',
                    num_classes=10, epochs=2, train_subset=64, val_subset=16, batch_size=16, workers=0, lr=3e-3,
                    output=str(output), progress=False, log_interval=1, channels_last=True, model_ema=True,
                    model_ema_decay=0.9)
    settings.update(overrides)
    return TrainConfig(**settings)


def test_channels_last_ema_run_resumes_bit_for_bit(tmp_path):
    full = Trainer(_config(tmp_path / 'full')).fit()
    interrupted = Trainer(_config(tmp_path / 'cut'))
    _interrupt_at_update(interrupted, 6)  # 4 updates per epoch: stops in the middle of epoch 1
    with pytest.raises(TrainingInterrupted):
        interrupted.fit()
    resumed = Trainer(_config(tmp_path / 'cut', resume=str(tmp_path / 'cut')))
    assert resumed.model.layer1[0].conv1.weight.is_contiguous(memory_format=torch.channels_last)
    assert (resumed.epoch, resumed.update_in_epoch) == (1, 2)
    result = resumed.fit()
    for a, b in zip(full.history, result.history):
        assert all(a[key] == b[key] for key in ('train_loss', 'val_loss', 'ema_val_loss', 'lr')), (a, b)
    final_a, final_b = load_file(full.weights_file), load_file(result.weights_file)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


def _channels_last_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW)
    return model.to(memory_format=torch.channels_last).eval()


def test_convert_a_channels_last_model_and_save_it(tmp_path):
    original = _channels_last_model()
    calibration = [_images(seed).to(memory_format=torch.channels_last) for seed in range(2)]
    fit_only = ConvertOptions(distill=DistillOptions(epochs=0))
    converted, _ = convert_model(original, calibration=calibration, options=fit_only)
    weight = converted.layer1[0].conv1.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous()
    x = _images(5).to(memory_format=torch.channels_last)
    folder = save_hub_folder(converted, tmp_path / 'model', model_args=dict(norm_layer='patchnorm', **NARROW))
    torch.testing.assert_close(_logits(_reloaded(folder), x.contiguous()), _logits(converted, x),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('dynamo', [True, False], ids=['dynamo', 'torchscript'])
def test_export_a_channels_last_model(dynamo, tmp_path):
    model = timm.create_model('resnet18', norm_layer='patchnorm', num_classes=10, in_chans=1, **NARROW)
    model = model.to(memory_format=torch.channels_last)
    error = export_onnx(model, tmp_path / 'model.onnx', (1, 32, 32), dynamo=dynamo)
    assert error is not None and error <= 1e-5 and (tmp_path / 'model.onnx').is_file()

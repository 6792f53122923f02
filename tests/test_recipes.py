"""timm's recipe language in the trainer: one test per flag group, each training a few steps of a narrow ResNet
on a few dozen Fashion-MNIST images, and an interrupted + resumed run with mixup and RandAugment, bit for bit."""
import json
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_train import _interrupt_at_update  # SIGINT after an optimiser update, as Ctrl-C
from timm.data import FastCollateMixup, Mixup
from timm.data.auto_augment import RandAugment
from timm.data.distributed_sampler import RepeatAugSampler
from timm.data.random_erasing import RandomErasing
from timm.loss import BinaryCrossEntropy, SoftTargetCrossEntropy
from torch.utils.data import DistributedSampler

from timm_affinediv.data import FASHION_MNIST_DIR, DataError
from timm_affinediv.train import ConfigError, TrainConfig, Trainer, TrainingInterrupted, load_timm_args

NARROW = dict(channels=(16, 32, 64, 128), stem_width=16)

pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(FASHION_MNIST_DIR, 'train-images-idx3-ubyte.gz')),
    reason='Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)')


def recipe(output, **overrides) -> TrainConfig:
    """One epoch of 2 batches of 16 (32 train, 16 validation images), patchnorm narrow resnet18."""
    settings = dict(
        model='resnet18', model_kwargs=dict(NARROW), norm_layer='patchnorm', dataset='fashion-mnist', num_classes=10,
        epochs=1, train_subset=32, val_subset=16, batch_size=16, workers=0, lr=3e-3, output=str(output), progress=False,
        log_interval=1)
    settings.update(overrides)
    return TrainConfig(**settings)


def _transforms(trainer):
    return list(trainer.train_loader.dataset.dataset.transform.transforms)


def test_augmentation_flags_build_timm_transforms(tmp_path):
    settings = dict(aa='rand-m9-mstd0.5', reprob=0.25, remode='pixel', recount=2, vflip=0.5,
                    train_interpolation='bicubic', scale=(0.5, 1.0), ratio=(0.8, 1.25))
    trainer = Trainer(recipe(tmp_path, **settings))
    transforms = _transforms(trainer)
    kinds = [type(t) for t in transforms]
    assert RandAugment in kinds and RandomErasing not in kinds  # train.py's prefetcher: erased on the device
    erasing = trainer.normalize_batch.random_erasing
    assert (erasing.probability, erasing.mode, erasing.max_count) == (0.25, 'pixel', 2)
    crop = transforms[0]
    assert crop.scale == (0.5, 1.0) and crop.ratio == (0.8, 1.25)
    assert any(getattr(t, 'p', None) == 0.5 and 'Vertical' in type(t).__name__ for t in transforms)
    x, _ = next(iter(trainer.train_loader))
    assert x.dtype == torch.uint8
    normalized = trainer.normalize_batch(x)
    assert normalized.dtype == torch.float32 and normalized.shape == x.shape
    metrics = trainer.fit().metrics
    assert torch.isfinite(torch.tensor(metrics['train_loss']))

    plain = Trainer(recipe(tmp_path / 'plain', no_prefetcher=True, **settings))
    assert plain.normalize_batch is None
    erasing = [t for t in _transforms(plain) if isinstance(t, RandomErasing)]
    assert len(erasing) == 1 and (erasing[0].probability, erasing[0].max_count) == (0.25, 2)
    assert next(iter(plain.train_loader))[0].dtype == torch.float32


@pytest.mark.parametrize('bce', [False, True])
def test_mixup_cutmix_mix_targets_into_the_soft_target_loss(tmp_path, bce):
    """Mixed in the loader's FastCollateMixup (the prefetcher, with the soft-target loss) or, without the
    prefetcher, by timm's Mixup in the training step (with BCE)."""
    cfg = recipe(tmp_path, mixup=0.2, cutmix=1.0, mixup_switch_prob=0.5, smoothing=0.1, bce_loss=bce,
                 bce_target_thresh=0.2 if bce else None, no_prefetcher=bce)
    trainer = Trainer(cfg)
    assert isinstance(trainer.train_loader.collate_fn, FastCollateMixup) != bce
    assert isinstance(trainer.mixup_fn, Mixup) == bce
    loss = trainer.train_loss_fn
    assert isinstance(loss, BinaryCrossEntropy if bce else SoftTargetCrossEntropy)
    if bce:
        assert loss.target_threshold == 0.2
    seen = []

    def recording(output, target):
        seen.append(target.detach().clone())
        return loss(output, target)
    trainer.train_loss_fn = recording
    trainer.fit()
    assert len(seen) == 2 and all(t.shape == (16, 10) for t in seen)
    for target in seen:
        torch.testing.assert_close(target.sum(1), torch.ones(16))
        assert (target.max(1).values < 0.9).any(), 'some rows mix two classes (smoothing alone keeps 0.91)'


def test_optimizer_and_scheduler_follow_timm_kwargs(tmp_path):
    """opt / eps / betas / opt-kwargs reach the optimizer; lr-base scaling and a step schedule decay per epoch."""
    cfg = recipe(tmp_path, opt='adamw', opt_eps=1e-6, opt_betas=(0.8, 0.95), opt_kwargs=dict(amsgrad=True),
                 weight_decay=0.01, lr=None, lr_base=0.01, lr_base_size=64, lr_base_scale='linear',
                 sched='step', decay_epochs=1, decay_rate=0.5, warmup_epochs=0, sched_on_updates=False, epochs=2)
    trainer = Trainer(cfg)
    group = trainer.optimizer.param_groups[0]
    assert type(trainer.optimizer).__name__ == 'AdamW'
    assert (group['eps'], group['betas'], group['amsgrad']) == (1e-6, (0.8, 0.95), True)
    assert trainer.lr == pytest.approx(0.01 * 16 / 64)
    history = trainer.fit().history
    assert [h['lr'] for h in history] == pytest.approx([0.0025, 0.00125])
    assert TrainConfig(lr_base=0.1, batch_size=64, opt='lamb').resolve_lr() == pytest.approx(0.1 * 0.5)  # sqrt


@pytest.mark.parametrize('sched', ['step', 'none'])
def test_layer_decay_gives_per_layer_lr_scales(tmp_path, sched):
    """The stem learns slowest, the head at the full rate; the scales apply with a schedule and without."""
    trainer = Trainer(recipe(tmp_path, layer_decay=0.5, sched=sched, train_subset=16))
    groups = trainer.optimizer.param_groups
    scales = {g['lr_scale'] for g in groups}
    assert len(scales) > 2 and max(scales) == 1.0 and min(scales) < 0.1
    trainer.fit()
    lr = groups[[g['lr_scale'] for g in groups].index(1.0)]['lr']
    assert lr == pytest.approx(trainer.lr)
    for g in groups:
        assert g['lr'] == pytest.approx(lr * g['lr_scale'])


def test_torchcompile_trains_and_checkpoints_uncompiled_names(tmp_path):
    trainer = Trainer(recipe(tmp_path, torchcompile='aot_eager'))
    assert trainer.train_model is not trainer.model
    result = trainer.fit()
    assert torch.isfinite(torch.tensor(result.metrics['train_loss']))
    names = set(load_file(os.path.join(tmp_path, 'checkpoints', 'epoch-0000', 'model.safetensors')))
    assert names == set(trainer.model.state_dict()) and not any('_orig_mod' in n for n in names)


def test_grad_checkpointing_trains_the_same_weights(tmp_path):
    plain = Trainer(recipe(tmp_path / 'plain')).fit()
    trainer = Trainer(recipe(tmp_path / 'ckpt', grad_checkpointing=True))
    assert trainer.model.grad_checkpointing
    checkpointed = trainer.fit()
    for key, value in plain.model.state_dict().items():
        torch.testing.assert_close(checkpointed.model.state_dict()[key], value, rtol=1e-5, atol=1e-6)


def test_config_yaml_of_train_py(tmp_path):
    """An args.yaml as timm's train.py writes it: its recipe is taken, its machine settings are not."""
    args = dict(model='resnet18', opt='lamb', lr=None, lr_base=0.002, weight_decay=0.02, sched='cosine',
                aa='rand-m7-mstd0.5-inc1', reprob=0.0, mixup=0.1, cutmix=1.0, smoothing=0.0, bce_loss=True,
                scale=[0.08, 1.0], ratio=[0.75, 1.3333333333333333], crop_pct=0.95, drop_path=0.05, epochs=1,
                warmup_epochs=0, batch_size=16, initial_checkpoint='', resume='', device='cuda',
                data_dir='/data/imagenet', workers=8, output='/somewhere', log_wandb=False, aug_splits=0,
                model_kwargs=dict(NARROW), some_future_flag=3)
    file = tmp_path / 'args.yaml'
    file.write_text(yaml.safe_dump(args))
    settings = load_timm_args(str(file))
    assert settings['opt'] == 'lamb' and settings['lr_base'] == 0.002 and settings['lr'] is None
    assert settings['scale'] == (0.08, 1.0) and settings['initial_checkpoint'] is None
    assert not {'device', 'data_dir', 'workers', 'output', 'log_wandb', 'some_future_flag'} & set(settings)
    cfg = TrainConfig(**{**settings, 'output': str(tmp_path / 'run'), 'train_subset': 32, 'val_subset': 16,
                         'workers': 0, 'num_classes': 10, 'norm_layer': 'patchnorm', 'progress': False,
                         'dataset': 'fashion-mnist'})
    trainer = Trainer(cfg)
    assert isinstance(trainer.train_loss_fn, BinaryCrossEntropy) and trainer.train_loader.collate_fn.mixup_alpha == 0.1
    assert type(trainer.optimizer).__name__ == 'Lamb'
    assert trainer.lr == pytest.approx(0.002 * (16 / 256) ** 0.5)
    assert trainer.model.layer2[0].drop_path.drop_prob == pytest.approx(0.05 * 2 / 7)  # block 2 of 0..7
    assert any(isinstance(t, RandAugment) for t in _transforms(trainer))
    trainer.fit()
    file.write_text(yaml.safe_dump(dict(args, jsd_loss=True, aug_splits=3)))
    with pytest.raises(ConfigError, match='aug_splits=3.*jsd_loss=True'):
        load_timm_args(str(file))


def test_resume_with_mixup_randaugment_and_aug_repeats_is_bit_exact(tmp_path):
    """Two loader processes: RandAugment and the mixing draw there, the erasing on the device; repeated
    augmentation (timm's RepeatAugSampler) gives each image 3 times an epoch, each copy augmented anew."""
    settings = dict(epochs=2, train_subset=48, aa='rand-m9-mstd0.5-inc1', reprob=0.25, mixup=0.2, cutmix=1.0,
                    drop_path=0.1, layer_decay=0.75, sched_on_updates=True, warmup_epochs=1, workers=2,
                    aug_repeats=3)
    trainer = Trainer(recipe(tmp_path / 'full', **settings))
    sampler = trainer.train_loader.sampler
    assert isinstance(sampler, RepeatAugSampler) and len(trainer.train_loader) == 3
    order = list(sampler)
    assert len(order) == 48 and order[0::3] == order[1::3] == order[2::3] and len(set(order)) == 16
    full = trainer.fit()
    interrupted = Trainer(recipe(tmp_path / 'cut', **settings))
    _interrupt_at_update(interrupted, 4)  # 3 updates per epoch: in the middle of epoch 1
    with pytest.raises(TrainingInterrupted):
        interrupted.fit()
    resumed = Trainer(recipe(tmp_path / 'cut', resume=str(tmp_path / 'cut'), **settings))
    assert (resumed.epoch, resumed.update_in_epoch) == (1, 1)
    result = resumed.fit()
    assert full.history[-1]['train_loss'] == result.history[-1]['train_loss']
    assert full.history[-1]['val_loss'] == result.history[-1]['val_loss']
    final_a, final_b = load_file(full.weights_file), load_file(result.weights_file)
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


# ---- datasets of every timm scheme, made here from Fashion-MNIST images

def _fashion_samples(count: int, offset: int = 0):
    from timm_affinediv.data import FashionMNIST
    test = FashionMNIST(split='test')
    return [(test[i][0], int(test.targets[i])) for i in range(offset, offset + count)]


@pytest.fixture(scope='module')
def wds_dir(tmp_path_factory):
    """WebDataset shards (`.png` + `.cls`) with timm's `_info.json`: train 2 shards of 16, validation 1 of 16."""
    import io
    import json
    import tarfile
    root = tmp_path_factory.mktemp('wds')
    info, offset = dict(name='fmnist', splits={}), 0
    for split, shards in (('train', 2), ('validation', 1)):
        names = [f'{split}-{s:04d}.tar' for s in range(shards)]
        for name in names:
            with tarfile.open(root / name, 'w') as tar:
                for i, (img, label) in enumerate(_fashion_samples(16, offset), start=offset):
                    png = io.BytesIO()
                    img.save(png, format='PNG')
                    for ext, data in (('png', png.getvalue()), ('cls', str(label).encode())):
                        member = tarfile.TarInfo(f'{i:06d}.{ext}')
                        member.size = len(data)
                        tar.addfile(member, io.BytesIO(data))
            offset += 16
        info['splits'][split] = dict(name=split, num_samples=16 * shards, filenames=names, shard_lengths=[16] * shards)
    (root / '_info.json').write_text(json.dumps(info))
    return root


def test_webdataset_stream_trains_and_resumes_at_the_epoch_boundary(wds_dir, tmp_path, caplog):
    settings = dict(dataset='wds/fmnist', data_dir=str(wds_dir), train_subset=None, val_subset=None, epochs=2,
                    in_chans=1, img_size=32, batch_size=16, log_interval=1)
    trainer = Trainer(recipe(tmp_path, **settings))
    assert trainer.stream and not isinstance(trainer.train_loader.sampler, DistributedSampler)
    assert len(trainer.train_loader) == 2
    _interrupt_at_update(trainer, 3)  # 2 updates per epoch: in epoch 1
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    assert os.path.basename(info.value.checkpoint) == 'epoch-0000'  # no checkpoint inside a stream's epoch
    with caplog.at_level('INFO'):
        resumed = Trainer(recipe(tmp_path, resume=str(tmp_path), **settings))
    assert (resumed.epoch, resumed.update_in_epoch, resumed.num_updates) == (1, 0, 2)
    assert 'epoch 1 starts from its beginning' in caplog.text
    history = resumed.fit().history
    assert [h['epoch'] for h in history] == [0, 1]
    assert history[0] == trainer.history[0]
    with pytest.raises(DataError, match='train-num-samples'):
        Trainer(recipe(tmp_path / 'x', **dict(settings, train_subset=32)))


def test_huggingface_datasets_map_style_and_streamed(tmp_path, monkeypatch):
    """`hfds/` (map-style: subsets, exact resume) and `hfids/` (streamed, its length from a flag) from a local
    parquet folder written with `datasets`."""
    datasets = pytest.importorskip('datasets')
    monkeypatch.setenv('HF_DATASETS_OFFLINE', '1')
    from timm_affinediv.data import FASHION_MNIST_CLASSES
    features = datasets.Features({'image': datasets.Image(), 'label': datasets.ClassLabel(
        names=list(FASHION_MNIST_CLASSES))})
    folder = tmp_path / 'fmnist'
    for split, count, offset in (('train', 64, 0), ('validation', 32, 64)):
        images, labels = zip(*_fashion_samples(count, offset))
        datasets.Dataset.from_dict(dict(image=list(images), label=list(labels)), features=features).to_parquet(
            str(folder / 'data' / f'{split}-00000-of-00001.parquet'))
    common = dict(data_dir=str(tmp_path / 'cache'), num_classes=10, in_chans=1, img_size=32)
    trainer = Trainer(recipe(tmp_path / 'map', dataset=f'hfds/{folder}', train_subset=48, batch_size=16, **common))
    assert not trainer.stream and trainer.num_classes == 10 and len(trainer.train_loader) == 3
    assert trainer.model.pretrained_cfg['label_names'] == list(FASHION_MNIST_CLASSES)  # the ClassLabel's names
    assert trainer.fit().metrics['val_top5'] > 0
    streamed = Trainer(recipe(tmp_path / 'stream', dataset=f'hfids/{folder}', train_subset=None,
                              train_num_samples=32, val_num_samples=32, val_subset=None, **common))
    assert streamed.stream and len(streamed.train_loader) == 2
    assert streamed.model.pretrained_cfg['label_names'] == list(FASHION_MNIST_CLASSES)
    assert [h['epoch'] for h in streamed.fit().history] == [0]


def test_torchvision_dataset_and_missing_extras(tmp_path, monkeypatch):
    """`torch/fashion_mnist` from torchvision's raw files (no download); a scheme whose package is missing names
    the extra to install."""
    import gzip
    raw = tmp_path / 'FashionMNIST' / 'raw'
    raw.mkdir(parents=True)
    for name in ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
                 't10k-labels-idx1-ubyte'):
        with gzip.open(os.path.join(FASHION_MNIST_DIR, name + '.gz')) as f:
            header = 16 if 'images' in name else 8
            data = f.read(header + 64 * (784 if 'images' in name else 1))
        count_at = 4
        (raw / name).write_bytes(data[:count_at] + (64).to_bytes(4, 'big') + data[count_at + 4:])
    trainer = Trainer(recipe(tmp_path / 'run', dataset='torch/fashion_mnist', data_dir=str(tmp_path),
                             train_subset=None, val_subset=None, num_classes=10, in_chans=3, img_size=32))
    assert trainer.num_classes == 10 and trainer.data_config['input_size'] == (3, 32, 32)
    assert trainer.model.pretrained_cfg['label_names'][:2] == ['T-shirt/top', 'Trouser']  # torchvision's classes
    x, _ = next(iter(trainer.train_loader))
    assert x.shape == (16, 3, 32, 32)  # the 'L' images converted for a 3-channel model
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'webdataset' else real_find_spec(name, *a))
    with pytest.raises(DataError, match=r'timm-affinediv\[wds\]'):
        Trainer(recipe(tmp_path / 'w', dataset='wds/x', data_dir=str(tmp_path)))


def test_cli_config_file_gives_defaults_that_flags_override(tmp_path):
    """`finetune --config args.yaml` as train.py reads it: the file's recipe, then the command line over it."""
    from timm_affinediv.commands.finetune import build_parser
    from timm_affinediv.commands.recipe_args import parse_with_config
    file = tmp_path / 'args.yaml'
    file.write_text(yaml.safe_dump(dict(opt='lamb', lr_base=0.004, aa='rand-m9-mstd0.5', mixup=0.8, cutmix=1.0,
                                        opt_betas=[0.9, 0.99], layer_decay=0.65, device='cuda', output='/x')))
    args, given = parse_with_config(build_parser(), ['--config', str(file), '--mixup', '0.2', '--output', 'here'])
    assert (args.opt, args.lr_base, args.aa, args.cutmix, args.layer_decay) == ('lamb', 0.004, 'rand-m9-mstd0.5',
                                                                               1.0, 0.65)
    assert args.mixup == 0.2 and args.output == 'here' and args.device is None and args.opt_betas == (0.9, 0.99)
    assert 'device' not in given and 'opt' in given
    help_text = ' '.join(build_parser().format_help().split())
    assert 'last epoch boundary' in help_text and '--layer-decay' in help_text and '--bce-loss' in help_text


def test_batchnorm_initial_checkpoint_for_patchnorm_is_refused(tmp_path):
    import timm
    from safetensors.torch import save_file
    file = tmp_path / 'bn.safetensors'
    save_file(timm.create_model('resnet18', num_classes=10, in_chans=1, **NARROW).state_dict(), str(file))
    with pytest.raises(ConfigError, match=r"BatchNorm model's.*timm-affinediv convert"):
        Trainer(recipe(tmp_path / 'run', initial_checkpoint=str(file)))


# ---- timm's published recipes, as train.py's args.yaml, through `finetune --config` unchanged

RECIPES = Path(__file__).parent / 'data' / 'recipes'
#: What stands in for a recipe's ImageNet-sized run, and nothing else: a narrow model of its `model`'s family, and
#: Fashion-MNIST subsets at 32x32 with a batch that fits them, for one epoch on the CPU. Every other setting is the
#: file's (docs/training.md, "timm's published recipes").
STAND_IN_MODELS = {
    'resnet50': ['--model', 'resnet18', '--model-kwargs', 'channels=(16,32,64,128)', 'stem_width=16',
                 '--norm-layer', 'patchnorm'],
    'convnext_tiny': ['--model', 'convnext_atto', '--model-kwargs', 'dims=(16,32,64,128)'],
    'deit_base_patch16_224': ['--model', 'deit_tiny_patch16_224', '--model-kwargs', 'img_size=32', 'patch_size=8',
                              'depth=2', 'embed_dim=48', 'num_heads=3'],
}
STAND_IN_DATA = ['--dataset', 'fashion-mnist', '--num-classes', '10', '--img-size', '32', '--train-subset', '64',
                 '--val-subset', '32', '-b', '32', '--epochs', '1', '-j', '0']
STOOD_IN = {'model', 'model_kwargs', 'norm_layer', 'dataset', 'num_classes', 'img_size', 'train_subset', 'val_subset',
            'batch_size', 'epochs', 'workers'}


@pytest.mark.parametrize('name', sorted(p.stem for p in RECIPES.glob('*.yaml')))
def test_published_recipe_runs_unchanged_through_finetune_config(name, tmp_path):
    """ResNet strikes back A1/A2/A3 (LAMB, BCE with a target threshold, repeated augmentation, RandAugment with
    increasing severity), ConvNeXt's and DeiT's recipes: every setting of the file reaches the run."""
    from timm_affinediv.commands import finetune
    file = RECIPES / f'{name}.yaml'
    recipe_args = yaml.safe_load(file.read_text())
    assert finetune.main(['--config', str(file), *STAND_IN_MODELS[recipe_args['model']], *STAND_IN_DATA,
                          '--output', str(tmp_path)]) == 0
    used = json.loads((tmp_path / 'train_config.json').read_text())
    taken = {k: v for k, v in recipe_args.items() if k in used and k not in STOOD_IN | {'device', 'resume', 'output',
                                                                                        'workers', 'log_interval',
                                                                                        'checkpoint_hist', 'amp_dtype'}}
    assert len(taken) > 90
    for key, value in taken.items():
        expected = None if value == '' and key not in ('dataset', 'interpolation', 'lr_base_scale') else value
        assert used[key] == expected, key
    assert used['amp_dtype'] is None  # train.py's default float16: the device's choice, bfloat16 on the CPU
    history = json.loads((tmp_path / 'metrics.json').read_text())
    assert len(history) == 1 and math.isfinite(history[0]['train_loss'])
    assert (tmp_path / 'model' / 'model.safetensors').is_file()


def test_posterize_to_zero_bits_gives_the_black_image_pillow_before_13_gave():
    """`-inc1` RandAugment keeps 4 - int(4 m / 10) bits: 0 from magnitude 10, which Pillow 13 refuses."""
    from PIL import Image, ImageOps
    from timm.data.auto_augment import AugmentOp, rand_augment_transform

    import timm_affinediv.data  # noqa: F401  installs the shim
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8))
    for img in (rgb, rgb.convert('L')):
        black = AugmentOp('PosterizeIncreasing', prob=1., magnitude=10)(img)
        assert (black.mode, black.size) == (img.mode, img.size) and not np.asarray(black).any()
        two_bits = AugmentOp('PosterizeIncreasing', prob=1., magnitude=5)(img)  # 4 - int(2.0) = 2 bits
        assert np.array_equal(np.asarray(two_bits), np.asarray(ImageOps.posterize(img, 2)))
    policy = rand_augment_transform('rand-n1-m9-mstd0.5-inc1', {})
    policy.ops = [op for op in policy.ops if 'Posterize' in op.name]
    for op in policy.ops:
        op.prob = 1.
    random.seed(0)  # timm draws the magnitudes from Python's random
    images = [policy(rgb) for _ in range(400)]  # m ~ N(9, 0.5): 2.3% of the draws reach 10 (docs/training.md)
    assert any(not np.asarray(img).any() for img in images)


@pytest.mark.filterwarnings('ignore:PlateauLRScheduler is deprecated:FutureWarning')
@pytest.mark.parametrize('metric', ['loss', 'top1'])
def test_eval_metric_picks_best_checkpoint_and_plateau_mode(tmp_path, metric):
    """train.py's --eval-metric: the best checkpoint and the plateau schedule follow it (loss: lower is better);
    --no-resume-opt resumes the weights without the optimiser state."""
    with pytest.raises(ConfigError, match='--sched-on-epochs'):
        TrainConfig(sched='plateau').validate()  # timm's plateau schedule steps per epoch only
    trainer = Trainer(recipe(tmp_path, epochs=2, train_subset=16, eval_metric=metric, sched='plateau',
                             sched_on_updates=False))
    assert trainer.scheduler.lr_scheduler.mode == ('min' if metric == 'loss' else 'max')
    scripted = iter([dict(loss=1.0, top1=50., top5=90., img_s=1.), dict(loss=0.5, top1=40., top5=90., img_s=1.)])
    trainer.evaluate = lambda model=None: next(scripted)
    trainer.fit()
    best = json.loads((tmp_path / 'checkpoints' / 'best.json').read_text())
    assert best['checkpoint'] == ('epoch-0001' if metric == 'loss' else 'epoch-0000')
    if metric == 'loss':
        assert Trainer(recipe(tmp_path, epochs=2, train_subset=16, resume=str(tmp_path))).optimizer.state
        assert not Trainer(recipe(tmp_path, epochs=2, train_subset=16, resume=str(tmp_path),
                                  no_resume_opt=True)).optimizer.state


def test_train_py_model_flags(tmp_path):
    """--gp / --bn-momentum / --bn-eps reach timm.create_model (as train.py passes them); --head-init-scale and
    --head-init-bias set the new head; an argument the architecture lacks is one clear error."""
    from timm_affinediv.train.trainer import create_train_model
    model = create_train_model(TrainConfig(model='tinynet_e', gp='max', bn_momentum=0.5, bn_eps=1e-3), in_chans=1)
    assert model.global_pool.pool_type == 'max'
    assert {(m.momentum, m.eps) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {(0.5, 1e-3)}
    with pytest.raises(ConfigError, match='bn_momentum'):
        create_train_model(TrainConfig(model='resnet18', bn_momentum=0.5), in_chans=1)
    trainer = Trainer(recipe(tmp_path, head_init_scale=0., head_init_bias=0.25))
    assert not trainer.model.fc.weight.any() and torch.all(trainer.model.fc.bias == 0.25)


def test_conversion_calibrates_on_a_stream(wds_dir, tmp_path):
    """`convert_to_folder(dataset='wds/...')` (as `timm-affinediv convert --dataset wds/...`) calibrates on the
    stream's first images, read with the model's eval transforms, holds out the next ones and distils on those after
    them (as many as the stream has), and the card names the stream."""
    import timm

    from timm_affinediv.convert import ConvertOptions, DistillOptions
    from timm_affinediv.model_io import convert_to_folder
    model = timm.create_model('resnet18', num_classes=10, in_chans=1, channels=(16, 32, 64, 128), stem_width=16,
                              pretrained_cfg_overlay=dict(input_size=(1, 32, 32), crop_pct=1.0)).eval()
    _, report, metrics = convert_to_folder(model, str(tmp_path / 'out'), dataset='wds/fmnist', data_dir=str(wds_dir),
                                           calib_images=16, heldout_images=8, distill_images=64, batch_size=8,
                                           eval_images=16,
                                           options=ConvertOptions(distill=DistillOptions(epochs=1, threshold=1)))
    assert (report.calibration_images, report.calibration_batches) == (16, 2) and report.layers
    assert report.heldout_images == 8 and report.distillation.images == 8 == metrics['distill_images']
    assert metrics['converted']['top1'] >= 0 and 'original' in metrics
    card = ' '.join((tmp_path / 'out' / 'README.md').read_text().split())
    assert 'on 16 wds/fmnist training images (2 batches, no labels)' in card, card
    assert 'The distillation images are 8 further wds/fmnist training images' in card, card

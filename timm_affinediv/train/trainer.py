"""The epoch loop of training and fine-tuning any timm model, at the standard of timm's `train.py`, as a library.

`TrainConfig` holds the settings (the fields mirror timm's `train.py` flags), `Trainer` runs them:

    result = Trainer(TrainConfig(model='resnet18', dataset='fashion-mnist', epochs=3, output='runs/r18')).fit()

Built on timm's factories and helpers, called as timm's `train.py` calls them: `create_optimizer_v2` with
`optimizer_kwargs`, `create_scheduler_v2` with `scheduler_kwargs`, `create_transform`, `Mixup`, the losses
(`SoftTargetCrossEntropy`, `BinaryCrossEntropy`, `LabelSmoothingCrossEntropy`), `ModelEmaV3`, `NativeScaler` /
`dispatch_clip_grad`, `accuracy`, `init_distributed_device_so`. Adds knowledge
distillation from a teacher, per-epoch evaluation (loss, top-1, top-5, images/s), CSV / JSON / PNG logs, and
atomic checkpoints (safetensors weights + optimizer, scheduler, EMA, step and RNG states) from which `resume`
reproduces an uninterrupted run. Under `torchrun` it trains with DistributedDataParallel; only rank 0 writes files.

A run of `epochs` may end inside an epoch (0.125: an eighth of the training split's images), its update-stepped
schedule spanning exactly its updates; `evaluations` spreads the evaluations (and checkpoints) over the run's updates
instead of at each epoch's end, and `stop_patience` / `stop_target` end it early on the evaluated metric.

The parts live beside it: `config` (settings, errors), `checkpoint` (checkpoint I/O), `distributed` (set-up),
`distill` (the distillation loss and teacher), `metrics` (evaluation, logs and plots).
"""
import dataclasses
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import timm
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file
from timm.data import Mixup
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.models import model_parameters
from timm.optim import create_optimizer_v2, optimizer_kwargs
from timm.scheduler import create_scheduler_v2, scheduler_kwargs
from timm.utils import ModelEmaV3, NativeScaler, dispatch_clip_grad, distribute_bn, random_seed
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from .._hub_folder import check_folder
from ..data import (
    BatchNormalizer,
    create_eval_loader,
    create_train_loader,
    dataset_class_names,
    dataset_num_classes,
    describe_split,
    is_fashion_mnist,
    is_stream,
    resolve_dataset,
    resolve_dataset_data_config,
    set_loader_epoch,
)
from ..files import atomic_dir, atomic_write, save_safetensors
from ..labels import label_config, with_labels
from ..layers.binding import bind_patchnorm
from .checkpoint import (
    CHECKPOINT_FORMAT,
    EMA_FILE,
    MODEL_FILE,
    STATE_FILE,
    load_weights,
    prune_checkpoints,
    read_weights,
    resolve_checkpoint,
    rng_state,
    set_rng_state,
)
from .config import (
    AMP_DTYPES,
    CheckpointError,
    ConfigError,
    NonFiniteLossError,
    TrainConfig,
    TrainingInterrupted,
    TrainResult,
)
from .distill import DistillationLoss, create_teacher
from .distributed import init_distributed
from .metrics import evaluate, write_metrics

__all__ = ['Trainer', 'create_train_model', 'create_train_loss', 'plateau_reached']

_logger = logging.getLogger(__name__)


def _classifier_classes(model: nn.Module, state_dict: Dict[str, torch.Tensor]) -> Optional[int]:
    """The class count of a checkpoint's head, found through the model's `pretrained_cfg['classifier']`."""
    classifier = getattr(model, 'pretrained_cfg', {}).get('classifier')
    weight = state_dict.get(f'{classifier}.weight') if isinstance(classifier, str) else None
    return int(weight.shape[0]) if weight is not None else None


def _head_classes(model: nn.Module) -> Optional[int]:
    num_classes = getattr(model, 'num_classes', None)
    return int(num_classes) if num_classes is not None else None


def create_train_model(cfg: TrainConfig, in_chans: int) -> nn.Module:
    """Create `cfg.model` with timm (`pretrained`, `norm_layer`, `in_chans`, `model_kwargs`) and load
    `cfg.initial_checkpoint`, its head sized as in the checkpoint (`Trainer` then checks it against the data).
    Otherwise `cfg.num_classes` sizes the head (timm drops a pretrained head of another size)."""
    kwargs = dict(cfg.model_kwargs)
    if cfg.norm_layer:
        kwargs['norm_layer'] = cfg.norm_layer
    kwargs.setdefault('in_chans', in_chans)
    if cfg.num_classes and not cfg.initial_checkpoint:
        kwargs.setdefault('num_classes', cfg.num_classes)
    train_py_args = dict(drop_rate=cfg.drop or None, drop_path_rate=cfg.drop_path, drop_block_rate=cfg.drop_block,
                         global_pool=cfg.gp, bn_momentum=cfg.bn_momentum, bn_eps=cfg.bn_eps)
    kwargs.update({k: v for k, v in train_py_args.items() if v is not None and k not in kwargs})
    if ':' not in cfg.model and not timm.is_model(cfg.model):  # 'hf-hub:' / 'local-dir:' names resolve later
        raise ConfigError(f"unknown model '{cfg.model}'; list the names with timm.list_models().")
    if cfg.model.startswith(('local-dir:', 'hf-hub:')):
        check_folder(cfg.model)  # timm would parse a broken config.json first, in a traceback
    try:
        model = timm.create_model(cfg.model, pretrained=cfg.pretrained, **kwargs)
    except TypeError as e:  # an argument the architecture lacks (e.g. --bn-momentum: EfficientNet-family models only)
        raise ConfigError(f"{cfg.model} does not take an argument given to it ({e}); leave out that flag or "
                          f"--model-kwargs key.") from e
    if cfg.initial_checkpoint:
        state_dict = read_weights(cfg.initial_checkpoint, 'initial checkpoint')
        classes = _classifier_classes(model, state_dict)
        if classes is not None and classes != _head_classes(model) and 'num_classes' not in cfg.model_kwargs:
            model = timm.create_model(cfg.model, **kwargs, num_classes=classes)
        load_weights(model, state_dict, cfg.initial_checkpoint, 'initial checkpoint')
    return model


@torch.no_grad()
def _init_head(model: nn.Module, scale: Optional[float], bias: Optional[float]) -> None:
    """train.py's `--head-init-scale` (`W, b <- scale W, scale b` of the classifier) and `--head-init-bias`
    (`b <- bias`)."""
    if scale is None and bias is None:
        return
    head = model.get_classifier() if hasattr(model, 'get_classifier') else None
    if not isinstance(getattr(head, 'weight', None), torch.Tensor):
        raise ConfigError(f'--head-init-scale / --head-init-bias need a classifier with weights; '
                          f'{type(model).__name__} has {type(head).__name__}.')
    if scale is not None:
        head.weight.mul_(scale)
        if head.bias is not None:
            head.bias.mul_(scale)
    if bias is not None and head.bias is not None:
        head.bias.fill_(bias)


def create_train_loss(cfg: TrainConfig) -> nn.Module:
    """The training loss timm's train.py picks: soft-target cross-entropy (or BCE) on mixup's soft targets,
    label-smoothed cross-entropy (or BCE) without mixup, plain cross-entropy without smoothing."""
    bce = dict(target_threshold=cfg.bce_target_thresh, sum_classes=cfg.bce_sum, pos_weight=cfg.bce_pos_weight)
    if cfg.mixup_active:  # the smoothing is in the mixed targets
        return BinaryCrossEntropy(**bce) if cfg.bce_loss else SoftTargetCrossEntropy()
    if cfg.bce_loss:
        return BinaryCrossEntropy(smoothing=cfg.smoothing, **bce)
    return LabelSmoothingCrossEntropy(cfg.smoothing) if cfg.smoothing > 0 else nn.CrossEntropyLoss()


def _match_head(model: nn.Module, dataset_classes: int, num_classes: Optional[int]) -> None:
    """Check the model head against the dataset; with `num_classes` set, reset a head that does not match."""
    if num_classes is not None and num_classes != dataset_classes:
        raise ConfigError(f'--num-classes {num_classes} does not match the dataset, which has {dataset_classes} '
                          f'classes; pass --num-classes {dataset_classes}.')
    head = _head_classes(model)
    if head is None or head == dataset_classes:
        return
    if num_classes is None:
        raise ConfigError(
            f'the model head has {head} classes but the dataset has {dataset_classes}; pass '
            f'--num-classes {dataset_classes} to replace the head by a new, untrained one.')
    if not hasattr(model, 'reset_classifier'):
        raise ConfigError(f'{type(model).__name__} has no reset_classifier(): build it with {dataset_classes} '
                          f'classes instead.')
    _logger.info(f'replacing the {head}-class head with a new {dataset_classes}-class one')
    model.reset_classifier(dataset_classes)
    bind_patchnorm(model)  # the new head is a plain Linear: a patchnorm slot before it corrects it again


def plateau_reached(values: Sequence[float], errors: Sequence[float], patience: int, noise: Optional[float] = None,
                    lower_is_better: bool = False) -> bool:
    """ Whether the last `patience` evaluations `values` all count against the best one before them.

    With `noise` None, an evaluation counts where it does not better the best. With `noise` k, it counts only where it
    is worse than the best `b` by more than k standard errors of the difference, `|v - b| > k sqrt(se_v^2 + se_b^2)`
    (`errors` the evaluations' standard errors): a curve flat within its noise never stops.
    """
    best_at = values.index(min(values) if lower_is_better else max(values))
    after = range(best_at + 1, len(values))
    if len(after) < patience:
        return False
    if noise is None:
        return True
    sign = 1. if lower_is_better else -1.
    return all(sign * (values[i] - values[best_at]) > noise * math.hypot(errors[i], errors[best_at])
               for i in after[-patience:])


class Trainer:
    """Runs a `TrainConfig`: builds data, model, teacher, optimiser, scheduler, EMA; trains, evaluates, checkpoints.

    Args:
        cfg: the run's settings.
        model: a ready model to train instead of creating `cfg.model` (its name is still `cfg.model`).
        teacher: a ready teacher module instead of creating `cfg.teacher`.

    Distributed (under `torchrun`): DistributedDataParallel, a DistributedSampler, metrics summed over ranks;
    rank 0 alone writes files. Interrupts (SIGINT / SIGTERM) stop at the next optimiser update that every rank
    reaches (each update in one process, each `log_interval` updates with several) and write a checkpoint there.
    """

    def __init__(self, cfg: TrainConfig, model: Optional[nn.Module] = None, teacher: Optional[nn.Module] = None):
        cfg.validate()
        self.cfg = cfg
        dataset = resolve_dataset(cfg.dataset, cfg.data_dir)  # None: the image folder at data_dir
        self.device, self.rank, self.world_size, self.distributed = init_distributed(cfg.device)
        self.is_primary = self.rank == 0
        self.amp_dtype = self._resolve_amp_dtype()
        random_seed(cfg.seed)  # the same initial weights on every rank

        asked_chans = cfg.in_chans or (cfg.input_size[0] if cfg.input_size else None)
        in_chans = 1 if is_fashion_mnist(dataset) else (asked_chans or 3)
        if asked_chans and asked_chans != in_chans:
            raise ConfigError(f'Fashion-MNIST has 1 channel, not {asked_chans} (--in-chans / --input-size).')
        model = model if model is not None else create_train_model(cfg, in_chans)
        if cfg.grad_checkpointing:
            model.set_grad_checkpointing(enable=True)
        self.data_config = resolve_dataset_data_config(
            dataset, model, in_chans, overrides=cfg.data_config_overrides())
        # the preprocessing the weights expect travels with them (config.json, resolve_data_config)
        model.pretrained_cfg = {**getattr(model, 'pretrained_cfg', {}), **self.data_config}
        loader_args = dict(workers=cfg.workers, rank=self.rank, world_size=self.world_size,
                           pin_memory=self.device.type == 'cuda')
        self.train_loader = create_train_loader(
            dataset, cfg.data_dir, self.data_config, cfg.batch_size, split=cfg.train_split,
            subset=cfg.train_subset, num_samples=cfg.train_num_samples, seed=cfg.seed,
            augment=cfg.transform_kwargs(), prefetcher=not cfg.no_prefetcher,
            mixup=cfg.mixup_kwargs(cfg.num_classes) if cfg.mixup_active else None, aug_repeats=cfg.aug_repeats,
            **loader_args)
        self.val_loader = create_eval_loader(
            dataset, cfg.data_dir, self.data_config, cfg.validation_batch_size or cfg.batch_size,
            split=cfg.val_split, subset=cfg.val_subset, num_samples=cfg.val_num_samples, **loader_args)
        self.stream = is_stream(self.train_loader.dataset)
        self.num_classes = dataset_num_classes(self.train_loader.dataset) or cfg.num_classes
        if self.num_classes is None:
            raise ConfigError(f"dataset '{dataset}' does not say its number of classes: pass --num-classes.")
        _match_head(model, self.num_classes, cfg.num_classes)
        # the class names travel with the weights too (config.json's label_names): the training set's, no others
        model.pretrained_cfg = with_labels(
            model.pretrained_cfg, label_config(dataset_class_names(self.train_loader.dataset), self.num_classes))
        _init_head(model, cfg.head_init_scale, cfg.head_init_bias)
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError('the model has no trainable parameters (all have requires_grad=False).')
        self.model = model.to(self.device)
        self.memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
        if cfg.channels_last:
            self.model.to(memory_format=torch.channels_last)
        random_seed(cfg.seed, self.rank)  # each rank its own augmentation / dropout stream
        self.model_args = {**cfg.model_kwargs, 'in_chans': in_chans, 'num_classes': self.num_classes}
        if cfg.norm_layer:
            self.model_args['norm_layer'] = cfg.norm_layer

        self.teacher = self._create_teacher(teacher, in_chans)
        self.lr = cfg.resolve_lr(self.world_size)
        self.optimizer = create_optimizer_v2(
            self.model, **optimizer_kwargs(dataclasses.replace(cfg, lr=self.lr)), **cfg.opt_kwargs)
        self.updates_per_epoch = math.ceil(len(self.train_loader) / cfg.grad_accum_steps)
        self.scheduler, self.total_updates = self._create_scheduler()
        self.num_epochs = math.ceil(self.total_updates / self.updates_per_epoch)
        # the updates after which the run evaluates besides its end (None: at each epoch's end)
        self.evaluation_points = None if cfg.evaluations is None else {
            round(k * self.total_updates / cfg.evaluations) for k in range(1, cfg.evaluations + 1)} - {0}
        if self.scheduler is None:  # timm's schedulers apply the layer-decay scales; without one, apply them here
            for group in self.optimizer.param_groups:
                group['lr'] = self.lr * group.get('lr_scale', 1.)
        self.loss_scaler = NativeScaler(self.device.type) if self.amp_dtype == torch.float16 else None
        # with the prefetcher, the loader mixes (train.py's FastCollateMixup) and BatchNormalizer finishes each batch
        self.mixup_fn = Mixup(**cfg.mixup_kwargs(self.num_classes)) \
            if cfg.mixup_active and cfg.no_prefetcher else None
        self.normalize_batch = None if cfg.no_prefetcher else BatchNormalizer(
            self.data_config, self.device, cfg.reprob, cfg.remode, cfg.recount, self.memory_format)
        base_loss = create_train_loss(cfg)
        self.train_loss_fn = DistillationLoss(base_loss, cfg.distill_weight, cfg.distill_temperature) \
            if self.teacher is not None else base_loss
        self.ddp_model = DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == 'cuda' else None) \
            if self.distributed else self.model
        # compiled for training only; checkpoints and evaluation use the module itself, its names unprefixed
        self.train_model = torch.compile(self.ddp_model, backend=cfg.torchcompile, mode=cfg.torchcompile_mode) \
            if cfg.torchcompile else self.ddp_model
        # EMA of the unwrapped model, made after DDP has broadcast rank 0's weights so every rank starts alike
        self.ema = ModelEmaV3(
            self.model, decay=cfg.model_ema_decay, use_warmup=cfg.model_ema_warmup) if cfg.model_ema else None

        self.epoch = 0  # epoch in progress
        self.update_in_epoch = 0  # optimiser updates done in it
        self.num_updates = 0
        self.history: List[Dict[str, float]] = []
        self.best: Optional[Dict[str, float]] = None
        self._meter = torch.zeros(2, dtype=torch.float64, device=self.device)  # epoch loss sum, samples
        self._pending_rng: Optional[Dict[str, Any]] = None
        self._stop_requested = False
        self.last_checkpoint: Optional[str] = None
        self.stopped: Optional[str] = None  # what the stop rule ended the run on ('target', 'plateau')
        self.checkpoint_dir = os.path.join(cfg.output, 'checkpoints')
        if cfg.resume:
            self.load_checkpoint(resolve_checkpoint(cfg.resume))

    # ---- set-up helpers
    def _create_scheduler(self) -> Tuple[Any, int]:
        """timm's schedule and the run's length in optimiser updates. Whole epochs go to `create_scheduler_v2` as
        train.py passes them; a run ending inside an epoch is given to it in updates (its epoch-valued settings times
        the updates of an epoch), so that the schedule spans exactly its `round(epochs x updates per epoch)` updates."""
        cfg, per_epoch = self.cfg, self.updates_per_epoch
        kwargs = scheduler_kwargs(cfg)
        if float(cfg.epochs).is_integer():
            scheduler, num_epochs = create_scheduler_v2(
                self.optimizer, **dict(kwargs, num_epochs=int(cfg.epochs)), updates_per_epoch=per_epoch)
            return scheduler, int(num_epochs) * per_epoch
        fraction_of_schedule = cfg.sched in ('wsd', 'rsqrt') and cfg.decay_epochs < 1  # timm's, whatever the unit
        kwargs.update(
            num_epochs=max(1, round(cfg.epochs * per_epoch)), warmup_epochs=round(cfg.warmup_epochs * per_epoch),
            cooldown_epochs=round(cfg.cooldown_epochs * per_epoch),
            decay_epochs=cfg.decay_epochs if fraction_of_schedule else cfg.decay_epochs * per_epoch,
            decay_milestones=[round(m * per_epoch) for m in cfg.decay_milestones])
        scheduler, updates = create_scheduler_v2(self.optimizer, **kwargs, updates_per_epoch=1)
        return scheduler, int(updates)

    def _resolve_amp_dtype(self) -> Optional[torch.dtype]:
        if not self.cfg.amp:
            return None
        name = self.cfg.amp_dtype or ('float16' if self.device.type == 'cuda' else 'bfloat16')
        if name == 'float16' and self.device.type != 'cuda':
            raise ConfigError('float16 mixed precision needs CUDA; use --amp-dtype bfloat16 on CPU.')
        return AMP_DTYPES[name]

    def _create_teacher(self, teacher: Optional[nn.Module], in_chans: int) -> Optional[nn.Module]:
        cfg = self.cfg
        if teacher is None and not cfg.teacher:
            return None
        if teacher is None:
            kwargs = {'in_chans': in_chans, 'num_classes': self.num_classes, **cfg.teacher_kwargs}
            teacher = create_teacher(cfg.teacher, cfg.teacher_checkpoint, **kwargs)
        else:
            teacher = create_teacher(teacher)
        head = _head_classes(teacher)
        if head is not None and head != self.num_classes:
            raise ConfigError(f'the teacher predicts {head} classes but the dataset has {self.num_classes}.')
        return teacher.to(self.device)

    def _autocast(self):
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    @property
    def final_model(self) -> nn.Module:
        """The weights a run publishes: the EMA weights when EMA is on, else the trained model."""
        return self.ema.module if self.ema is not None else self.model

    @property
    def images_seen(self) -> int:
        """The training images taken so far, over all processes: the batches of every update (an epoch's last one
        may take fewer than `grad_accum_steps`)."""
        epochs, updates = divmod(self.num_updates, self.updates_per_epoch)
        batches = len(self.train_loader)
        return (epochs * batches + min(updates * self.cfg.grad_accum_steps, batches)) * self.cfg.batch_size \
            * self.world_size

    # ---- training
    def _clipped_parameters(self):
        """What gradient clipping acts on, as in timm's train.py: every parameter, less the classifier's under
        adaptive clipping (AGC clips relative to the weight's norm, and a zero classifier would never move)."""
        return model_parameters(self.model, exclude_head='agc' in self.cfg.clip_mode)

    def _backward(self, loss: torch.Tensor, need_update: bool) -> None:
        cfg = self.cfg
        if self.loss_scaler is not None:
            self.loss_scaler(loss, self.optimizer, clip_grad=cfg.clip_grad, clip_mode=cfg.clip_mode,
                             parameters=self._clipped_parameters(), need_update=need_update)
            return
        loss.backward()
        if need_update:
            if cfg.clip_grad is not None:
                dispatch_clip_grad(self._clipped_parameters(), cfg.clip_grad, mode=cfg.clip_mode)
            self.optimizer.step()

    def _sync_check(self, epoch: int) -> bool:
        """At a point all ranks reach: raise on a non-finite loss, return True if a stop was requested."""
        flags = torch.stack([self._meter[0], torch.tensor(float(self._stop_requested), device=self.device,
                                                          dtype=torch.float64)])
        if self.distributed:
            dist.all_reduce(flags)
        if not math.isfinite(flags[0].item()):
            raise NonFiniteLossError(
                f'the training loss became {flags[0].item()} in epoch {epoch} (update {self.num_updates}); stopped. '
                f'The last good checkpoint is under {self.checkpoint_dir}: lower --lr, add --clip-grad, or check the '
                f'data.')
        return flags[1].item() > 0

    def train_one_epoch(self, epoch: int) -> Dict[str, float]:
        """Train one epoch, from update `self.update_in_epoch` when resumed mid-epoch, to its end or the run's last
        update, evaluating at the `evaluation_points` inside it; return its train loss and images/s (since the last
        evaluation inside it), or {} where the stop rule ended the run inside it. Raises `_StopRequested` at an update
        boundary when a stop was requested."""
        cfg = self.cfg
        accum = cfg.grad_accum_steps
        num_batches = len(self.train_loader)  # for a stream, its estimate of itself
        set_loader_epoch(self.train_loader, epoch, cfg.seed, self.rank)
        if cfg.mixup_off_epoch and epoch >= cfg.mixup_off_epoch:
            for mixer in (self.mixup_fn, self.train_loader.collate_fn):
                if hasattr(mixer, 'mixup_enabled'):
                    mixer.mixup_enabled = False
        start = time.perf_counter()  # the loader workers' start-up counts, as in timm's train.py
        loader_iter = iter(self.train_loader)
        first_batch = self.update_in_epoch * accum
        for _ in range(first_batch):  # replay the batches a resumed checkpoint had already used
            next(loader_iter)
        if first_batch:
            start = time.perf_counter()  # a resumed epoch's rate leaves the replay out
        if self._pending_rng is not None:
            set_rng_state(self._pending_rng)
            self._pending_rng = None
        if first_batch == 0 and self.evaluation_points is None:  # else the meter spans the evaluations' periods
            self._meter.zero_()
        self.ddp_model.train()
        group_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        group_samples = 0
        batch_size = cfg.batch_size
        bars = self._progress_bars()
        progress = tqdm(
            total=num_batches, initial=first_batch, desc=f'train {epoch}', unit='batch', leave=False,
            disable=not bars, dynamic_ncols=True)
        batch_idx = first_batch - 1
        # a run that ends inside this epoch stops at its last update
        end_batch = min(num_batches, first_batch + (self.total_updates - self.num_updates) * accum)
        if self.stream:  # its length is an estimate: cut it only where the run ends inside an epoch
            cut = not float(cfg.epochs).is_integer()
            batches = _with_last(itertools.islice(loader_iter, end_batch - first_batch) if cut else loader_iter)
        else:
            batches = ((next(loader_iter), i + 1 == end_batch) for i in range(first_batch, end_batch))
        period_start, period_first = start, first_batch  # the batches since the last evaluation in this epoch
        with progress:
            for batch_idx, ((x, target), is_last) in enumerate(batches, start=first_batch):
                if self.normalize_batch is not None:
                    x = self.normalize_batch(x)
                else:
                    x = x.to(self.device, non_blocking=True, memory_format=self.memory_format)
                target = target.to(self.device, non_blocking=True)
                if self.mixup_fn is not None:
                    x, target = self.mixup_fn(x, target)
                update_idx = batch_idx // accum
                group_size = max(1, min(accum, end_batch - update_idx * accum))
                need_update = (batch_idx + 1) % accum == 0 or is_last
                sync = self.ddp_model.no_sync() if self.distributed and not need_update else nullcontext()
                with sync:
                    with self._autocast():
                        output = self.train_model(x)
                        if self.teacher is not None:
                            with torch.no_grad():
                                teacher_output = self.teacher(x)
                            loss = self.train_loss_fn(output, teacher_output, target)
                        else:
                            loss = self.train_loss_fn(output, target)
                    self._backward(loss / group_size, need_update)
                group_loss += loss.detach() * batch_size
                group_samples += batch_size
                progress.update()
                if not need_update:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                self.num_updates += 1
                self.update_in_epoch += 1
                if self.ema is not None:
                    self.ema.update(self.model, step=self.num_updates)
                if self.scheduler is not None:
                    self.scheduler.step_update(num_updates=self.num_updates)
                self._meter[0] += group_loss
                self._meter[1] += group_samples
                group_loss.zero_()
                group_samples = 0
                if self.evaluation_points and self.num_updates in self.evaluation_points and not is_last:
                    self._sync_check(epoch)  # a non-finite loss stops before the evaluation
                    is_best = self._evaluate(epoch, self._train_metrics(batch_idx + 1 - period_first, period_start),
                                             period_start)
                    self._after_evaluation(f'epoch-{epoch:04d}-{self.update_in_epoch:06d}', is_best)
                    if self.stopped:
                        return {}
                    period_start, period_first = time.perf_counter(), batch_idx + 1
                if self.update_in_epoch % cfg.log_interval == 0:
                    stop = self._sync_check(epoch)  # syncs ranks: the only per-step host sync
                    if bars:
                        progress.set_postfix(loss=f'{loss.item():.4f}', lr=f'{self._lr():.2e}')
                    elif self.is_primary:
                        _logger.info(f'train {epoch} [{batch_idx + 1}/{num_batches}] loss {loss.item():.4f} '
                                     f'lr {self._lr():.3e}')
                else:
                    stop = self._stop_requested and not self.distributed
                if stop:
                    raise _StopRequested()
        self._sync_check(epoch)  # also waits for the device, so the time below is the real one
        return self._train_metrics(batch_idx + 1 - period_first, period_start)

    def _train_metrics(self, batches: int, since: float) -> Dict[str, float]:
        """The mean training loss of the meter and the images/s of `batches` batches (each process's) since `since`,
        over all ranks."""
        meter = self._meter.clone()
        if self.distributed:
            dist.all_reduce(meter)
        return dict(train_loss=(meter[0] / meter[1]).item(),
                    train_img_s=batches * self.cfg.batch_size * self.world_size / (time.perf_counter() - since))

    def _progress_bars(self) -> bool:
        """Progress bars on rank 0 when `cfg.progress` says so, or, left unset, when they would go to a terminal
        (tqdm writes to stderr); otherwise the training loop logs a line every `log_interval` updates."""
        wanted = self.cfg.progress if self.cfg.progress is not None else sys.stderr.isatty()
        return self.is_primary and wanted

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]['lr']

    def evaluate(self, model: Optional[nn.Module] = None) -> Dict[str, float]:
        """Loss, top-1, top-5 (%) and images/s of `model` (default: the trained model) on the validation set,
        summed over all ranks."""
        return evaluate(model if model is not None else self.model, self.val_loader, device=self.device,
                        autocast=self._autocast, distributed=self.distributed,
                        progress=self._progress_bars(), memory_format=self.memory_format)

    def _history_key(self, metric: str) -> str:
        """The history's key of an evaluation metric: of the EMA weights where there are some (train.py's choice)."""
        return f"{'ema_' if self.ema is not None else ''}val_{metric}"

    @property
    def _metric_key(self) -> str:
        return self._history_key(self.cfg.eval_metric)

    def _evaluate(self, epoch: int, train_metrics: Dict[str, float], since: float) -> bool:
        """Evaluate the model (and its EMA), add the metrics to the history and reset the training meter; returns
        whether it is the best evaluation so far. `epoch` in the history is the epoch's index, or with `evaluations`
        the epochs trained (0.25: a quarter of the first)."""
        if self.distributed:
            distribute_bn(self.model, self.world_size, reduce=True)
        position = epoch if self.evaluation_points is None else round(self.num_updates / self.updates_per_epoch, 4)
        metrics = dict(epoch=position, updates=self.num_updates, images=self.images_seen, lr=self._lr(),
                       **train_metrics)
        metrics.update({f'val_{k}': v for k, v in self.evaluate().items()})
        if self.ema is not None:
            metrics.update({f'ema_val_{k}': v for k, v in self.evaluate(self.ema.module).items()})
        metrics['epoch_time_s'] = time.perf_counter() - since
        self.history.append(metrics)
        self._meter.zero_()
        key, lower_is_better = self._metric_key, self.cfg.eval_metric == 'loss'
        is_best = self.best is None or (metrics[key] < self.best[key] if lower_is_better else
                                        metrics[key] > self.best[key])
        if is_best:
            self.best = dict(metrics)
        return is_best

    def _after_evaluation(self, checkpoint: str, is_best: bool) -> None:
        """Write the checkpoint and the logs of the evaluation just made, and apply the stop rule to it."""
        self.save_checkpoint(checkpoint, is_best=is_best)
        metrics = self.history[-1]
        if self.is_primary:
            write_metrics(self.history, self.cfg.output)
            _logger.info(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in metrics.items()))
        self.stopped = self._stop_reason()
        if self.stopped and self.is_primary:
            _logger.info(f'stopped by the {self.stopped} rule after {self.num_updates} of {self.total_updates} '
                         f'updates ({self.images_seen} images): {self._metric_key} {metrics[self._metric_key]:.4g}')

    def _stop_reason(self) -> Optional[str]:
        """'target' where the last evaluation reached `stop_target`, 'plateau' where `plateau_reached` says so of the
        history, else None: a function of the history, so a resumed run agrees."""
        cfg = self.cfg
        if not self.history:
            return None
        target_metric = cfg.stop_target_metric or cfg.eval_metric
        last = self.history[-1][self._history_key(target_metric)]
        if cfg.stop_target is not None and (last <= cfg.stop_target if target_metric == 'loss' else
                                            last >= cfg.stop_target):
            return 'target'
        values = [h[self._metric_key] for h in self.history]
        lower_is_better = cfg.eval_metric == 'loss'
        if cfg.stop_patience is not None and plateau_reached(
                values, [h.get(f'{self._metric_key}_se', 0.) for h in self.history], cfg.stop_patience,
                cfg.stop_noise, lower_is_better):
            return 'plateau'
        return None

    def _end_epoch(self, epoch: int, train_metrics: Dict[str, float], epoch_start: float) -> None:
        """Evaluate (with `evaluations`: where the epoch's end is one of their points, or the run's), step the
        scheduler, and write the checkpoint and logs of a finished epoch."""
        points = self.evaluation_points
        if points is not None and self.num_updates not in points and epoch + 1 < self.num_epochs:
            self.epoch, self.update_in_epoch = epoch + 1, 0
            return
        checkpoint = f'epoch-{epoch:04d}' if points is None else f'epoch-{epoch:04d}-{self.update_in_epoch:06d}'
        is_best = self._evaluate(epoch, train_metrics, epoch_start)
        if self.scheduler is not None:
            self.scheduler.step(epoch + 1, self.history[-1][self._metric_key])
        self.epoch, self.update_in_epoch = epoch + 1, 0
        self._after_evaluation(checkpoint, is_best)

    def fit(self) -> TrainResult:
        """Train from the current state to the run's last update, or until the stop rule ends it (with the plateau
        rule, the best evaluation's weights are the final ones); write them as `<output>/model.safetensors`.

        Raises `TrainingInterrupted` (after writing a checkpoint) on Ctrl-C / SIGTERM, `NonFiniteLossError` on a
        NaN / infinite loss (the last good checkpoint stays the latest one).
        """
        if self.is_primary:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
            atomic_write(os.path.join(self.cfg.output, 'train_config.json'),
                               json.dumps(dataclasses.asdict(self.cfg), indent=2, default=str))
        self.stopped = self._stop_reason()  # a resumed run whose last evaluation the rule stopped on
        with self._stop_on_signals():
            for epoch in range(self.epoch, self.num_epochs):
                if self.stopped:
                    break
                epoch_start = time.perf_counter()
                try:
                    train_metrics = self.train_one_epoch(epoch)
                except (_StopRequested, KeyboardInterrupt) as e:
                    raise TrainingInterrupted(self._save_interrupt_checkpoint(
                        epoch, at_sync_point=isinstance(e, _StopRequested))) from None
                if self.stopped:
                    break
                self._end_epoch(epoch, train_metrics, epoch_start)
                if epoch + 1 < self.num_epochs and not self.stopped and self._sync_check(epoch):
                    raise TrainingInterrupted(self.last_checkpoint)  # a stop asked for during evaluation
        if self.stopped == 'plateau':
            self._restore_best()
        weights_file = os.path.join(self.cfg.output, MODEL_FILE)
        if self.is_primary:
            save_safetensors(self.final_model.state_dict(), weights_file)
        self._barrier()
        final = self.best if self.stopped == 'plateau' else (self.history[-1] if self.history else {})
        return TrainResult(
            model=self.final_model, model_name=self.cfg.model, model_args=dict(self.model_args),
            metrics=dict(final), best_metrics=dict(self.best or {}),
            history=list(self.history), output_dir=self.cfg.output, weights_file=weights_file,
            eval_set=describe_split(self.val_loader.dataset, self.cfg.dataset or self.cfg.data_dir, self.cfg.val_split),
            images=self.images_seen, stopped=self.stopped)

    def _restore_best(self) -> None:
        """Load the weights (and EMA weights) of the best evaluation's checkpoint, `checkpoints/best.json`'s."""
        self._barrier()  # rank 0 wrote it
        try:
            with open(os.path.join(self.checkpoint_dir, 'best.json')) as f:
                path = os.path.join(self.checkpoint_dir, json.load(f)['checkpoint'])
            self.model.load_state_dict(load_file(os.path.join(path, MODEL_FILE)))
            if self.ema is not None:
                self.ema.module.load_state_dict(load_file(os.path.join(path, EMA_FILE)))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f'the best checkpoint under {self.checkpoint_dir} is unreadable ({e}); its weights '
                                  'are the run\'s result: resume from a copy of the run folder that holds it.') from e
        _logger.info(f'the weights of the best evaluation ({path}) are the final ones')

    def _save_interrupt_checkpoint(self, epoch: int, at_sync_point: bool) -> Optional[str]:
        """Checkpoint at the last completed update. A raw KeyboardInterrupt can hit any rank anywhere, so then
        only this rank's RNG state is kept, and nothing is written if the loss had already gone non-finite.
        A stream cannot be wound forward to a batch: its run keeps the last epoch's checkpoint instead."""
        if self.stream:
            _logger.warning(f'streamed dataset: no checkpoint inside epoch {epoch}; --resume continues from the start '
                            f'of epoch {epoch} ({self.last_checkpoint or "from scratch: no epoch finished"}).')
            return self.last_checkpoint
        if not math.isfinite(self._meter[0].item()):
            _logger.error('interrupted with a non-finite training loss: no checkpoint written.')
            return None
        return self.save_checkpoint(f'interrupt-{epoch:04d}-{self.update_in_epoch:06d}', collective=at_sync_point)

    @contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGINT / SIGTERM set a flag the training loop checks at update boundaries; a second one acts at once."""
        def request_stop(signum, frame):
            _logger.warning(f'{signal.Signals(signum).name} received: stopping after this update, writing a '
                            f'checkpoint (send it again to stop at once).')
            self._stop_requested = True
            signal.signal(signum, previous[signum])

        try:
            previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:  # not the main thread: signals stay as they are
            previous = {}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self._stop_requested = False

    # ---- checkpoints and logs
    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def _train_state(self, collective: bool) -> Dict[str, Any]:
        rank_state = dict(rng=rng_state(), meter=self._meter.cpu())
        if collective and self.distributed:
            rank_list: List[Any] = [None] * self.world_size
            dist.all_gather_object(rank_list, rank_state)
        else:
            rank_list = [rank_state]
        return dict(
            format=CHECKPOINT_FORMAT, model=self.cfg.model, num_classes=self.num_classes,
            world_size=self.world_size, seed=self.cfg.seed, batch_size=self.cfg.batch_size,
            grad_accum_steps=self.cfg.grad_accum_steps,
            epoch=self.epoch, update_in_epoch=self.update_in_epoch, num_updates=self.num_updates,
            optimizer=self.optimizer.state_dict(),
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            loss_scaler=self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            ranks=rank_list, history=self.history, best=self.best,
        )

    def save_checkpoint(self, name: str, is_best: bool = False, collective: bool = True) -> Optional[str]:
        """Write `checkpoints/<name>/` (model / EMA safetensors + `train_state.pt`) atomically, point
        `checkpoints/last.json` (and `best.json`) at it, and prune older ones. Rank 0 writes; returns its path.
        With `collective` (all ranks call it) every rank's RNG state is kept; without, only this rank's."""
        state = self._train_state(collective)
        path = os.path.join(self.checkpoint_dir, name)
        if self.is_primary:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
            with atomic_dir(path) as tmp:
                save_safetensors(self.model.state_dict(), os.path.join(tmp, MODEL_FILE))
                if self.ema is not None:
                    save_safetensors(self.ema.module.state_dict(), os.path.join(tmp, EMA_FILE))
                torch.save(state, os.path.join(tmp, STATE_FILE))
            pointer = json.dumps(dict(checkpoint=name, epoch=self.epoch, update_in_epoch=self.update_in_epoch))
            atomic_write(os.path.join(self.checkpoint_dir, 'last.json'), pointer)
            if is_best:
                atomic_write(os.path.join(self.checkpoint_dir, 'best.json'), pointer)
            prune_checkpoints(self.checkpoint_dir, self.cfg.checkpoint_hist)
        if collective:
            self._barrier()
        self.last_checkpoint = path
        return path

    def load_checkpoint(self, path: str) -> None:
        """Restore model, EMA, optimiser, scheduler, scaler, counters, history and RNG states from a checkpoint
        folder, raising `CheckpointError` when it is unreadable or belongs to another model."""
        try:
            state = torch.load(os.path.join(path, STATE_FILE), map_location='cpu', weights_only=True)
            weights = load_file(os.path.join(path, MODEL_FILE))
            ema_weights = load_file(os.path.join(path, EMA_FILE)) if self.ema is not None else None
        except Exception as e:  # truncated / garbage files raise many different types
            raise CheckpointError(
                f'checkpoint {path} is unreadable ({type(e).__name__}: {e}); it may be truncated. Resume from another '
                f'folder under {os.path.dirname(path)}, or start a new run in another --output.') from e
        if not isinstance(state, dict) or state.get('format') != CHECKPOINT_FORMAT:
            raise CheckpointError(f'{path} is not a checkpoint of this trainer (format {CHECKPOINT_FORMAT}).')
        if state['model'] != self.cfg.model or state['num_classes'] != self.num_classes:
            raise CheckpointError(
                f"checkpoint {path} is of model '{state['model']}' with {state['num_classes']} classes, this run is "
                f"'{self.cfg.model}' with {self.num_classes}; resume with the same --model / --num-classes, or start "
                f"a new --output.")
        try:
            self.model.load_state_dict(weights, strict=True)
            if self.ema is not None:
                self.ema.module.load_state_dict(ema_weights, strict=True)
            if not self.cfg.no_resume_opt:
                self.optimizer.load_state_dict(state['optimizer'])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f'checkpoint {path} does not match this model or optimiser ({e}); resume with the settings it was '
                f'written with (--model, --norm-layer, --opt, ...), or start a new --output.') from e
        if self.scheduler is not None and state['scheduler'] is not None:
            self.scheduler.load_state_dict(state['scheduler'])
        if self.loss_scaler is not None and state['loss_scaler'] is not None and not self.cfg.no_resume_opt:
            self.loss_scaler.load_state_dict(state['loss_scaler'])
        if self.cfg.no_resume_opt:
            _logger.warning('resuming without the optimiser state (--no-resume-opt): the run will not reproduce an '
                            'uninterrupted one.')
        for key in ('seed', 'batch_size', 'grad_accum_steps', 'world_size'):
            current = getattr(self.cfg, key, None) if key != 'world_size' else self.world_size
            if state[key] != current:
                _logger.warning(f'resuming with {key}={current} where the checkpoint had {state[key]}: the run will '
                                f'not reproduce an uninterrupted one.')
        if self.stream and state['update_in_epoch']:
            raise CheckpointError(f'checkpoint {path} is inside epoch {state["epoch"]}, but a streamed dataset resumes '
                                  f'only at epoch boundaries: resume from an epoch-* checkpoint.')
        self.epoch, self.update_in_epoch, self.num_updates = state['epoch'], state['update_in_epoch'], \
            state['num_updates']
        self.history, self.best = state['history'], state['best']
        ranks = state['ranks']
        if len(ranks) == self.world_size or self.rank < len(ranks):
            rank_state = ranks[self.rank] if self.rank < len(ranks) else ranks[0]
            self._pending_rng = rank_state['rng']
            self._meter.copy_(rank_state['meter'])
        self.last_checkpoint = path
        _logger.info(f'resumed from {path}: epoch {self.epoch}, update {self.update_in_epoch} of it')
        if self.stream:
            _logger.info(f'streamed dataset: epoch {self.epoch} starts from its beginning, the stream reshuffled for '
                         f'it; the run is equivalent to, not bit for bit, an uninterrupted one.')


def _with_last(iterator: Iterator[Any]) -> Iterator[Tuple[Any, bool]]:
    """Each item with whether it is the last: a stream's true length shows only at its end."""
    try:
        item = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield item, False
        item = following
    yield item, True


class _StopRequested(Exception):
    """Raised inside the training loop at an update boundary when a stop was requested."""

"""Training and fine-tuning of any timm model, at the standard of timm's `train.py`, as a library.

`TrainConfig` holds the settings (the fields mirror timm's `train.py` flags), `Trainer` runs them:

    result = Trainer(TrainConfig(model='resnet18', num_classes=10, epochs=3, output='runs/r18')).fit()

Built on timm's factories and helpers: `create_optimizer_v2`, `create_scheduler_v2`, `LabelSmoothingCrossEntropy`,
`ModelEmaV3`, `NativeScaler` / `dispatch_clip_grad`, `accuracy`, `init_distributed_device_so`. Adds knowledge
distillation from a teacher, per-epoch evaluation (loss, top-1, top-5, images/s), CSV / JSON / PNG logs, and
atomic checkpoints (safetensors weights + optimizer, scheduler, EMA, step and RNG states) from which `resume`
reproduces an uninterrupted run. Under `torchrun` it trains with DistributedDataParallel; only rank 0 writes files.
"""
import csv
import dataclasses
import io
import json
import logging
import math
import os
import random
import shutil
import signal
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, NativeScaler, accuracy, dispatch_clip_grad, distribute_bn, random_seed
from timm.utils.distributed import init_distributed_device_so
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from ..layers.binding import bind_patchnorm
from ..data import (
    create_eval_loader, create_train_loader, dataset_num_classes, is_fashion_mnist, resolve_dataset_data_config,
    set_loader_epoch,
)

__all__ = [
    'TrainConfig', 'Trainer', 'TrainResult', 'TrainingError', 'ConfigError', 'CheckpointError',
    'NonFiniteLossError', 'TrainingInterrupted', 'DistillationLoss', 'create_train_model', 'create_teacher',
    'resolve_checkpoint', 'plot_history', 'evaluate',
]

_logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
_STATE_FILE = 'train_state.pt'
_MODEL_FILE = 'model.safetensors'
_EMA_FILE = 'ema.safetensors'
_AMP_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}


class TrainingError(RuntimeError):
    """Base class of the errors a training run reports to its user."""


class ConfigError(TrainingError, ValueError):
    """Settings that cannot work together (e.g. a head whose class count does not match the dataset)."""


class CheckpointError(TrainingError):
    """A checkpoint that cannot be read, or was written for another model or run."""


class NonFiniteLossError(TrainingError):
    """The training loss became NaN or infinite; the last good checkpoint is left as it was."""


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C / SIGTERM after writing a checkpoint (`checkpoint` is its folder, or None)."""

    def __init__(self, checkpoint: Optional[str]):
        super().__init__(f'training interrupted, checkpoint written to {checkpoint}' if checkpoint else
                         'training interrupted')
        self.checkpoint = checkpoint


@dataclass
class TrainConfig:
    """Settings of a training run; field names follow timm's `train.py` flags (`--grad-accum-steps` ->
    `grad_accum_steps`). `model_kwargs` go to `timm.create_model` (with `norm_layer` / `in_chans` / `num_classes`)."""
    # model
    model: str = 'resnet18'
    pretrained: bool = False
    initial_checkpoint: Optional[str] = None
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    norm_layer: Optional[str] = None
    num_classes: Optional[int] = None
    in_chans: Optional[int] = None
    # data
    dataset: str = 'fashion-mnist'
    data_dir: Optional[str] = None
    train_split: str = 'train'
    val_split: str = 'validation'
    img_size: Optional[int] = None
    train_subset: Optional[int] = None
    val_subset: Optional[int] = None
    batch_size: int = 128
    validation_batch_size: Optional[int] = None
    workers: int = 2
    no_aug: bool = False
    scale: Optional[Tuple[float, float]] = (0.75, 1.0)  # random-resized-crop area; milder than timm's (0.08, 1)
    hflip: float = 0.5
    color_jitter: float = 0.
    # optimisation
    epochs: int = 10
    opt: str = 'adamw'
    lr: float = 1e-3
    momentum: float = 0.9
    weight_decay: float = 0.05
    sched: str = 'cosine'
    sched_on_updates: bool = True
    warmup_epochs: int = 0
    warmup_lr: float = 1e-5
    min_lr: float = 0.
    smoothing: float = 0.1
    amp: bool = False
    amp_dtype: Optional[str] = None  # None: bfloat16 on CPU, float16 on CUDA
    grad_accum_steps: int = 1
    clip_grad: Optional[float] = None
    clip_mode: str = 'norm'
    model_ema: bool = False
    model_ema_decay: float = 0.9998
    model_ema_warmup: bool = False
    # distillation
    teacher: Optional[str] = None
    teacher_checkpoint: Optional[str] = None
    teacher_kwargs: Dict[str, Any] = field(default_factory=dict)
    distill_weight: float = 0.5
    distill_temperature: float = 4.0
    # run
    seed: int = 42
    device: Optional[str] = None  # None: cuda if available, else cpu
    output: str = 'runs/finetune'
    resume: Optional[str] = None
    checkpoint_hist: int = 1
    log_interval: int = 50
    progress: bool = True

    def validate(self) -> None:
        """Raise `ConfigError` for settings that cannot work."""
        checks = [
            (self.epochs >= 1, f'epochs must be >= 1, got {self.epochs}'),
            (self.batch_size >= 1, f'batch size must be >= 1, got {self.batch_size}'),
            (self.grad_accum_steps >= 1, f'grad-accum-steps must be >= 1, got {self.grad_accum_steps}'),
            (0. <= self.distill_weight <= 1., f'distill-weight must be in [0, 1], got {self.distill_weight}'),
            (self.distill_temperature > 0, f'distill-temperature must be > 0, got {self.distill_temperature}'),
            (0. <= self.smoothing < 1., f'smoothing must be in [0, 1), got {self.smoothing}'),
            (self.amp_dtype in (None, *_AMP_DTYPES), f"amp-dtype must be one of {list(_AMP_DTYPES)}, "
                                                       f"got '{self.amp_dtype}'"),
            (self.num_classes is None or self.num_classes >= 1, f'num-classes must be >= 1, got {self.num_classes}'),
            (self.log_interval >= 1, f'log-interval must be >= 1, got {self.log_interval}'),
            (self.checkpoint_hist >= 1, f'checkpoint-hist must be >= 1, got {self.checkpoint_hist}'),
            (not (self.teacher_checkpoint and not self.teacher),
             'teacher-checkpoint needs --teacher MODEL_NAME (the architecture of the checkpoint)'),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass
class TrainResult:
    """What a finished run leaves for publishing (e.g. `timm_affinediv.hub.save_hub_folder`).

    `model` holds the final weights (the EMA weights when EMA is on), also written to `<output>/model.safetensors`;
    `model_args` rebuild its architecture with `timm.create_model(model_name, **model_args)` (for a ready model
    given to the Trainer, as far as `TrainConfig.model` / `model_kwargs` / `norm_layer` describe it).
    """
    model: nn.Module
    model_name: str
    model_args: Dict[str, Any]
    metrics: Dict[str, float]
    best_metrics: Dict[str, float]
    history: List[Dict[str, float]]
    output_dir: str
    weights_file: str


class DistillationLoss(nn.Module):
    """Hard-label loss blended with knowledge distillation from a teacher's logits.

    loss = (1 - weight) * base_loss(student, target) + weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))
    (Hinton et al. 2015; the T^2 factor keeps the soft gradients' scale independent of the temperature T).
    """

    def __init__(self, base_loss: nn.Module, weight: float = 0.5, temperature: float = 4.0):
        super().__init__()
        self.base_loss = base_loss
        self.weight = weight
        self.temperature = temperature

    def forward(self, logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hard = self.base_loss(logits, target)
        t = self.temperature
        soft = F.kl_div(
            F.log_softmax(logits.float() / t, dim=-1), F.log_softmax(teacher_logits.float() / t, dim=-1),
            reduction='batchmean', log_target=True) * (t * t)
        return (1. - self.weight) * hard + self.weight * soft


def _weights_file(path: str) -> str:
    """A weights file, or the `model.safetensors` of a (Hub-format) folder."""
    if os.path.isdir(path):
        path = os.path.join(path, _MODEL_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f'checkpoint {path} not found; give a .safetensors / .pth file or a folder holding '
                          f'{_MODEL_FILE}.')
    return path


def _read_weights(path: str, what: str) -> Dict[str, torch.Tensor]:
    """A state dict from a weights file or Hub-format folder (timm's `load_state_dict`: safetensors / .pth, EMA
    weights preferred), with an error that says what is wrong."""
    path = _weights_file(path)
    try:
        return timm.models.load_state_dict(path)
    except Exception as e:  # truncated or not a checkpoint at all: many exception types
        raise ConfigError(f'{what} {path} is unreadable ({type(e).__name__}: {e}).') from e


def _load_weights(model: nn.Module, state_dict: Dict[str, torch.Tensor], path: str, what: str) -> None:
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:  # missing / unexpected keys, shape mismatches
        raise ConfigError(f'{what} {path} does not fit the model: {e}') from e


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
    if ':' not in cfg.model and not timm.is_model(cfg.model):  # 'hf-hub:' / 'local-dir:' names resolve later
        raise ConfigError(f"unknown model '{cfg.model}'; list the names with timm.list_models().")
    model = timm.create_model(cfg.model, pretrained=cfg.pretrained, **kwargs)
    if cfg.initial_checkpoint:
        state_dict = _read_weights(cfg.initial_checkpoint, 'initial checkpoint')
        classes = _classifier_classes(model, state_dict)
        if classes is not None and classes != _head_classes(model) and 'num_classes' not in cfg.model_kwargs:
            model = timm.create_model(cfg.model, **kwargs, num_classes=classes)
        _load_weights(model, state_dict, cfg.initial_checkpoint, 'initial checkpoint')
    return model


def create_teacher(
        teacher: Union[str, nn.Module],
        checkpoint: Optional[str] = None,
        **kwargs: Any,
) -> nn.Module:
    """A teacher in eval mode (run under `torch.no_grad`): a ready module, or a timm model name (+ `kwargs`)
    with its checkpoint."""
    if isinstance(teacher, str):
        model = timm.create_model(teacher, **kwargs)
        if checkpoint:
            _load_weights(model, _read_weights(checkpoint, 'teacher checkpoint'), checkpoint, 'teacher checkpoint')
        else:
            _logger.warning(f"teacher '{teacher}' has no checkpoint: distilling from random weights.")
        teacher = model
    return teacher.eval()


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


def resolve_checkpoint(path: str) -> str:
    """The checkpoint folder `path` names: a checkpoint folder itself, or a run's output folder (its latest one)."""
    if os.path.isfile(os.path.join(path, _STATE_FILE)):
        return path
    pointer = os.path.join(path, 'checkpoints', 'last.json')
    if os.path.isfile(pointer):
        try:
            with open(pointer) as f:
                name = json.load(f)['checkpoint']
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f'{pointer} is unreadable ({e}); resume from a folder under '
                                  f'{os.path.dirname(pointer)} instead.') from e
        return os.path.join(path, 'checkpoints', name)
    raise CheckpointError(f'no checkpoint at {path}: give a run output folder (with checkpoints/last.json) or a '
                          f'checkpoint folder (with {_STATE_FILE}).')


def _atomic_write_bytes(path: str, data: bytes) -> None:
    tmp = f'{path}.tmp-{os.getpid()}'
    with open(tmp, 'wb') as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: str, text: str) -> None:
    _atomic_write_bytes(path, text.encode())


def _save_safetensors(state_dict: Dict[str, torch.Tensor], path: str) -> None:
    tmp = f'{path}.tmp-{os.getpid()}'
    save_file({k: v.detach().contiguous().cpu() for k, v in state_dict.items()}, tmp)
    os.replace(tmp, path)


@contextmanager
def _atomic_dir(path: str) -> Iterator[str]:
    """Yield a temporary folder that is renamed to `path` (atomically) once the block completes."""
    tmp = f'{path}.tmp-{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def _rng_state() -> Dict[str, Any]:
    """torch / numpy / python RNG states, in types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state = dict(
        torch=torch.get_rng_state(),
        numpy=(np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        python=random.getstate(),
    )
    if torch.cuda.is_available():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state['torch'])
    name, keys, *rest = state['numpy']
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(tuple(tuple(s) if isinstance(s, list) else s for s in state['python']))
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])


def plot_history(history: Sequence[Dict[str, float]], path: str) -> None:
    """Plot the learning curves (loss, top-1 / top-5, learning rate per epoch) to a PNG file, atomically."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    epochs = [h['epoch'] for h in history]
    fig = Figure(figsize=(12, 3.6), layout='constrained')
    ax_loss, ax_acc, ax_lr = fig.subplots(1, 3)
    for key, label in (('train_loss', 'train'), ('val_loss', 'val'), ('ema_val_loss', 'val (EMA)')):
        if key in history[0]:
            ax_loss.plot(epochs, [h[key] for h in history], marker='o', label=label)
    for key, label in (('val_top1', 'top-1'), ('val_top5', 'top-5'), ('ema_val_top1', 'top-1 (EMA)')):
        if key in history[0]:
            ax_acc.plot(epochs, [h[key] for h in history], marker='o', label=label)
    ax_lr.plot(epochs, [h['lr'] for h in history], marker='o')
    for ax, title in ((ax_loss, 'loss'), (ax_acc, 'accuracy (%)'), (ax_lr, 'learning rate (end of epoch)')):
        ax.set_title(title)
        ax.set_xlabel('epoch')
        ax.grid(alpha=0.3)
    ax_loss.legend()
    ax_acc.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format='png', dpi=100)
    _atomic_write_bytes(path, buffer.getvalue())


@torch.no_grad()
def evaluate(
        model: nn.Module,
        loader: Iterable[Tuple[torch.Tensor, torch.Tensor]],
        device: Optional[torch.device] = None,
        autocast: Callable[[], ContextManager] = nullcontext,
        distributed: bool = False,
        progress: bool = False,
) -> Dict[str, float]:
    """ Cross-entropy loss, top-1 and top-5 accuracy (%) and images/s of `model` on `loader`, in eval mode.

    `device`: where the batches go (default: the model's). `distributed`: sum over all ranks (every rank must call
    it). The model's train/eval mode is restored afterwards.
    """
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, correct@1, correct@5, samples
    start = time.perf_counter()
    for x, target in tqdm(loader, desc='eval', unit='batch', leave=False, dynamic_ncols=True, disable=not progress):
        x = x.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        with autocast():
            output = model(x)
        output = output.float()
        acc1, acc5 = accuracy(output, target, topk=(1, min(5, output.shape[-1])))
        n = target.shape[0]
        sums += torch.stack([F.cross_entropy(output, target, reduction='sum').double(),
                             acc1.double() * n / 100, acc5.double() * n / 100,
                             torch.tensor(n, dtype=torch.float64, device=device)])
    if distributed:
        dist.all_reduce(sums)
    elapsed = time.perf_counter() - start
    model.train(was_training)
    loss, correct1, correct5, samples = sums.tolist()
    if samples == 0:
        raise ConfigError('the evaluation set is empty; check --val-split / --val-subset.')
    return dict(loss=loss / samples, top1=100 * correct1 / samples, top5=100 * correct5 / samples,
                img_s=samples / elapsed)


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
        self._init_device()
        self.amp_dtype = self._resolve_amp_dtype()
        random_seed(cfg.seed)  # the same initial weights on every rank

        in_chans = 1 if is_fashion_mnist(cfg.dataset) else (cfg.in_chans or 3)
        if cfg.in_chans and cfg.in_chans != in_chans:
            raise ConfigError(f'Fashion-MNIST has 1 channel, not --in-chans {cfg.in_chans}.')
        model = model if model is not None else create_train_model(cfg, in_chans)
        self.data_config = resolve_dataset_data_config(cfg.dataset, model, in_chans, cfg.img_size)
        # the preprocessing the weights expect travels with them (config.json, resolve_data_config)
        model.pretrained_cfg = {**getattr(model, 'pretrained_cfg', {}), **self.data_config}
        loader_args = dict(workers=cfg.workers, rank=self.rank, world_size=self.world_size,
                           pin_memory=self.device.type == 'cuda')
        self.train_loader = create_train_loader(
            cfg.dataset, cfg.data_dir, self.data_config, cfg.batch_size, split=cfg.train_split,
            subset=cfg.train_subset, seed=cfg.seed, no_aug=cfg.no_aug, scale=cfg.scale, hflip=cfg.hflip,
            color_jitter=cfg.color_jitter, **loader_args)
        self.val_loader = create_eval_loader(
            cfg.dataset, cfg.data_dir, self.data_config, cfg.validation_batch_size or cfg.batch_size,
            split=cfg.val_split, subset=cfg.val_subset, **loader_args)
        self.num_classes = dataset_num_classes(self.train_loader.dataset)
        _match_head(model, self.num_classes, cfg.num_classes)
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError('the model has no trainable parameters (all have requires_grad=False).')
        self.model = model.to(self.device)
        random_seed(cfg.seed, self.rank)  # each rank its own augmentation / dropout stream
        self.model_args = {**cfg.model_kwargs, 'in_chans': in_chans, 'num_classes': self.num_classes}
        if cfg.norm_layer:
            self.model_args['norm_layer'] = cfg.norm_layer

        self.teacher = self._create_teacher(teacher, in_chans)
        self.optimizer = create_optimizer_v2(
            self.model, opt=cfg.opt, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum)
        self.updates_per_epoch = math.ceil(len(self.train_loader) / cfg.grad_accum_steps)
        self.scheduler, self.num_epochs = create_scheduler_v2(
            self.optimizer, sched=cfg.sched, num_epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs,
            warmup_lr=cfg.warmup_lr, min_lr=cfg.min_lr, step_on_epochs=not cfg.sched_on_updates,
            updates_per_epoch=self.updates_per_epoch)
        self.loss_scaler = NativeScaler(self.device.type) if self.amp_dtype == torch.float16 else None
        base_loss = LabelSmoothingCrossEntropy(cfg.smoothing) if cfg.smoothing > 0 else nn.CrossEntropyLoss()
        self.train_loss_fn = DistillationLoss(base_loss, cfg.distill_weight, cfg.distill_temperature) \
            if self.teacher is not None else base_loss
        self.ddp_model = DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == 'cuda' else None) \
            if self.distributed else self.model
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
        self.checkpoint_dir = os.path.join(cfg.output, 'checkpoints')
        if cfg.resume:
            self.load_checkpoint(resolve_checkpoint(cfg.resume))

    # ---- set-up helpers
    def _init_device(self) -> None:
        """Device, rank and world size; joins the process group under torchrun (once per process)."""
        device = self.cfg.device or ('cuda' if torch.cuda.is_available() else 'cpu')
        if dist.is_available() and dist.is_initialized():  # a second Trainer in the same process
            rank, world_size = dist.get_rank(), dist.get_world_size()
            local_rank = int(os.environ.get('LOCAL_RANK', 0))
            info = dict(device=f'cuda:{local_rank}' if device == 'cuda' else device, global_rank=rank,
                        world_size=world_size, distributed=world_size > 1)
        else:
            info = init_distributed_device_so(device=device)
        self.device = torch.device(info['device'])
        self.rank, self.world_size, self.distributed = info['global_rank'], info['world_size'], info['distributed']
        self.is_primary = self.rank == 0

    def _resolve_amp_dtype(self) -> Optional[torch.dtype]:
        if not self.cfg.amp:
            return None
        name = self.cfg.amp_dtype or ('float16' if self.device.type == 'cuda' else 'bfloat16')
        if name == 'float16' and self.device.type != 'cuda':
            raise ConfigError('float16 mixed precision needs CUDA; use --amp-dtype bfloat16 on CPU.')
        return _AMP_DTYPES[name]

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

    # ---- training
    def _backward(self, loss: torch.Tensor, need_update: bool) -> None:
        cfg = self.cfg
        if self.loss_scaler is not None:
            self.loss_scaler(loss, self.optimizer, clip_grad=cfg.clip_grad, clip_mode=cfg.clip_mode,
                             parameters=self.model.parameters(), need_update=need_update)
            return
        loss.backward()
        if need_update:
            if cfg.clip_grad is not None:
                dispatch_clip_grad(self.model.parameters(), cfg.clip_grad, mode=cfg.clip_mode)
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
        """Train one epoch, from update `self.update_in_epoch` when resumed mid-epoch; return its train loss and
        images/s. Raises `_StopRequested` at an update boundary when a stop was requested."""
        cfg = self.cfg
        accum = cfg.grad_accum_steps
        num_batches = len(self.train_loader)
        set_loader_epoch(self.train_loader, epoch, cfg.seed, self.rank)
        loader_iter = iter(self.train_loader)
        first_batch = self.update_in_epoch * accum
        for _ in range(first_batch):  # replay the batches a resumed checkpoint had already used
            next(loader_iter)
        if self._pending_rng is not None:
            _set_rng_state(self._pending_rng)
            self._pending_rng = None
        if first_batch == 0:
            self._meter.zero_()
        self.ddp_model.train()
        group_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        group_samples = 0
        batch_size = cfg.batch_size
        progress = tqdm(
            total=num_batches, initial=first_batch, desc=f'train {epoch}', unit='batch', leave=False,
            disable=not (self.is_primary and cfg.progress), dynamic_ncols=True)
        start = time.perf_counter()
        with progress:
            for batch_idx in range(first_batch, num_batches):
                x, target = next(loader_iter)
                x = x.to(self.device, non_blocking=True)
                target = target.to(self.device, non_blocking=True)
                update_idx = batch_idx // accum
                group_size = min(accum, num_batches - update_idx * accum)
                need_update = (batch_idx + 1) % accum == 0 or batch_idx + 1 == num_batches
                sync = self.ddp_model.no_sync() if self.distributed and not need_update else nullcontext()
                with sync:
                    with self._autocast():
                        output = self.ddp_model(x)
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
                if self.update_in_epoch % cfg.log_interval == 0:
                    stop = self._sync_check(epoch)  # syncs ranks: the only per-step host sync
                    progress.set_postfix(loss=f'{loss.item():.4f}', lr=f'{self._lr():.2e}')
                else:
                    stop = self._stop_requested and not self.distributed
                if stop:
                    raise _StopRequested()
        self._sync_check(epoch)  # also waits for the device, so the time below is the real one
        elapsed = time.perf_counter() - start
        meter = self._meter.clone()
        if self.distributed:
            dist.all_reduce(meter)
        return dict(train_loss=(meter[0] / meter[1]).item(),
                    train_img_s=(num_batches - first_batch) * batch_size * self.world_size / elapsed)

    def _lr(self) -> float:
        return self.optimizer.param_groups[0]['lr']

    def evaluate(self, model: Optional[nn.Module] = None) -> Dict[str, float]:
        """Loss, top-1, top-5 (%) and images/s of `model` (default: the trained model) on the validation set,
        summed over all ranks."""
        return evaluate(model if model is not None else self.model, self.val_loader, device=self.device,
                        autocast=self._autocast, distributed=self.distributed,
                        progress=self.is_primary and self.cfg.progress)

    def _end_epoch(self, epoch: int, train_metrics: Dict[str, float], epoch_start: float) -> Dict[str, float]:
        """Evaluate, record metrics, step the scheduler and write checkpoint + logs for a finished epoch."""
        if self.distributed:
            distribute_bn(self.model, self.world_size, reduce=True)
        metrics = dict(epoch=epoch, lr=self._lr(), **train_metrics)
        metrics.update({f'val_{k}': v for k, v in self.evaluate().items()})
        if self.ema is not None:
            metrics.update({f'ema_val_{k}': v for k, v in self.evaluate(self.ema.module).items()})
        metrics['epoch_time_s'] = time.perf_counter() - epoch_start
        self.history.append(metrics)
        key = 'ema_val_top1' if self.ema is not None else 'val_top1'
        is_best = self.best is None or metrics[key] > self.best[key]
        if is_best:
            self.best = dict(metrics)
        if self.scheduler is not None:
            self.scheduler.step(epoch + 1, metrics[key])
        self.epoch, self.update_in_epoch = epoch + 1, 0
        self.save_checkpoint(f'epoch-{epoch:04d}', is_best=is_best)
        if self.is_primary:
            self._write_logs()
            _logger.info(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in metrics.items()))
        return metrics

    def fit(self) -> TrainResult:
        """Train from the current state to the last epoch; write the final weights as `<output>/model.safetensors`.

        Raises `TrainingInterrupted` (after writing a checkpoint) on Ctrl-C / SIGTERM, `NonFiniteLossError` on a
        NaN / infinite loss (the last good checkpoint stays the latest one).
        """
        if self.is_primary:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
            _atomic_write_text(os.path.join(self.cfg.output, 'train_config.json'),
                               json.dumps(dataclasses.asdict(self.cfg), indent=2, default=str))
        with self._stop_on_signals():
            for epoch in range(self.epoch, self.num_epochs):
                epoch_start = time.perf_counter()
                try:
                    train_metrics = self.train_one_epoch(epoch)
                except (_StopRequested, KeyboardInterrupt) as e:
                    raise TrainingInterrupted(self._save_interrupt_checkpoint(
                        epoch, at_sync_point=isinstance(e, _StopRequested))) from None
                self._end_epoch(epoch, train_metrics, epoch_start)
                if epoch + 1 < self.num_epochs and self._sync_check(epoch):  # a stop asked for during evaluation
                    raise TrainingInterrupted(self.last_checkpoint)
        weights_file = os.path.join(self.cfg.output, _MODEL_FILE)
        if self.is_primary:
            _save_safetensors(self.final_model.state_dict(), weights_file)
        self._barrier()
        return TrainResult(
            model=self.final_model, model_name=self.cfg.model, model_args=dict(self.model_args),
            metrics=dict(self.history[-1]) if self.history else {}, best_metrics=dict(self.best or {}),
            history=list(self.history), output_dir=self.cfg.output, weights_file=weights_file)

    def _save_interrupt_checkpoint(self, epoch: int, at_sync_point: bool) -> Optional[str]:
        """Checkpoint at the last completed update. A raw KeyboardInterrupt can hit any rank anywhere, so then
        only this rank's RNG state is kept, and nothing is written if the loss had already gone non-finite."""
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
        rank_state = dict(rng=_rng_state(), meter=self._meter.cpu())
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
            with _atomic_dir(path) as tmp:
                save_file({k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()},
                          os.path.join(tmp, _MODEL_FILE))
                if self.ema is not None:
                    save_file({k: v.detach().contiguous().cpu() for k, v in self.ema.module.state_dict().items()},
                              os.path.join(tmp, _EMA_FILE))
                torch.save(state, os.path.join(tmp, _STATE_FILE))
            pointer = json.dumps(dict(checkpoint=name, epoch=self.epoch, update_in_epoch=self.update_in_epoch))
            _atomic_write_text(os.path.join(self.checkpoint_dir, 'last.json'), pointer)
            if is_best:
                _atomic_write_text(os.path.join(self.checkpoint_dir, 'best.json'), pointer)
            self._prune_checkpoints()
        if collective:
            self._barrier()
        self.last_checkpoint = path
        return path

    def _prune_checkpoints(self) -> None:
        keep = set()
        for pointer in ('last.json', 'best.json'):
            try:
                with open(os.path.join(self.checkpoint_dir, pointer)) as f:
                    keep.add(json.load(f)['checkpoint'])
            except FileNotFoundError:
                pass
        folders = sorted(d for d in os.listdir(self.checkpoint_dir)
                         if d.startswith(('epoch-', 'interrupt-')) and '.tmp-' not in d)
        keep.update([d for d in folders if d.startswith('epoch-')][-self.cfg.checkpoint_hist:])
        for d in folders:
            if d not in keep:
                shutil.rmtree(os.path.join(self.checkpoint_dir, d), ignore_errors=True)

    def load_checkpoint(self, path: str) -> None:
        """Restore model, EMA, optimiser, scheduler, scaler, counters, history and RNG states from a checkpoint
        folder, raising `CheckpointError` when it is unreadable or belongs to another model."""
        try:
            state = torch.load(os.path.join(path, _STATE_FILE), map_location='cpu', weights_only=True)
            weights = load_file(os.path.join(path, _MODEL_FILE))
            ema_weights = load_file(os.path.join(path, _EMA_FILE)) if self.ema is not None else None
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
            self.optimizer.load_state_dict(state['optimizer'])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f'checkpoint {path} does not match this model or optimiser ({e}); resume with the settings it was '
                f'written with (--model, --norm-layer, --opt, ...), or start a new --output.') from e
        if self.scheduler is not None and state['scheduler'] is not None:
            self.scheduler.load_state_dict(state['scheduler'])
        if self.loss_scaler is not None and state['loss_scaler'] is not None:
            self.loss_scaler.load_state_dict(state['loss_scaler'])
        for key in ('seed', 'batch_size', 'grad_accum_steps', 'world_size'):
            current = getattr(self.cfg, key, None) if key != 'world_size' else self.world_size
            if state[key] != current:
                _logger.warning(f'resuming with {key}={current} where the checkpoint had {state[key]}: the run will '
                                f'not reproduce an uninterrupted one.')
        self.epoch, self.update_in_epoch, self.num_updates = state['epoch'], state['update_in_epoch'], \
            state['num_updates']
        self.history, self.best = state['history'], state['best']
        ranks = state['ranks']
        if len(ranks) == self.world_size or self.rank < len(ranks):
            rank_state = ranks[self.rank] if self.rank < len(ranks) else ranks[0]
            self._pending_rng = rank_state['rng']
            self._meter.copy_(rank_state['meter'])
        _logger.info(f'resumed from {path}: epoch {self.epoch}, update {self.update_in_epoch} of it')

    def _write_logs(self) -> None:
        """Rewrite `metrics.csv`, `metrics.json` and `metrics.png` in the output folder from the history."""
        out = self.cfg.output
        keys = list(dict.fromkeys(k for h in self.history for k in h))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=keys)
        writer.writeheader()
        writer.writerows(self.history)
        _atomic_write_text(os.path.join(out, 'metrics.csv'), buffer.getvalue())
        _atomic_write_text(os.path.join(out, 'metrics.json'), json.dumps(self.history, indent=2))
        plot_history(self.history, os.path.join(out, 'metrics.png'))


class _StopRequested(Exception):
    """Raised inside the training loop at an update boundary when a stop was requested."""

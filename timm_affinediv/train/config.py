""" The settings of a training run and the errors it reports """
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..errors import CheckpointError, ConfigError, NonFiniteLossError, TrainingError

__all__ = ['TrainConfig', 'TrainResult', 'TrainingError', 'ConfigError', 'CheckpointError', 'NonFiniteLossError',
           'TrainingInterrupted', 'AMP_DTYPES']

AMP_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}


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
            (self.amp_dtype in (None, *AMP_DTYPES), f"amp-dtype must be one of {list(AMP_DTYPES)}, "
                                                       f"got '{self.amp_dtype}'"),
            (self.num_classes is None or self.num_classes >= 1, f'num-classes must be >= 1, got {self.num_classes}'),
            (self.train_subset is None or self.train_subset >= 1,
             f'train-subset must be >= 1, got {self.train_subset}'),
            (self.val_subset is None or self.val_subset >= 1, f'val-subset must be >= 1, got {self.val_subset}'),
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
    eval_set: str = ''  # the validation set in words, with its size (`describe_split`)

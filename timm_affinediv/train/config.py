""" The settings of a training run and the errors it reports """
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..data import resolve_dataset
from ..errors import CheckpointError, ConfigError, NonFiniteLossError, TrainingError

__all__ = ['TrainConfig', 'TrainResult', 'TrainingError', 'ConfigError', 'CheckpointError', 'NonFiniteLossError',
           'TrainingInterrupted', 'AMP_DTYPES', 'EVAL_METRICS', 'DEFAULT_LR', 'load_timm_args']

_logger = logging.getLogger(__name__)

AMP_DTYPES = {'bfloat16': torch.bfloat16, 'float16': torch.float16}
#: the metrics `eval_metric` may name (`loss` is better when lower)
EVAL_METRICS = ('top1', 'top5', 'loss')


class TrainingInterrupted(KeyboardInterrupt):
    """Training stopped by Ctrl-C / SIGTERM after writing a checkpoint (`checkpoint` is its folder, or None)."""

    def __init__(self, checkpoint: Optional[str]):
        super().__init__(f'training interrupted, checkpoint written to {checkpoint}' if checkpoint else
                         'training interrupted')
        self.checkpoint = checkpoint


#: the learning rate when neither `lr` nor `lr_base` is set (timm's train.py scales `lr_base` 0.1 by the batch)
DEFAULT_LR = 1e-3


@dataclass
class TrainConfig:
    """Settings of a training run. Field names and, for timm's recipe settings, defaults are those of timm's
    `train.py` flags (`--grad-accum-steps` -> `grad_accum_steps`), so a `train.py` `args.yaml` maps onto it
    (`load_timm_args`). Defaults made for fine-tuning differ from train.py's (which trains from scratch): `opt`,
    `lr`, `weight_decay`, `epochs`, `warmup_epochs`, `sched_on_updates`, `scale`, `color_jitter`,
    `checkpoint_hist`, `workers`. `model_kwargs` go to `timm.create_model` (with `norm_layer` / `in_chans` /
    `num_classes`)."""
    # model
    model: str = 'resnet18'
    pretrained: bool = False
    initial_checkpoint: Optional[str] = None
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    norm_layer: Optional[str] = None
    num_classes: Optional[int] = None
    in_chans: Optional[int] = None
    drop: float = 0.
    drop_path: Optional[float] = None
    drop_block: Optional[float] = None
    gp: Optional[str] = None  # global pool type ('avg', 'max', 'avgmax', ...)
    bn_momentum: Optional[float] = None
    bn_eps: Optional[float] = None
    head_init_scale: Optional[float] = None  # the head's initial weight and bias scaled by it
    head_init_bias: Optional[float] = None  # the head's initial bias set to it
    grad_checkpointing: bool = False
    channels_last: bool = False
    torchcompile: Optional[str] = None  # a torch.compile backend ('inductor')
    torchcompile_mode: Optional[str] = None
    # data
    dataset: Optional[str] = None  # no default: 'fashion-mnist', a timm dataset name, or None / '' with data_dir
    data_dir: Optional[str] = None
    train_split: str = 'train'
    val_split: str = 'validation'
    train_num_samples: Optional[int] = None  # a stream's epoch length where its metadata does not give it
    val_num_samples: Optional[int] = None
    img_size: Optional[int] = None
    input_size: Optional[Tuple[int, int, int]] = None
    crop_pct: Optional[float] = None
    mean: Optional[Tuple[float, ...]] = None
    std: Optional[Tuple[float, ...]] = None
    interpolation: str = ''
    train_subset: Optional[int] = None
    val_subset: Optional[int] = None
    batch_size: int = 128
    validation_batch_size: Optional[int] = None
    workers: int = 2
    aug_repeats: float = 0  # > 0: timm's RepeatAugSampler, each image this many times an epoch, augmented anew
    no_prefetcher: bool = False  # train.py's: workers send normalised float batches, mixup runs in this process
    # augmentation (timm.data.create_transform) and regularisation
    no_aug: bool = False
    train_crop_mode: Optional[str] = None
    scale: Optional[Tuple[float, float]] = (0.75, 1.0)  # random-resized-crop area; milder than timm's (0.08, 1)
    ratio: Tuple[float, float] = (3. / 4., 4. / 3.)
    hflip: float = 0.5
    vflip: float = 0.
    color_jitter: float = 0.
    color_jitter_prob: Optional[float] = None
    grayscale_prob: Optional[float] = None
    gaussian_blur_prob: Optional[float] = None
    aa: Optional[str] = None
    reprob: float = 0.
    remode: str = 'pixel'
    recount: int = 1
    train_interpolation: str = 'random'
    # mixup / cutmix (timm.data.Mixup) and the loss
    mixup: float = 0.
    cutmix: float = 0.
    cutmix_minmax: Optional[Tuple[float, float]] = None
    mixup_prob: float = 1.
    mixup_switch_prob: float = 0.5
    mixup_mode: str = 'batch'
    mixup_off_epoch: int = 0
    smoothing: float = 0.1
    bce_loss: bool = False
    bce_sum: bool = False
    bce_target_thresh: Optional[float] = None
    bce_pos_weight: Optional[float] = None
    # optimiser (timm.optim.create_optimizer_v2 through optimizer_kwargs)
    opt: str = 'adamw'
    opt_eps: Optional[float] = None
    opt_betas: Optional[Tuple[float, ...]] = None
    momentum: float = 0.9
    weight_decay: float = 0.05
    clip_grad: Optional[float] = None
    clip_mode: str = 'norm'
    layer_decay: Optional[float] = None
    layer_decay_min_scale: float = 0.
    layer_decay_no_opt_scale: Optional[float] = None
    opt_kwargs: Dict[str, Any] = field(default_factory=dict)
    # learning-rate schedule (timm.scheduler.create_scheduler_v2 through scheduler_kwargs)
    sched: str = 'cosine'
    sched_on_updates: bool = True
    lr: Optional[float] = None  # None: from lr_base, or DEFAULT_LR without it
    lr_base: Optional[float] = None
    lr_base_size: int = 256
    lr_base_scale: str = ''
    lr_noise: Optional[Tuple[float, ...]] = None
    lr_noise_pct: float = 0.67
    lr_noise_std: float = 1.
    lr_cycle_mul: float = 1.
    lr_cycle_decay: float = 0.5
    lr_cycle_limit: int = 1
    lr_k_decay: float = 1.
    warmup_lr: float = 1e-5
    min_lr: float = 0.
    epochs: float = 10  # a fraction (0.25) or a non-whole count ends the run inside an epoch (`Trainer`)
    decay_milestones: Tuple[int, ...] = (90, 180, 270)
    decay_epochs: float = 90
    warmup_epochs: float = 0
    warmup_prefix: bool = False
    cooldown_epochs: int = 0
    patience_epochs: int = 10
    decay_rate: float = 0.1
    # precision, accumulation, EMA
    amp: bool = False
    amp_dtype: Optional[str] = None  # None: bfloat16 on CPU, float16 on CUDA
    grad_accum_steps: int = 1
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
    no_resume_opt: bool = False  # resume the weights, not the optimiser / loss-scaler state
    eval_metric: str = 'top1'  # 'top1', 'top5' or 'loss': picks the best checkpoint and drives the plateau schedule
    # evaluations and the stop rule (`Trainer`)
    evaluations: Optional[int] = None  # evaluate this many times, evenly over the run's updates, not at epoch ends
    stop_patience: Optional[int] = None  # stop after this many evaluations in a row that do not better the best
    # with stop_patience: an evaluation counts against the best only where it is worse by more than this many standard
    # errors of the difference (the evaluation's `*_se`); None: where it does not better it
    stop_noise: Optional[float] = None
    stop_target: Optional[float] = None  # stop at the first evaluation whose stop_target_metric reaches this
    stop_target_metric: Optional[str] = None  # one of EVAL_METRICS; None: eval_metric
    checkpoint_hist: int = 1
    log_interval: int = 50
    progress: Optional[bool] = None  # progress bars; None: when stderr is a terminal, else log lines

    @property
    def mixup_active(self) -> bool:
        """Mixup or cutmix on (timm's train.py condition): the targets are soft, the loss takes them."""
        return self.mixup > 0 or self.cutmix > 0 or self.cutmix_minmax is not None

    def resolve_lr(self, world_size: int = 1) -> float:
        """`lr`, else timm's train.py rule `lr_base * (global batch / lr_base_size)` (square root of the ratio
        for 'ada*' / 'lamb' optimisers unless `lr_base_scale` says), else `DEFAULT_LR`."""
        if self.lr is not None:
            return self.lr
        if self.lr_base is None:
            return DEFAULT_LR
        ratio = self.batch_size * world_size * self.grad_accum_steps / self.lr_base_size
        scale = self.lr_base_scale or ('sqrt' if any(o in self.opt.lower() for o in ('ada', 'lamb')) else 'linear')
        return self.lr_base * (ratio ** 0.5 if scale == 'sqrt' else ratio)

    def transform_kwargs(self) -> Dict[str, Any]:
        """The training arguments of `timm.data.create_transform`, by timm's names (as train.py passes them)."""
        kwargs = dict(
            no_aug=self.no_aug, train_crop_mode=self.train_crop_mode, scale=self.scale, ratio=self.ratio,
            hflip=self.hflip, vflip=self.vflip, color_jitter=self.color_jitter,
            color_jitter_prob=self.color_jitter_prob, grayscale_prob=self.grayscale_prob,
            gaussian_blur_prob=self.gaussian_blur_prob, auto_augment=self.aa, re_prob=self.reprob,
            re_mode=self.remode, re_count=self.recount)
        if self.train_interpolation and not self.no_aug:
            kwargs['interpolation'] = self.train_interpolation
        return {k: v for k, v in kwargs.items() if v is not None}

    def mixup_kwargs(self, num_classes: int) -> Dict[str, Any]:
        """The arguments of `timm.data.Mixup` (label smoothing moves into its soft targets)."""
        return dict(mixup_alpha=self.mixup, cutmix_alpha=self.cutmix, cutmix_minmax=self.cutmix_minmax,
                    prob=self.mixup_prob, switch_prob=self.mixup_switch_prob, mode=self.mixup_mode,
                    label_smoothing=self.smoothing, num_classes=num_classes)

    def data_config_overrides(self) -> Dict[str, Any]:
        """The `--input-size` / `--img-size` / `--crop-pct` / `--mean` / `--std` / `--interpolation` given, in
        the form `timm.data.resolve_data_config` takes."""
        args = dict(input_size=self.input_size, img_size=self.img_size, crop_pct=self.crop_pct, mean=self.mean,
                    std=self.std, interpolation=self.interpolation or None)
        return {k: v for k, v in args.items() if v is not None}

    def validate(self) -> None:
        """Raise `ConfigError` for settings that cannot work."""
        channels = self.input_size[0] if self.input_size else self.in_chans
        checks = [
            (self.epochs > 0, f'epochs must be > 0, got {self.epochs}'),
            (float(self.epochs).is_integer() or self.sched_on_updates,
             f'epochs {self.epochs} ends inside an epoch, which a schedule stepped once an epoch cannot span: '
             f'add --sched-on-updates, or give whole epochs'),
            (self.evaluations is None or self.evaluations >= 1, f'evaluations must be >= 1, got {self.evaluations}'),
            (self.evaluations is None or self.sched_on_updates,
             'evaluations inside epochs need a schedule stepped on updates: add --sched-on-updates'),
            (self.stop_patience is None or self.stop_patience >= 1,
             f'stop-patience must be >= 1, got {self.stop_patience}'),
            (self.stop_noise is None or self.stop_noise >= 0, f'stop-noise must be >= 0, got {self.stop_noise}'),
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
            (self.lr is None or self.lr > 0, f'lr must be > 0, got {self.lr}'),
            (self.lr_base_scale in ('', 'linear', 'sqrt'), f"lr-base-scale must be 'linear' or 'sqrt', got "
                                                           f"'{self.lr_base_scale}'"),
            (self.mixup_mode in ('batch', 'pair', 'elem'), f"mixup-mode must be batch, pair or elem, got "
                                                           f"'{self.mixup_mode}'"),
            (not self.mixup_active or self.batch_size % 2 == 0,
             f'mixup / cutmix mix pairs of samples: --batch-size must be even, got {self.batch_size}'),
            (self.cutmix_minmax is None or len(self.cutmix_minmax) == 2,
             f'cutmix-minmax takes two numbers (MIN MAX), got {self.cutmix_minmax}'),
            (self.remode in ('pixel', 'rand', 'const'), f"remode must be pixel, rand or const, got '{self.remode}'"),
            (0. <= self.reprob <= 1., f'reprob must be in [0, 1], got {self.reprob}'),
            (self.input_size is None or len(self.input_size) == 3,
             f'input-size takes three numbers (C H W), got {self.input_size}'),
            (not (self.in_chans and self.input_size and self.in_chans != self.input_size[0]),
             f'--in-chans {self.in_chans} contradicts --input-size {self.input_size}'),
            (all(v is None or channels is None or len(v) in (1, channels) for v in (self.mean, self.std)),
             f'mean / std need 1 or {channels} values, got {self.mean} / {self.std}'),
            (self.layer_decay is None or 0 < self.layer_decay <= 1,
             f'layer-decay must be in (0, 1], got {self.layer_decay}'),
            (not (self.sched == 'plateau' and self.sched_on_updates),
             "the plateau schedule steps once an epoch, on the validation metric: add --sched-on-epochs"),
            (self.aug_repeats >= 0, f'aug-repeats must be >= 0, got {self.aug_repeats}'),
            (self.eval_metric in EVAL_METRICS, f"eval-metric must be one of {', '.join(EVAL_METRICS)}, got "
                                               f"'{self.eval_metric}'"),
            (self.stop_target_metric in (None, *EVAL_METRICS),
             f"stop-target-metric must be one of {', '.join(EVAL_METRICS)}, got '{self.stop_target_metric}'"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        resolve_dataset(self.dataset, self.data_dir)  # the library has no default dataset: one of them is needed


@dataclass
class TrainResult:
    """What a finished run leaves for publishing (e.g. `timm_affinediv.hub.save_hub_folder`).

    `model` holds the final weights (the EMA weights when EMA is on), also written to `<output>/model.safetensors`:
    those of the best evaluation where the plateau rule stopped the run, and `metrics` are then that evaluation's;
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
    images: int = 0  # training images taken (each process's batches)
    stopped: Optional[str] = None  # 'target' / 'plateau': the stop rule ended the run before its last update


# train.py settings of the machine or its logging, not of what is trained: a recipe's values are not used
_TIMM_MACHINE_KEYS = frozenset({
    'data', 'data_dir', 'workers', 'device', 'local_rank', 'device_modules', 'output', 'experiment', 'resume',
    'no_resume_opt', 'amp_impl', 'apex_amp', 'native_amp',
    'log_wandb', 'wandb_project', 'wandb_tags', 'wandb_resume_id', 'pin_mem', 'no_prefetcher', 'prefetcher',
    'use_multi_epochs_loader', 'worker_seeding', 'save_images', 'recovery_interval', 'val_interval', 'tta',
    'no_ddp_bb', 'synchronize_step', 'fuser', 'dataset_download', 'dataset_trust_remote_code', 'log_interval',
    'checkpoint_hist', 'config', 'dist_bn', 'sync_bn', 'split_bn', 'model_ema_force_cpu', 'input_img_mode'})
# train.py settings this trainer does not have, by their train.py defaults: a recipe that changes one is refused
# (docs/training.md says why each is left out); the options of the NaFlex loader, the variable-size schedule and
# train.py's own distillation only act with `naflex_loader`, `train_img_sizes` or `kd_model_name` set
_TIMM_UNSUPPORTED = {
    'aug_splits': 0, 'jsd_loss': False, 'resplit': False, 'model_dtype': None, 'epoch_repeats': 0.,
    'start_epoch': None, 'fast_norm': False, 'pretrained_path': None, 'class_map': '', 'input_key': None,
    'target_key': None, 'drop_connect': None, 'torchscript': False, 'train_batches_per_epoch': None,
    'naflex_loader': False, 'naflex_train_seq_lens': [128, 256, 576, 784, 1024], 'naflex_max_seq_len': 576,
    'naflex_patch_sizes': None, 'naflex_patch_size_probs': None, 'naflex_loss_scale': 'linear',
    'naflex_patchify_channels_first': False,
    'train_img_sizes': None, 'train_batch_sizes': None, 'train_size_probs': None, 'train_size_schedule': 'constant',
    'train_size_schedule_spread': 0.65, 'train_size_random_mix': 0.1, 'variable_batch_loss_scale': 'none',
    'kd_model_name': None, 'kd_distill_type': 'logit', 'kd_loss_type': 'kl', 'distill_loss_weight': None,
    'task_loss_weight': None, 'kd_temperature': 4.0, 'kd_student_feature_dim': None, 'kd_teacher_feature_dim': None,
    'kd_token_distill_type': 'soft'}
# train.py's own default of `amp_dtype`, written into every args.yaml: it leaves the choice to the device here
_TIMM_DEFAULT_AMP_DTYPE = 'float16'
# settings whose empty string means something (not train.py's "not set"): the image-folder dataset, ...
_EMPTY_MEANS_SOMETHING = frozenset({'dataset', 'interpolation', 'lr_base_scale'})
_TUPLE_FIELDS = frozenset(f.name for f in fields(TrainConfig) if 'Tuple' in str(f.type))


def load_timm_args(path: str) -> Dict[str, Any]:
    """The `TrainConfig` settings of a timm `train.py` recipe: its `args.yaml` (or any YAML of its flags).

    Settings of the machine and logging (`device`, `data_dir`, `workers`, `output`, `log_wandb`, ...) are left
    out; a setting this trainer does not have raises `ConfigError` unless it has train.py's default value; other
    unknown keys are ignored with a warning. Empty strings (train.py's "not set") become None, but the dataset ''
    (an image folder). train.py's default `amp_dtype: float16` becomes None: the device's default here.
    """
    import yaml  # timm's own dependency

    try:
        with open(path) as f:
            recipe = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f'cannot read the config file {path}: {e}') from e
    if not isinstance(recipe, dict):
        raise ConfigError(f'{path} is not a YAML mapping of train.py flags (e.g. `opt: lamb`).')
    known = {f.name for f in fields(TrainConfig)} - _TIMM_MACHINE_KEYS
    refused = {k: v for k, v in recipe.items() if k in _TIMM_UNSUPPORTED and v not in (_TIMM_UNSUPPORTED[k], '')}
    if refused:
        raise ConfigError(f'{path} sets train.py options this trainer does not have: '
                          f"{', '.join(f'{k}={v!r}' for k, v in refused.items())}; remove them, or train with timm's "
                          f'train.py (--device-modules timm_affinediv).')
    ignored = sorted(set(recipe) - known - _TIMM_MACHINE_KEYS - set(_TIMM_UNSUPPORTED))
    if ignored:
        _logger.warning(f"{path}: ignoring settings this trainer does not know: {', '.join(ignored)}")
    settings = {}
    for key, value in recipe.items():
        if key not in known:
            continue
        if value == '' and key not in _EMPTY_MEANS_SOMETHING:
            value = None
        if key == 'amp_dtype' and value == _TIMM_DEFAULT_AMP_DTYPE:
            value = None  # float16 on CUDA as in train.py, bfloat16 (the CPU default of `amp`) on CPU
        if isinstance(value, list) and key in _TUPLE_FIELDS:
            value = tuple(value)
        settings[key] = value
    return settings

""" Recovering accuracy with labels after a conversion: fine-tuning the converted model on the labelled training split
with the original as teacher, for a budget of images, stopped by a rule on held-out top-1

The conversion (`timm_affinediv.convert`) needs no labels and keeps what PatchNorm can express of the original; what
its division loses on some families no label-free fit recovers. `recover_model` is the second half of that journey:
a run of `train.Trainer` (its distillation, checkpoints and exact resume) whose schedule spans exactly the budget,
evaluated on held-out images as it goes, then the Hub folder whose card gives the original's, the converted and the
recovered top-1 and the images spent:

    converted, report, _ = convert_to_folder(original, 'runs/r18/converted')
    recovered, report = recover_model(original, converted, RecoverOptions(epochs=0.25),
                                      train=TrainConfig(dataset='fashion-mnist', output='runs/r18'))

`timm-affinediv convert ... --recover` runs both from the command line.
"""
import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn

from ._timm_compat import get_model_args
from .convert import model_in_chans
from .convert.rebuild import architecture
from .errors import ConfigError
from .files import atomic_write, save_safetensors
from .model_io import convert_to_folder, load_trained_model
from .publish import publish_run
from .train import TrainConfig, Trainer, TrainResult, final_top1, resolve_checkpoint

__all__ = ['RecoverOptions', 'RecoveryReport', 'recover_model', 'REPORT_NAME', 'CONVERTED_FOLDER']

_logger = logging.getLogger(__name__)

#: The report's file name, in the run folder and in the recovered model's Hub folder.
REPORT_NAME = 'recovery_report.json'
#: Where `recover_model` keeps the converted model it makes itself, under the run folder.
CONVERTED_FOLDER = 'converted'


@dataclass
class RecoverOptions:
    """ The recovery's recipe: budget, evaluations and stop rule, optimiser and schedule, distillation, augmentation.

    The defaults, chosen on measured curves (docs/families.md, `scripts/measure_family_recovery.py`): one epoch of
    the training split in batches of 64, AdamW at a peak learning rate of 1e-4 (weight decay 0.05), a linear warm-up
    over the first 5% of the budget, then a cosine to 0 at its last update; the loss blends label-smoothed (0.1)
    cross-entropy and the distillation from the original half and half, at temperature 2; the images as the
    evaluation reads them (no crops, no flips: the measured originals were trained without augmentation; give an
    original trained with it its own `scale` and `hflip`); 8 evaluations over the budget, stopping after 2 in a row
    that do not better the best top-1, and the converted model returned where none betters it. Every parameter
    trains from the first update.

    Args:
        epochs: the budget, in epochs of the training split; a fraction (0.125) is that share of its images. The
            schedule spans exactly it, so each budget is a finished schedule.
        evaluations: held-out evaluations (and checkpoints) spread evenly over the budget, the last at its end.
        patience: stop after this many evaluations in a row that do not better the best held-out top-1; the best
            evaluation's weights are then the result (None: no plateau rule).
        target_top1: stop at the first evaluation whose held-out top-1 (%) reaches this (None: no target).
        batch_size: images per update.
        opt: the timm optimiser (`create_optimizer_v2`).
        lr: the peak learning rate.
        weight_decay: the optimiser's weight decay.
        warmup: the fraction of the budget over which the learning rate rises to `lr`.
        min_lr: the learning rate the cosine ends at.
        distill_weight: the weight of the distillation from the original in the loss (1 - it: the labels').
        distill_temperature: the distillation's softmax temperature.
        smoothing: label smoothing of the labels' cross-entropy.
        scale: the area range of the random resized crops.
        hflip: the probability of a horizontal flip.
        mixup: timm's mixup alpha (0: off); the original sees the same mixed images as the converted model.
        keep_converted: where no evaluation's held-out top-1 is above the converted model's, return the converted
            model (its weights, its top-1) rather than the trained one.
        seed: the seed of the data order, the augmentation and the new parameters.
    """
    epochs: float = 1.0
    evaluations: int = 8
    patience: Optional[int] = 2
    target_top1: Optional[float] = None
    batch_size: int = 64
    opt: str = 'adamw'
    lr: float = 1e-4
    weight_decay: float = 0.05
    warmup: float = 0.05
    min_lr: float = 0.
    distill_weight: float = 0.5
    distill_temperature: float = 2.0
    smoothing: float = 0.1
    scale: Tuple[float, float] = (1.0, 1.0)
    hflip: float = 0.
    mixup: float = 0.
    keep_converted: bool = True
    seed: int = 0

    def validate(self) -> None:
        """Raise `ConfigError` for values that cannot work, naming the option."""
        checks = [
            (self.epochs > 0, f'the budget (epochs) must be > 0, got {self.epochs}'),
            (self.evaluations >= 1, f'evaluations must be >= 1, got {self.evaluations}'),
            (self.patience is None or self.patience >= 1, f'patience must be >= 1 (or None), got {self.patience}'),
            (self.target_top1 is None or 0 < self.target_top1 <= 100,
             f'target_top1 is a top-1 in % (0, 100], got {self.target_top1}'),
            (self.batch_size >= 1, f'batch_size must be >= 1, got {self.batch_size}'),
            (self.lr > 0, f'lr must be > 0, got {self.lr}'),
            (0 <= self.warmup < 1, f'warmup is a fraction of the budget in [0, 1), got {self.warmup}'),
            (self.mixup >= 0, f'mixup is an alpha >= 0 (0: off), got {self.mixup}'),
            (0 < self.scale[0] <= self.scale[1] <= 1, f'scale is an area range 0 < MIN <= MAX <= 1, got {self.scale}'),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def train_settings(self) -> Dict[str, Any]:
        """The `TrainConfig` settings of the recipe."""
        return dict(
            epochs=self.epochs, evaluations=self.evaluations, stop_patience=self.patience,
            stop_target=self.target_top1, eval_metric='top1', batch_size=self.batch_size, opt=self.opt, lr=self.lr,
            lr_base=None, weight_decay=self.weight_decay, sched='cosine', sched_on_updates=True,
            warmup_epochs=self.warmup * self.epochs, warmup_prefix=False, cooldown_epochs=0, min_lr=self.min_lr,
            distill_weight=self.distill_weight, distill_temperature=self.distill_temperature,
            smoothing=self.smoothing, scale=tuple(self.scale), hflip=self.hflip, mixup=self.mixup,
            train_interpolation='', seed=self.seed)

    def to_dict(self) -> Dict[str, Any]:
        """The options as JSON values (the crop's area range a list)."""
        return dict(dataclasses.asdict(self), scale=list(self.scale))


@dataclass
class RecoveryReport:
    """ What `recover_model` did: the top-1 (%) of the original, of the converted model and of the recovered one on
    the same held-out images (`eval_set`), the training images spent of the budget's, why it stopped ('budget',
    'target', 'plateau' or 'converted'), after how many images the returned weights were evaluated
    (`kept_images`: the best evaluation's on a plateau; 0 where no evaluation bettered the converted model and it
    was kept), and the curve: each evaluation's images spent, held-out top-1 and learning rate.
    """
    original_top1: float
    converted_top1: float
    recovered_top1: float
    images: int
    budget_images: int
    stopped: str
    kept_images: int
    eval_set: str
    curve: List[Dict[str, float]] = field(default_factory=list)
    options: Dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The three top-1s, the images spent and why it stopped, in one sentence."""
        why = {'budget': 'at the end of its budget', 'target': 'on reaching the target top-1',
               'plateau': f"after {self.options.get('patience')} evaluations without a better top-1, the best "
                          f'(after {self.kept_images:,} images) kept',
               'converted': 'with no evaluation above the converted model, which is kept'}[self.stopped]
        return (f'top-1: original {self.original_top1:.2f}%, converted {self.converted_top1:.2f}%, recovered '
                f'{self.recovered_top1:.2f}% after {self.images:,} of {self.budget_images:,} training images, stopped '
                f'{why}')

    def format_table(self) -> str:
        """The three top-1s as a markdown table."""
        return '\n'.join([
            '| Model | Top-1 (%) |', '|---|---:|',
            f'| original | {self.original_top1:.2f} |',
            f'| converted (no labels) | {self.converted_top1:.2f} |',
            f'| recovered ({self.images:,} training images) | {self.recovered_top1:.2f} |'])


def _converted_model(original: nn.Module, train: TrainConfig) -> nn.Module:
    """The conversion of `original` on the training split with `convert_to_folder`'s defaults, written to (and, on
    resume, read back from) `<output>/converted`."""
    folder = Path(train.output) / CONVERTED_FOLDER
    if train.resume and (folder / 'config.json').is_file():
        return load_trained_model(f'local-dir:{folder}')
    converted, _, _ = convert_to_folder(original, str(folder), dataset=train.dataset, data_dir=train.data_dir,
                                        eval_images=0, overwrite=True)
    return converted


def _card_recipe(report: RecoveryReport, dataset: str) -> str:
    o = report.options
    return (f"Converted to PatchNorm from the original without labels, then fine-tuned on the labelled {dataset} "
            f"training split with the original as teacher: {o['opt']} at a peak learning rate of {o['lr']:g}, "
            f"{100 * o['warmup']:g}% warm-up then a cosine to {o['min_lr']:g} over a budget of {o['epochs']:g} "
            f"epochs ({report.budget_images:,} images), distillation weight {o['distill_weight']:g} at temperature "
            f"{o['distill_temperature']:g}. {report.describe()} ({REPORT_NAME} has the curve).\n\n"
            f'{report.format_table()}')


def _with_conversion(result: TrainResult, conversion: Dict[str, Any], metrics: Dict[str, float],
                     write: bool) -> TrainResult:
    """`result` with the converted model's weights (in its model and, where `write`, its weights file) and held-out
    metrics."""
    result.model.load_state_dict(conversion)
    if write:
        save_safetensors(result.model.state_dict(), result.weights_file)
    return dataclasses.replace(result, metrics=dict(images=0, **{f'val_{k}': v for k, v in metrics.items()}))


def recover_model(
        original: nn.Module,
        converted: Optional[nn.Module] = None,
        options: Optional[RecoverOptions] = None,
        *,
        train: Optional[TrainConfig] = None,
        base_model: Optional[str] = None,
        base_model_description: Optional[str] = None,
) -> Tuple[nn.Module, RecoveryReport]:
    """ Fine-tune `converted` (the conversion of `original`) on labels with `original` as teacher, by `options`.

    Args:
        original: the trained model that was converted: the teacher, and the top-1 to recover.
        converted: its conversion (`convert_model`, `convert_to_folder`); None: converted here with
            `convert_to_folder`'s defaults into `<output>/converted` (read back from there on resume).
        options: the recipe, budget and stop rule (`RecoverOptions`; its defaults where None).
        train: the run's data, machine and output (`dataset`, `data_dir`, `train_subset`, `val_subset` (the held-out
            images), `workers`, `device`, `amp`, `output`, `resume` (a run folder or checkpoint to continue), ...);
            its recipe settings are replaced by the options'. The held-out top-1 is on its validation split, never
            trained on.
        base_model, base_model_description: the original on the card (its Hub id; in words where it has none).

    Returns:
        The recovered model (on the run's device) and the report, also written as `<output>/recovery_report.json`;
        `<output>/model` is the recovered model's Hub folder, its card giving the three top-1s and the images spent.
        An interrupt (Ctrl-C, SIGTERM) raises `TrainingInterrupted` after a checkpoint: the same call with
        `train.resume=<output>` continues to the result of an uninterrupted run.
    """
    start = time.perf_counter()
    options = options or RecoverOptions()
    options.validate()
    train = train or TrainConfig(output='runs/recover')
    if converted is None:
        converted = _converted_model(original, train)
    cfg = dataclasses.replace(
        train, **options.train_settings(), model=architecture(converted),
        norm_layer=get_model_args(converted).get('norm_layer'), num_classes=converted.num_classes,
        in_chans=model_in_chans(converted), teacher=None, resume=None)
    trainer = Trainer(cfg, model=converted, teacher=original)
    # measured before the checkpoint is read: on resume the model's weights are no longer the conversion's
    before = dict(original=trainer.evaluate(trainer.teacher), converted=trainer.evaluate())
    conversion = ({k: v.detach().clone() for k, v in trainer.final_model.state_dict().items()}
                  if options.keep_converted else None)
    if train.resume:
        trainer.load_checkpoint(resolve_checkpoint(train.resume))
    result = trainer.fit()
    stopped = result.stopped or 'budget'
    if options.keep_converted and max(final_top1(h) for h in result.history) <= before['converted']['top1']:
        result = _with_conversion(result, conversion, before['converted'], write=trainer.is_primary)
        stopped = 'converted'
    per_update = cfg.batch_size * cfg.grad_accum_steps * trainer.world_size
    report = RecoveryReport(
        original_top1=before['original']['top1'], converted_top1=before['converted']['top1'],
        recovered_top1=final_top1(result.metrics), images=result.images,
        budget_images=trainer.total_updates * per_update, stopped=stopped,
        kept_images=int(result.metrics['images']), eval_set=result.eval_set,
        curve=[dict(images=h['images'], top1=final_top1(h), lr=h['lr']) for h in result.history],
        options=options.to_dict(), seconds=round(time.perf_counter() - start, 1))
    if trainer.is_primary:
        text = json.dumps(report.to_dict(), indent=2)
        atomic_write(Path(cfg.output) / REPORT_NAME, text)
        folder = publish_run(result, dataset=cfg.dataset, data_dir=cfg.data_dir, base_model=base_model,
                             recipe=_card_recipe(report, cfg.dataset or cfg.data_dir),
                             base_model_description=base_model_description, extra_files={REPORT_NAME: text},
                             overwrite=True)
        _logger.info(f'{report.describe()}; Hub-ready folder {folder}')
    return result.model, report

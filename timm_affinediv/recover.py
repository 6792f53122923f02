""" Recovering accuracy with labels after a conversion: fine-tuning the converted model on the labelled training split
with the original as teacher, at a learning rate chosen on held-out images, for a budget of images, stopped by a rule
on held-out loss and its noise

The conversion (`timm_affinediv.convert`) needs no labels and keeps what PatchNorm can express of the original; what
its division loses on some families no label-free fit recovers. `recover_model` is the second half of that journey:
a run of `train.Trainer` (its distillation, checkpoints and exact resume) whose schedule spans exactly the budget,
evaluated on held-out images as it goes, then the Hub folder whose card gives the original's, the converted and the
recovered top-1 and the images spent:

    converted, report, _ = convert_to_folder(original, 'runs/r18/converted', dataset='fashion-mnist')
    recovered, report = recover_model(original, converted, RecoverOptions(epochs=0.25),
                                      train=TrainConfig(dataset='fashion-mnist', output='runs/r18'))

`timm-affinediv convert ... --recover` runs both from the command line.
"""
import copy
import dataclasses
import json
import logging
import tempfile
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
#: The rate sweep's rows, in the run folder: a resumed recovery reads the rate back.
SWEEP_RECORD = 'lr-sweep.json'


@dataclass
class RecoverOptions:
    """ The recovery's recipe: budget, evaluations and stop rule, the rate's choice, optimiser and schedule,
    distillation, augmentation.

    By default: one epoch of the training split in batches of 64; AdamW (weight decay 0.05) at the peak rate of
    `lr_sweep` whose short run from the conversion ends with the lowest held-out loss (the sweep's runs together take
    `sweep_share` of the budget's images); a linear warm-up over the first 5% of the budget, then a cosine to 0 at
    its last update; the loss blends label-smoothed (0.1) cross-entropy and the distillation from the original half
    and half, at temperature 2; the images as the evaluation reads them; 8 held-out evaluations over the budget,
    judged on the held-out cross-entropy, stopping after 2 in a row worse than the best by more than 2 standard
    errors (the best then kept); the conversion returned only where its held-out loss is below the trained model's.

    Args:
        epochs: the budget, in epochs of the training split; a fraction (0.125) is that share of its images. The
            schedule spans exactly it, so each budget is a finished schedule.
        evaluations: held-out evaluations (and checkpoints) spread evenly over the budget, the last at its end.
        metric: what the evaluations are judged on: 'loss' (held-out cross-entropy, lower is better) or 'top1'.
        patience: stop after this many evaluations in a row that count against the best (`stop_noise`); the best
            evaluation's weights are then the result (None: no plateau rule).
        stop_noise: an evaluation counts against the best only where it is worse by more than this many standard
            errors of the difference (None: where it does not better it, noise or not).
        target_top1: stop at the first evaluation whose held-out top-1 (%) reaches this (None: no target).
        batch_size: images per update.
        opt: the timm optimiser (`create_optimizer_v2`).
        lr: the peak learning rate; None: chosen by the sweep.
        lr_sweep: the peak rates the sweep tries, each in a run of `sweep_share / len(lr_sweep)` of the budget from
            the conversion, with the budget's schedule shape, judged on `metric` at its end.
        sweep_share: the share of the budget's images the sweep takes, counted in the images spent.
        weight_decay: the optimiser's weight decay.
        warmup: the fraction of the budget over which the learning rate rises to `lr`.
        min_lr: the learning rate the cosine ends at.
        distill_weight: the weight of the distillation from the original in the loss (1 - it: the labels').
        distill_temperature: the distillation's softmax temperature.
        smoothing: label smoothing of the labels' cross-entropy.
        scale: the area range of the random resized crops.
        hflip: the probability of a horizontal flip.
        mixup: timm's mixup alpha (0: off); the original sees the same mixed images as the converted model.
        keep_converted: where the trained model is not better than the conversion on `metric`, return the
            converted model (its weights, its top-1) rather than the trained one.
        seed: the seed of the data order, the augmentation and the new parameters.
    """
    epochs: float = 1.0
    evaluations: int = 8
    metric: str = 'loss'
    patience: Optional[int] = 2
    stop_noise: Optional[float] = 2.0
    target_top1: Optional[float] = None
    batch_size: int = 64
    opt: str = 'adamw'
    lr: Optional[float] = None
    lr_sweep: Tuple[float, ...] = (1e-4, 3e-4, 1e-3)
    sweep_share: float = 0.1
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
            (self.metric in ('loss', 'top1'), f"metric is 'loss' or 'top1', got '{self.metric}'"),
            (self.stop_noise is None or self.stop_noise >= 0, f'stop_noise must be >= 0 (or None), got '
                                                              f'{self.stop_noise}'),
            (self.lr is None or self.lr > 0, f'lr must be > 0 (or None: chosen by the sweep), got {self.lr}'),
            (self.lr is not None or (self.lr_sweep and all(r > 0 for r in self.lr_sweep)),
             f'lr_sweep needs at least one rate, each > 0, got {self.lr_sweep}'),
            (0 < self.sweep_share < 1, f'sweep_share is a share of the budget in (0, 1), got {self.sweep_share}'),
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
            epochs=self.epochs, evaluations=self.evaluations, stop_patience=self.patience, stop_noise=self.stop_noise,
            stop_target=self.target_top1, stop_target_metric='top1', eval_metric=self.metric,
            batch_size=self.batch_size, opt=self.opt, lr=self.lr,
            lr_base=None, weight_decay=self.weight_decay, sched='cosine', sched_on_updates=True,
            warmup_epochs=self.warmup * self.epochs, warmup_prefix=False, cooldown_epochs=0, min_lr=self.min_lr,
            distill_weight=self.distill_weight, distill_temperature=self.distill_temperature,
            smoothing=self.smoothing, scale=tuple(self.scale), hflip=self.hflip, mixup=self.mixup,
            train_interpolation='', seed=self.seed)

    def to_dict(self) -> Dict[str, Any]:
        """The options as JSON values (tuples as lists)."""
        return dict(dataclasses.asdict(self), scale=list(self.scale), lr_sweep=list(self.lr_sweep))


@dataclass
class RecoveryReport:
    """ What `recover_model` did: the top-1 (%) of the original, of the converted model and of the recovered one on
    the same held-out images (`eval_set`, `eval_images` of them; `top1_se`: the recovered top-1's standard error),
    the training images of the run of the budget's, why it stopped ('budget', 'target', 'plateau' or 'converted'),
    after how many images the returned weights were evaluated (`kept_images`: the best evaluation's on a plateau; 0
    where the conversion was kept), the curve (each evaluation's images, held-out top-1, loss and its standard error,
    learning rate), the peak rate `lr` and, where the sweep chose it, each rate's short run (`lr_sweep`) and the
    training images it took (`sweep_images`, besides `images`).
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
    lr: float = 0.
    lr_sweep: List[Dict[str, float]] = field(default_factory=list)
    sweep_images: int = 0
    eval_images: int = 0
    top1_se: float = 0.

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The three top-1s, the images spent, the rate and why it stopped, in one sentence."""
        metric = 'loss' if self.options.get('metric', 'top1') == 'loss' else 'top-1'
        why = {'budget': 'at the end of its budget', 'target': 'on reaching the target top-1',
               'plateau': f"after {self.options.get('patience')} evaluations with a worse held-out {metric} than the "
                          f'best (after {self.kept_images:,} images), which is kept',
               'converted': f'with the converted model better on held-out {metric}, which is kept'}[self.stopped]
        rate = (f'{self.lr:g}, chosen by {self.sweep_images:,} images of short runs at ' +
                ', '.join(f"{r['lr']:g}" for r in self.lr_sweep) if self.lr_sweep else f'{self.lr:g}')
        return (f'top-1: original {self.original_top1:.2f}%, converted {self.converted_top1:.2f}%, recovered '
                f'{self.recovered_top1:.2f}% after {self.images:,} of {self.budget_images:,} training images at a '
                f'peak rate of {rate}; stopped {why}')

    def format_table(self) -> str:
        """The three top-1s as a markdown table, with the evaluation's noise."""
        return '\n'.join([
            '| Model | Top-1 (%) |', '|---|---:|',
            f'| original | {self.original_top1:.2f} |',
            f'| converted (no labels) | {self.converted_top1:.2f} |',
            f'| recovered ({self.images + self.sweep_images:,} training images) | {self.recovered_top1:.2f} |',
            '', f'Top-1 on {self.eval_images:,} held-out images; the standard error of the recovered figure is '
                f'{self.top1_se:.2f} points.'])


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
            f"training split with the original as teacher: {o['opt']}, {100 * o['warmup']:g}% warm-up then a cosine "
            f"to {o['min_lr']:g} over a budget of {o['epochs']:g} epochs ({report.budget_images:,} images), "
            f"distillation weight {o['distill_weight']:g} at temperature {o['distill_temperature']:g}. "
            f"{report.describe()} ({REPORT_NAME} has the curve).\n\n{report.format_table()}")


def _sweep_rate(original: nn.Module, converted: nn.Module, options: RecoverOptions, cfg: TrainConfig,
                resume: bool) -> List[Dict[str, float]]:
    """ Each rate of `options.lr_sweep` in its own short run from `converted` (a finished schedule of the budget's
    shape over `sweep_share / len(lr_sweep)` of it), evaluated once at its end: one row per rate with the training
    images it took and the held-out metrics. Recorded in `<output>/lr-sweep.json`, which a resumed recovery reads
    back instead of sweeping again (`resume`). """
    record = Path(cfg.output) / SWEEP_RECORD
    if resume and record.is_file():
        rows = json.loads(record.read_text())
        if [r['lr'] for r in rows] == list(options.lr_sweep):
            return rows
    epochs = options.epochs * options.sweep_share / len(options.lr_sweep)
    rows, primary = [], True
    with tempfile.TemporaryDirectory(prefix='lr-sweep-') as scratch:
        for rate in options.lr_sweep:
            run = dataclasses.replace(cfg, epochs=epochs, lr=rate, warmup_epochs=options.warmup * epochs,
                                      evaluations=1, stop_patience=None, stop_target=None,
                                      output=str(Path(scratch) / f'lr-{rate:g}'), progress=False)
            trainer = Trainer(run, model=copy.deepcopy(converted), teacher=original)
            result = trainer.fit()
            primary = trainer.is_primary
            m = result.metrics
            rows.append(dict(lr=rate, images=result.images, loss=m['val_loss'], loss_se=m['val_loss_se'],
                             top1=m['val_top1'], top1_se=m['val_top1_se']))
            _logger.info(f"rate sweep: {rate:g} -> held-out loss {m['val_loss']:.4f} ± {m['val_loss_se']:.4f}, "
                         f"top-1 {m['val_top1']:.2f}% after {result.images:,} images")
    if primary:
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(record, json.dumps(rows, indent=2))
    return rows


def _swept_rate(rows: List[Dict[str, float]], metric: str) -> float:
    """The rate of the sweep's best row on `metric` (the smaller rate on a tie)."""
    best = min(rows, key=lambda r: (r[metric] if metric == 'loss' else -r[metric], r['lr']))
    return best['lr']


def _dataset_size(loader) -> int:
    """The images of `loader`'s dataset (0 for a stream, whose size is not known)."""
    try:
        return len(loader.dataset)
    except TypeError:
        return 0


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
        train: TrainConfig,
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
    if converted is None:
        converted = _converted_model(original, train)
    cfg = dataclasses.replace(
        train, **options.train_settings(), model=architecture(converted),
        norm_layer=get_model_args(converted).get('norm_layer'), num_classes=converted.num_classes,
        in_chans=model_in_chans(converted), teacher=None, resume=None)
    sweep = [] if options.lr is not None else _sweep_rate(original, converted, options, cfg, bool(train.resume))
    cfg = dataclasses.replace(cfg, lr=options.lr if options.lr is not None else _swept_rate(sweep, options.metric))
    trainer = Trainer(cfg, model=converted, teacher=original)
    # measured before the checkpoint is read: on resume the model's weights are no longer the conversion's
    before = dict(original=trainer.evaluate(trainer.teacher), converted=trainer.evaluate())
    conversion = ({k: v.detach().clone() for k, v in trainer.final_model.state_dict().items()}
                  if options.keep_converted else None)
    if train.resume:
        trainer.load_checkpoint(resolve_checkpoint(train.resume))
    result = trainer.fit()
    stopped = result.stopped or 'budget'
    trained, kept = result.metrics[f'val_{options.metric}'], before['converted'][options.metric]
    if options.keep_converted and (trained >= kept if options.metric == 'loss' else trained <= kept):
        result = _with_conversion(result, conversion, before['converted'], write=trainer.is_primary)
        stopped = 'converted'
    per_update = cfg.batch_size * cfg.grad_accum_steps * trainer.world_size
    report = RecoveryReport(
        original_top1=before['original']['top1'], converted_top1=before['converted']['top1'],
        recovered_top1=final_top1(result.metrics), images=result.images,
        budget_images=trainer.total_updates * per_update, stopped=stopped,
        kept_images=int(result.metrics['images']), eval_set=result.eval_set,
        curve=[dict(images=h['images'], top1=final_top1(h), loss=h['val_loss'], loss_se=h['val_loss_se'], lr=h['lr'])
               for h in result.history],
        options=options.to_dict(), seconds=round(time.perf_counter() - start, 1), lr=cfg.lr, lr_sweep=sweep,
        sweep_images=sum(r['images'] for r in sweep), eval_images=_dataset_size(trainer.val_loader),
        top1_se=result.metrics['val_top1_se'])
    if trainer.is_primary:
        text = json.dumps(report.to_dict(), indent=2)
        atomic_write(Path(cfg.output) / REPORT_NAME, text)
        folder = publish_run(result, dataset=cfg.dataset, data_dir=cfg.data_dir, base_model=base_model,
                             recipe=_card_recipe(report, cfg.dataset or cfg.data_dir),
                             base_model_description=base_model_description, extra_files={REPORT_NAME: text},
                             overwrite=True)
        _logger.info(f'{report.describe()}; Hub-ready folder {folder}')
    return result.model, report

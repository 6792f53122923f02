#!/usr/bin/env python3
""" Conversion of a trained BatchNorm/LayerNorm model of every README family to `patchnorm`, on originals trained
two ways, measured on Fashion-MNIST at 32x32. Top-1 of the original and of `convert_model`'s default conversion on
the 10k test images, their agreement there and on the held-out images the conversion checks itself on (after the
fit, and for the model returned), the conversion's seconds, its cost in forward passes and epochs, and what ran.

The conversion reads the images `timm-affinediv convert` reads (`model_io.conversion_images`): `--calib-batches`
batches of 64 training images, the next `--heldout-images` held out, the next `--distill-images` for the
distillation. Without `--checkpoint`, each original is trained first, by the recipe's plain loop, and kept under
`--runs/RECIPE/MODEL` with `train.json` (its schedule and held-out curve). `RECIPES` gives each recipe's optimiser,
rate, images and batch. `adamw` and `sgd` (the default `--recipes`) train without augmentation: a warm-up over half
an epoch, the peak rate until top-1 on 2000 held-out training images rises by less than 0.3 points an epoch over two
epochs (at most 30: `PLATEAU_RISE`, `MAX_EPOCHS`), then a cosine to 0 over a fifth more. `augmented` trains as timm
trains a published checkpoint: 4 one-cycle epochs with timm's training transform and `Mixup` (`AUGMENT`, `MIXUP`).
BatchNorm statistics are then re-estimated on 2048 training images. `--epochs E` trains E epochs instead, kept under
`--runs/RECIPE-Eep/MODEL`; docs/families.md's conversion table is `--epochs 2`.

    python scripts/measure_family_conversion.py                       # every family, adamw and sgd: the table
    python scripts/measure_family_conversion.py --models tinynet_e regnetx_002 --recipes sgd --train-only
    python scripts/measure_family_conversion.py --models tinynet_e --recipes adamw --distill-images 4096 \\
        --convert-kwargs distill.epochs=2 distill.threshold=1 --json runs/curve.jsonl
    python scripts/measure_family_conversion.py --models vit_tiny_patch16_224 \\
        --checkpoint runs/vit-tiny/model.safetensors
"""
import copy
import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from paper.models import FAMILIES
from timm.data import Mixup, create_transform
from timm.loss import SoftTargetCrossEntropy
from timm.utils import ParseKwargs
from torch.utils.data import DataLoader, Subset

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import non_negative_int, positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import ConvertOptions, convert_model
from timm_affinediv.data import create_eval_loader, create_image_dataset, resolve_dataset_data_config
from timm_affinediv.files import atomic_write, save_safetensors
from timm_affinediv.model_io import DISTILL_IMAGES, HELDOUT_IMAGES, conversion_images, load_trained_model


@dataclass
class Recipe:
    """How an original is trained: the optimiser, its peak learning rate and weight decay, epochs over the first
    `images` training images (a fixed random subset), the batch, and whether each batch is augmented (`Augmented`).
    `epochs` None: until held-out top-1 stops rising (`train`)."""
    optimizer: str
    lr: float
    weight_decay: float
    images: int
    batch_size: int
    epochs: Optional[int] = None
    augment: bool = False

    def folder(self, name: str) -> str:
        """The recipe's folder under --runs: its name, with the epochs where they are fixed."""
        return name if self.epochs is None else f'{name}-{self.epochs}ep'


RECIPES = {
    'adamw': Recipe('adamw', 3e-3, 0.05, images=4000, batch_size=64),
    'sgd': Recipe('sgd', 0.05, 5e-4, images=20000, batch_size=128),
    'augmented': Recipe('adamw', 3e-3, 0.05, images=20000, batch_size=64, epochs=4, augment=True),
}
#: The recipes measured without --recipes: the originals of the committed tables
DEFAULT_RECIPES = ['adamw', 'sgd']
#: The `augmented` recipe's per-image augmentation (`create_transform`'s training arguments) and `Mixup`'s
AUGMENT = dict(scale=(0.35, 1.), hflip=0.5, color_jitter=0., interpolation='random')
MIXUP = dict(mixup_alpha=0.2, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode='batch', label_smoothing=0.1,
             num_classes=10)
#: The plateau rule: held-out top-1 points an epoch, on this many held-out training images, within this many epochs
PLATEAU_RISE, PLATEAU_IMAGES, MAX_EPOCHS = 0.3, 2000, 30
#: The cosine after the plateau, as a share of the epochs run before it
DECAY_SHARE = 0.2
#: The name of an original's training record, beside its weights
TRAINING_RECORD = 'train.json'


@dataclass
class Schedule:
    """ The learning rate's factor at update `s` (0-based): `(s + 1) / warmup` over the warm-up, 1 until
    `decay_from`, then `(1 + cos(pi (s - decay_from) / (total - decay_from))) / 2`, reaching 0 at `total`."""
    warmup: int
    decay_from: Optional[int] = None
    total: Optional[int] = None

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        if self.decay_from is None or s < self.decay_from:
            return 1.
        return 0.5 * (1 + math.cos(math.pi * min(1., (s - self.decay_from) / max(1, self.total - self.decay_from))))

    def scaled(self, steps: int) -> 'Schedule':
        """The same shape over `steps` updates: each phase the same share of the run."""
        share = steps / self.total
        return Schedule(max(1, round(self.warmup * share)), round(self.decay_from * share), steps)


def _kwargs_text(kwargs: Dict[str, Any]) -> str:
    return ' '.join(f'{k}={v!r}'.replace(' ', '') for k, v in kwargs.items())


def _tensors(split: str, images: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first-`images` fixed random subset of a Fashion-MNIST split, read with the eval transforms (32x32)."""
    cfg = resolve_dataset_data_config('fashion-mnist', in_chans=1)
    loader = create_eval_loader('fashion-mnist', None, cfg, 500, split=split, subset=images, workers=0)
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


def held_out_indices(size: int, images: int) -> List[int]:
    """The last `images` of the fixed random order (seed 0) of a split of `size` images, the order `_tensors` and the
    conversion take their images from the front of, sorted."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(0))[-images:].sort().values.tolist()


def _tensors_held_out(images: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The training split's `held_out_indices`, read with the eval transforms."""
    cfg = resolve_dataset_data_config('fashion-mnist', in_chans=1)
    source = create_image_dataset('fashion-mnist', None, 'train', in_chans=1,
                                  transform=create_transform(**cfg, is_training=False))
    xs, ys = zip(*DataLoader(Subset(source, held_out_indices(len(source), images)), batch_size=500))
    return torch.cat(xs), torch.cat(ys)


class Augmented:
    """ The `augmented` recipe's batches: the images `_tensors('train', images)` reads (the same order), each read
    anew through timm's training transform (`AUGMENT`), then mixed by timm's `Mixup` into soft targets. The crops
    draw from `random`, the flips from torch, the mixing from numpy: all three seeded here, so a run is repeatable."""

    def __init__(self, images: int, seed: int = 0):
        random.seed(seed)
        np.random.seed(seed)
        cfg = resolve_dataset_data_config('fashion-mnist', in_chans=1)
        source = create_image_dataset('fashion-mnist', None, 'train', in_chans=1,
                                      transform=create_transform(**{**cfg, **AUGMENT}, is_training=True))
        order = torch.randperm(len(source), generator=torch.Generator().manual_seed(0))[:images]
        self.images = Subset(source, order.sort().values.tolist())  # `_tensors`' subset (`create_eval_loader`)
        self.mixup = Mixup(**MIXUP)

    def __call__(self, batch: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The augmented images at indices `batch` and their soft targets."""
        xs, ys = zip(*(self.images[i] for i in batch.tolist()))
        return self.mixup(torch.stack(xs), torch.tensor(ys))


def _optimizer(model: nn.Module, recipe: Recipe, steps: int, schedule: Optional[Schedule] = None):
    """The recipe's optimiser and, per update, `schedule`'s factor of its rate, or (None) its fixed-epochs schedule
    spanning `steps` updates."""
    if recipe.optimizer == 'adamw':
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr, momentum=0.9, nesterov=True,
                                    weight_decay=recipe.weight_decay)
    if schedule is not None:
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    if recipe.optimizer == 'adamw':
        return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=recipe.lr, total_steps=steps)
    warmup = max(1, steps // 20)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule(warmup, decay_from=warmup, total=steps))


def _step(model: nn.Module, optimizer, schedule, x: torch.Tensor, y: torch.Tensor) -> None:
    """One update on labels `y`, or on soft targets (`Augmented`'s: float, one row an image)."""
    loss = SoftTargetCrossEntropy()(model(x), y) if y.is_floating_point() else F.cross_entropy(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    schedule.step()


def _epoch(model: nn.Module, optimizer, schedule, x: torch.Tensor, y: torch.Tensor, batch_size: int,
           augmented: Optional[Augmented] = None) -> None:
    """One pass over (x, y) in a new random order, in whole batches (`augmented`'s view of them where given)."""
    model.train()
    order = torch.randperm(len(x))
    for i in range(len(x) // batch_size):
        batch = order[i * batch_size:(i + 1) * batch_size]
        _step(model, optimizer, schedule, *(augmented(batch) if augmented else (x[batch], y[batch])))


def _top1(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    return (_predictions(model, x) == y).float().mean().item() * 100


def plateaued(curve: List[float]) -> bool:
    """Whether the best held-out top-1 of `curve` (one per epoch) rose by less than `PLATEAU_RISE` points an epoch
    over its last two epochs (at least three epochs in)."""
    return len(curve) >= 3 and max(curve) - max(curve[:-2]) < 2 * PLATEAU_RISE


def train(name: str, kwargs: Dict[str, Any], path: Path, recipe: Recipe, seed: int = 0) -> Dict[str, Any]:
    """The original, by `recipe`'s plain loop (augmented where the recipe is: `Augmented`), for its epochs or (None)
    until `plateaued` then a cosine over a further `DECAY_SHARE` of them; BatchNorm statistics then re-estimated on
    2048 of the un-augmented images (the eval-mode model is the one trained). Its weights go to `path`, its record
    (`load_training`) beside them."""
    start = time.perf_counter()
    x, y = _tensors('train', recipe.images)
    torch.manual_seed(seed)
    model = timm.create_model(name, num_classes=10, in_chans=1, **kwargs)
    augmented = Augmented(recipe.images, seed) if recipe.augment else None
    per_epoch = len(x) // recipe.batch_size
    record: Dict[str, Any] = dict(steps_per_epoch=per_epoch, heldout_images=PLATEAU_IMAGES, schedule=None)
    if augmented:
        record.update(augment=AUGMENT, mixup=MIXUP)
    if recipe.epochs is not None:
        optimizer, schedule = _optimizer(model, recipe, recipe.epochs * per_epoch)
        for _ in range(recipe.epochs):
            _epoch(model, optimizer, schedule, x, y, recipe.batch_size, augmented)
        record.update(epochs=recipe.epochs)
    else:
        hx, hy = _tensors_held_out(PLATEAU_IMAGES)
        plan = Schedule(warmup=max(1, per_epoch // 2))
        optimizer, schedule = _optimizer(model, recipe, 0, plan)
        curve: List[float] = []
        while not plateaued(curve) and len(curve) < MAX_EPOCHS:
            _epoch(model, optimizer, schedule, x, y, recipe.batch_size, augmented)
            curve.append(_top1(model, hx, hy))
        decay_epochs = max(1, math.ceil(DECAY_SHARE * len(curve)))
        plan.decay_from, plan.total = len(curve) * per_epoch, (len(curve) + decay_epochs) * per_epoch
        for _ in range(decay_epochs):
            _epoch(model, optimizer, schedule, x, y, recipe.batch_size, augmented)
        record.update(epochs=len(curve) + decay_epochs, heldout_curve=curve, schedule=asdict(plan))
    model.train()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
                m.momentum = None
        for i in range(0, 2048, 256):
            model(x[i:i + 256])
    if recipe.epochs is None:
        record['heldout_top1'] = _top1(model, hx, hy)
    record['seconds'] = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(model.state_dict(), path)
    atomic_write(path.with_name(TRAINING_RECORD), json.dumps(record, indent=1))
    return record


def trained_original(name: str, kwargs: Dict[str, Any], recipe_name: str, recipe: Recipe, runs: str) -> Path:
    """The weights of `name` trained by `recipe`, kept under `runs` (RECIPE/MODEL/model.safetensors): trained there
    by `train` first where they are missing."""
    path = Path(runs) / recipe.folder(recipe_name) / name / 'model.safetensors'
    if not path.is_file():
        record = train(name, kwargs, path, recipe)
        print(f"trained {name} ({recipe_name}, {record['epochs']} epochs) in {record['seconds']:.0f} s: {path}",
              file=sys.stderr)
    return path


def append_row(path: Optional[str], row: Dict[str, Any]) -> None:
    """`row` appended to the JSON-lines file at `path` (none: nowhere), its folder made where missing."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, 'a') as f:
            f.write(json.dumps(row) + '\n')


def read_rows(path: Optional[str]) -> List[Dict[str, Any]]:
    """The rows `append_row` wrote to the JSON-lines file at `path` (none, or no file: no rows)."""
    if not path or not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def load_training(path: Path) -> Dict[str, Any]:
    """The record `train` wrote beside the weights at `path`: epochs, updates an epoch, schedule (None: the fixed
    epochs' own), held-out curve and top-1, seconds."""
    return json.loads(path.with_name(TRAINING_RECORD).read_text())


def epoch_seconds(model: nn.Module, recipe: Recipe, steps: int = 6) -> float:
    """One epoch of the recipe's training of `model`, from the time of `steps` steps (after one warm-up step) on a
    copy: what the conversion's cost is a fraction of."""
    model = copy.deepcopy(model).train()
    x = torch.randn(recipe.batch_size, 1, 32, 32)
    y = torch.randint(0, 10, (recipe.batch_size,))
    optimizer, schedule = _optimizer(model, recipe, steps + 1)
    _step(model, optimizer, schedule, x, y)
    start = time.perf_counter()
    for _ in range(steps):
        _step(model, optimizer, schedule, x, y)
    return (time.perf_counter() - start) / steps * (recipe.images / recipe.batch_size)


def forward_pass_seconds(model: nn.Module, batches: List[torch.Tensor]) -> float:
    """One forward pass of `model` over `batches`, the fastest of two."""
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            for b in batches:
                model(b)
            times.append(time.perf_counter() - start)
    return min(times)


def _predictions(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(x[i:i + 500]).argmax(1) for i in range(0, len(x), 500)])


def what_ran(report) -> str:
    """What ran after the fit, in a few words: the blocks reconstructed and their steps, the distillation's passes,
    images and the one kept."""
    ran = [b for b in report.blocks if b.steps]
    text = 'fit'
    if ran:
        text += f'; {len(ran)}/{len(report.blocks)} blocks reconstructed, {sum(b.steps for b in ran)} steps'
    d = report.distillation
    if d is not None:
        text += (f'; distilled {d.epochs} x {d.images} images' + (' (stopped early)' if d.stopped_early else '')
                 + (f', pass {d.kept_epoch} kept' if d.kept_epoch else ', fit kept'))
    return text


def measure(name: str, recipe_name: str, kwargs: Dict[str, Any], checkpoint: str, args) -> Dict[str, Any]:
    """One conversion measured: its row's figures."""
    recipe = RECIPES[recipe_name]
    model = load_trained_model(name, checkpoint=checkpoint, num_classes=10, in_chans=1, **kwargs)
    cfg = resolve_dataset_data_config('fashion-mnist', model, in_chans=1)
    options = ConvertOptions().updated(args.convert_kwargs)
    images = conversion_images('fashion-mnist', None, cfg, 64, calib_images=args.calib_batches * 64,
                               heldout_images=args.heldout_images, distill_images=args.distill_images,
                               seed=options.seed)
    tx, ty = _tensors('validation', args.test_images)
    start = time.perf_counter()
    converted, report = convert_model(model, calibration=images.calibration, heldout=images.heldout or None,
                                      distill_data=images.distill, options=options)
    seconds = time.perf_counter() - start
    print(report.format_table(), file=sys.stderr)
    original, ours = _predictions(model, tx), _predictions(converted.eval(), tx)
    top1, top1_converted = ((p == ty).float().mean().item() * 100 for p in (original, ours))
    d = report.distillation
    return dict(
        model=name, model_kwargs=_kwargs_text(kwargs), recipe=recipe_name, original=top1, converted=top1_converted,
        change=top1_converted - top1, test_agreement=(original == ours).float().mean().item() * 100,
        heldout_fitted=100 * report.agreement_fitted.top1, heldout=100 * report.agreement.top1,
        kl_fitted=report.agreement_fitted.kl, kl=report.agreement.kl, seconds=seconds,
        forward_passes=seconds / forward_pass_seconds(model, images.calibration),
        epochs_of_training=seconds / epoch_seconds(model, recipe), distill_images=images.distill_images,
        distill_epochs=d.epochs if d else 0, kept_epoch=d.kept_epoch if d else None,
        passes=[(p.top1, p.kl) for p in d.passes] if d else [], what_ran=what_ran(report),
        options=args.convert_kwargs)


def row(m: Dict[str, Any]) -> str:
    label = f"`{m['model']}`" + (f" ({m['model_kwargs']})" if m['model_kwargs'] else '')
    return (f"| {label} | {m['recipe']} | {m['original']:.2f} | {m['converted']:.2f} | **{m['change']:+.2f}** | "
            f"{m['test_agreement']:.1f}% | {m['heldout_fitted']:.1f}% -> {m['heldout']:.1f}% | {m['seconds']:.0f} | "
            f"{m['forward_passes']:.1f} | {m['epochs_of_training']:.2f} | {m['what_ran']} |")


def main(argv=None) -> int:
    parser = command_parser('measure_family_conversion', __doc__, prog='scripts/measure_family_conversion.py')
    parser.add_argument('--models', nargs='+', default=list(FAMILIES), help='timm model names (default: every family)')
    parser.add_argument('--recipes', nargs='+', default=DEFAULT_RECIPES, choices=list(RECIPES),
                        help='how the originals are trained (default: %(default)s)')
    parser.add_argument('--model-kwargs', nargs='*', default=None, action=ParseKwargs,
                        help="the model's arguments (default: the family's model in FAMILIES)")
    parser.add_argument('--checkpoint', help='the trained weights (safetensors) of the one model of --models, '
                                             'trained by the one recipe of --recipes')
    parser.add_argument('--runs', default='runs/family-conversion', help='where the trained originals are kept')
    parser.add_argument('--epochs', type=positive_int,
                        help="the originals' epochs, the schedule spanning them (default: until held-out top-1 "
                             'stops rising)')
    parser.add_argument('--train-images', type=positive_int, help="the recipes' images (default: each recipe's)")
    parser.add_argument('--train-only', action='store_true', help='train the missing originals and stop')
    parser.add_argument('--calib-batches', type=positive_int, default=32)
    parser.add_argument('--heldout-images', type=non_negative_int, default=HELDOUT_IMAGES)
    parser.add_argument('--distill-images', type=non_negative_int, default=DISTILL_IMAGES)
    parser.add_argument('--test-images', type=positive_int, default=10000)
    parser.add_argument('--convert-kwargs', nargs='*', default={}, action=ParseKwargs,
                        help="ConvertOptions over their defaults, by dotted names (e.g. distill.epochs=0)")
    parser.add_argument('--json', help='append each row as a JSON line to this file')
    args = parser.parse_args(argv)
    if args.checkpoint and (len(args.models) != 1 or len(args.recipes) != 1):
        parser.error('--checkpoint is the weights of one model: pass one name with --models, one with --recipes')
    for recipe in RECIPES.values():
        recipe.epochs, recipe.images = args.epochs or recipe.epochs, args.train_images or recipe.images
    rows = []
    for recipe in args.recipes:
        for name in args.models:
            kwargs = FAMILIES.get(name, {}) if args.model_kwargs is None else args.model_kwargs
            checkpoint = args.checkpoint or str(trained_original(name, kwargs, recipe, RECIPES[recipe], args.runs))
            if args.train_only:
                continue
            measured = measure(name, recipe, kwargs, checkpoint, args)
            rows.append(row(measured))
            print(rows[-1], file=sys.stderr, flush=True)
            append_row(args.json, measured)
    if rows:
        print('| model | recipe | original top-1 | converted top-1 | change | agreement (test) | agreement (held-out): '
              'fit -> returned | conversion s | forward passes | epochs of training | what ran |')
        print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|')
        print('\n'.join(rows))
        if not args.checkpoint:
            command = ['python', 'scripts/measure_family_conversion.py', '--models', *args.models, '--recipes',
                       *args.recipes, '--runs', args.runs, *(['--epochs', str(args.epochs)] if args.epochs else []),
                       '--train-only']
            print(f'\noriginals trained by: {shlex.join(command)}')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

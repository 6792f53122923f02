#!/usr/bin/env python3
""" Recovery with labels after the conversion, for every README family, measured on Fashion-MNIST at 32x32: top-1 on
the test images of the original, of its conversion and of the model `recover_model` makes from that conversion after
each budget (1/8, 1/4, 1/2 and 1 epoch of the original's training images, each its own finished schedule from the
same converted model). Beside them: the images spent, and PatchNorm trained from scratch by the original's recipe on
as many images and on the original's whole budget.

The originals are those of `measure_family_conversion.py` (the same recipes, kept under --runs), converted with
`convert_model`'s defaults on the images `timm-affinediv convert` reads. The recovery trains on the original's
training images and evaluates on the test images only at the end of its budget (`--recover-kwargs evaluations=1
patience=None` by default here: no choice is made on the test images, and the trained model is measured).
`--command-defaults` measures instead what `timm-affinediv convert --recover` gives a user: `RecoverOptions`' own
defaults, budget one epoch, its choices made on `--val-images` held-out training images (never trained on); its rows
keep the whole recovery report and are tabled per recipe (`--recipes augmented`: originals trained with timm's
usual augmentation). Each row is appended to --json as soon as it is measured, and a row already there is not
measured again, so a stopped sweep continues. Without --quick the sweep is every family, the adamw and sgd recipes
and the four budgets (hours on a CPU); --quick is one narrow ResNet-18 on 128 training and 64 test images.

    python scripts/measure_family_recovery.py --quick --json runs/recovery-quick.jsonl
    python scripts/measure_family_recovery.py --quick --command-defaults --recipes augmented
"""
import copy
import dataclasses
import gzip
import json
import math
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import timm
import torch
from measure_family_conversion import (
    DEFAULT_RECIPES,
    RECIPES,
    Augmented,
    Recipe,
    Schedule,
    _kwargs_text,
    _optimizer,
    _step,
    _tensors,
    _top1,
    append_row,
    held_out_indices,
    load_training,
    read_rows,
    trained_original,
)
from paper.models import FAMILIES
from timm.utils import ParseKwargs

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import non_negative_int, positive_float, positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import ConvertOptions, convert_model
from timm_affinediv.data import FASHION_MNIST_DIR, FashionMNIST, resolve_dataset_data_config
from timm_affinediv.files import save_safetensors
from timm_affinediv.model_io import DISTILL_IMAGES, HELDOUT_IMAGES, conversion_images, load_trained_model
from timm_affinediv.recover import RecoverOptions, recover_model
from timm_affinediv.train import TrainConfig, plateau_reached

BUDGETS = (0.125, 0.25, 0.5, 1.0)
#: `RecoverOptions` of the measurement over the defaults: one evaluation, at the budget's end, and no stop rule
MEASURED = dict(evaluations=1, patience=None, lr=1e-4)
#: The defaults `RecoverOptions` had before the rate sweep and the noise-aware stop rule, for the comparison
OLD_DEFAULTS = dict(lr=1e-4, metric='top1', stop_noise=None)
QUICK = dict(models=['resnet18'], budgets=[0.5, 1.0], epochs=1, train_images=128, calib_batches=2,
             heldout_images=64, distill_images=128, test_images=64, val_images=64)
#: The recovery's validation split with --command-defaults: this many held-out training images
VAL_IMAGES = 1024


def recipe_of(options: RecoverOptions) -> Dict[str, Any]:
    """The recovery's whole recipe, as a row keeps it: every option but the budget and the fallback to the
    conversion (the trained model is always measured)."""
    return {k: v for k, v in options.to_dict().items() if k not in ('epochs', 'keep_converted')}


def train_scratch(name: str, kwargs: Dict[str, Any], path: Path, recipe: Recipe, images: int,
                  schedule: Optional[Schedule], seed: int = 0) -> None:
    """`name` with `norm_layer='patchnorm'` trained from scratch by `recipe`'s optimiser and the original's schedule
    (`schedule` scaled to the run, or None: the fixed epochs' schedule spanning it) on `images` of the original's
    training images: passes over them, each in a new random order, augmented as the original was (`Augmented`)."""
    x, y = _tensors('train', recipe.images)
    torch.manual_seed(seed)
    model = timm.create_model(name, num_classes=10, in_chans=1, norm_layer='patchnorm', **kwargs)
    augmented = Augmented(recipe.images, seed) if recipe.augment else None
    steps = max(1, images // recipe.batch_size)
    optimizer, schedule = _optimizer(model, recipe, steps, schedule and schedule.scaled(steps))
    order = data_order(len(x), steps * recipe.batch_size)
    model.train()
    for i in range(steps):
        batch = order[i * recipe.batch_size:(i + 1) * recipe.batch_size]
        _step(model, optimizer, schedule, *(augmented(batch) if augmented else (x[batch], y[batch])))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(model.state_dict(), path)


def data_order(images: int, draws: int) -> torch.Tensor:
    """At least `draws` indices into `images` images: passes over them, each in a new random order."""
    return torch.cat([torch.randperm(images) for _ in range(math.ceil(draws / images))])


def family_rank(model: str) -> int:
    """Where `model` comes in `FAMILIES` (after them all where it is not there): the tables' order."""
    order = list(FAMILIES)
    return order.index(model) if model in order else len(order)


def scratch_top1(name: str, kwargs: Dict[str, Any], recipe_name: str, recipe: Recipe, images: int,
                 schedule: Optional[Schedule], args) -> float:
    """Test top-1 (%) of PatchNorm trained from scratch on `images` images (`train_scratch`), kept under --runs."""
    path = (Path(args.runs) / recipe.folder(recipe_name) / f'{name}-patchnorm-{images}-of-{recipe.images}'
            / 'model.safetensors')
    if not path.is_file():
        train_scratch(name, kwargs, path, recipe, images, schedule)
    model = load_trained_model(name, checkpoint=str(path), num_classes=10, in_chans=1, norm_layer='patchnorm',
                               **kwargs)
    x, y = _tensors('validation', args.test_images)
    return _top1(model, x, y)


def converted_model(original: torch.nn.Module, args) -> torch.nn.Module:
    """The conversion of `original` by `convert_model` on the images `timm-affinediv convert` reads."""
    cfg = resolve_dataset_data_config('fashion-mnist', original, in_chans=1)
    options = ConvertOptions().updated(args.convert_kwargs)
    images = conversion_images('fashion-mnist', None, cfg, 64, calib_images=args.calib_batches * 64,
                               heldout_images=args.heldout_images, distill_images=args.distill_images,
                               seed=options.seed)
    converted, _ = convert_model(original, calibration=images.calibration, heldout=images.heldout or None,
                                 distill_data=images.distill, options=options)
    return converted


def row_key(row: Dict[str, Any]) -> tuple:
    """What makes two rows the same measurement: a --command-defaults row (`defaults`, its `val_images`) is never
    the same as a fixed-budget one (rows without `defaults` are fixed-budget rows)."""
    return tuple(json.dumps(row[k], sort_keys=True) for k in (
        'model', 'model_kwargs', 'recipe', 'budget', 'train_images', 'fixed_epochs', 'test_images', 'options',
        'convert_options')) + (bool(row.get('defaults')), row.get('val_images'))


def _write_idx(path: Path, array) -> None:
    """`array` (uint8) as a gzipped IDX file, the format `FashionMNIST` reads, written whole or not at all."""
    header = struct.pack('>HBB', 0, 0x08, array.ndim) + struct.pack(f'>{array.ndim}I', *array.shape)
    part = path.with_name(path.name + '.part')
    with gzip.open(part, 'wb') as f:
        f.write(header + array.tobytes())
    os.replace(part, path)


def held_out_split(folder: Path, images: int) -> str:
    """A Fashion-MNIST folder under `folder` whose training split is the real one (linked) and whose validation split
    is the training split's last `images` (`held_out_indices`: never trained on by the originals or the recovery),
    so that the recovery's choices with --command-defaults never see the test images."""
    folder = folder / f'heldout-{images}'
    if not (folder / 't10k-labels-idx1-ubyte.gz').is_file():
        train = FashionMNIST(FASHION_MNIST_DIR, split='train')
        folder.mkdir(parents=True, exist_ok=True)
        for kind in ('images-idx3', 'labels-idx1'):
            link = folder / f'train-{kind}-ubyte.gz'
            if not link.exists():
                os.symlink(Path(FASHION_MNIST_DIR).resolve() / link.name, link)
        index = held_out_indices(len(train), images)
        _write_idx(folder / 't10k-images-idx3-ubyte.gz', train.images[index])
        _write_idx(folder / 't10k-labels-idx1-ubyte.gz', train.targets[index].astype('uint8'))
    return str(folder)


def measure(name: str, kwargs: Dict[str, Any], recipe_name: str, recipe: Recipe, budgets: List[float], done: set,
            args) -> List[Dict[str, Any]]:
    """The rows of one original not in `done`: its conversion, recovered after each budget, beside PatchNorm from
    scratch (with --command-defaults: on the whole budget only); each appended to --json as it is measured."""
    defaults = args.command_defaults
    options = recipe_of(RecoverOptions(**{**({} if defaults else MEASURED), **args.recover_kwargs}))
    base = dict(model=name, model_kwargs=_kwargs_text(kwargs), recipe=recipe_name, train_images=recipe.images,
                fixed_epochs=recipe.epochs, test_images=args.test_images, options=options,
                convert_options=args.convert_kwargs, defaults=defaults,
                **(dict(val_images=args.val_images) if defaults else {}))
    todo = [b for b in budgets if row_key(dict(base, budget=b)) not in done]
    if not todo:
        return []
    checkpoint = trained_original(name, kwargs, recipe_name, recipe, args.runs)
    training = load_training(checkpoint)
    schedule = training['schedule'] and Schedule(**training['schedule'])
    base.update(original_epochs=training['epochs'], original_seconds=training['seconds'])
    full = scratch_top1(name, kwargs, recipe_name, recipe, training['epochs'] * recipe.images, schedule, args)
    if args.originals_only:
        return []
    original = load_trained_model(name, checkpoint=str(checkpoint), num_classes=10, in_chans=1, **kwargs)
    converted = converted_model(original, args)
    if defaults:  # the test top-1s, measured here: the recovery's own are on its held-out validation split
        test = _tensors('validation', args.test_images)
        top1s = dict(original=_top1(original, *test), converted=_top1(converted, *test))
        data = dict(data_dir=held_out_split(Path(args.output), args.val_images))
    else:  # one evaluation, at the budget's end, on the test images: the recovery's own top-1s are the test's
        data = dict(val_subset=args.test_images)
    rows = []
    for budget in todo:
        start = time.perf_counter()
        output = (Path(args.output) / recipe.folder(recipe_name) / name
                  / f"{'defaults-' if defaults else ''}epochs-{budget:g}")
        train_cfg = TrainConfig(dataset='fashion-mnist', train_subset=recipe.images, workers=args.workers,
                                progress=False, output=str(output), **data)
        recipe_options = RecoverOptions(epochs=budget, **options, **({} if defaults else dict(keep_converted=False)))
        recovered, report = recover_model(original, copy.deepcopy(converted), recipe_options, train=train_cfg)
        if defaults:
            row = dict(base, budget=budget, images=report.images, **top1s, recovered=_top1(recovered.cpu(), *test),
                       stopped=report.stopped, scratch_full=full)
        else:
            row = dict(base, budget=budget, images=report.images, original=report.original_top1,
                       converted=report.converted_top1, recovered=report.recovered_top1, stopped=report.stopped,
                       scratch=scratch_top1(name, kwargs, recipe_name, recipe, report.images, schedule, args),
                       scratch_full=full)
        row.update(seconds=time.perf_counter() - start,
                   report={k: v for k, v in report.to_dict().items() if k != 'options'})
        rows.append(row)
        print(defaults_row(row) if defaults else table_row(row), file=sys.stderr, flush=True)
        append_row(args.json, row)
    return rows


def table_row(m: Dict[str, Any]) -> str:
    label = f"`{m['model']}`" + (f" ({m['model_kwargs']})" if m['model_kwargs'] else '')
    return (f"| {label} | {m['recipe']} | {m['budget']:g} | {m['images']} | {m['original']:.2f} | "
            f"{m['converted']:.2f} | **{m['recovered']:.2f}** | {m['recovered'] - m['original']:+.2f} | "
            f"{m['scratch']:.2f} | {m['scratch_full']:.2f} |")


#: A smaller difference (points of top-1) is not a verdict: two runs trained alike differ by more at the median
#: (docs/results/families.md, its seed pairs; tests/test_evidence.py holds the threshold to that record)
SEED_NOISE = 0.5
#: Top-1 of a guess among Fashion-MNIST's 10 classes; a model within a point of it has not trained
CHANCE_TOP1 = 10.


def verdict(last: Dict[str, Any]) -> str:
    """Convert or train from scratch, from the row of the largest budget: convert where the recovered model is within
    `SEED_NOISE` of PatchNorm from scratch on the original's whole budget (or above it); then how far it is from the
    original, and whether what stops it is the layer (PatchNorm from scratch is itself more than 0.3 below the
    original) or the recovery; neither is said where PatchNorm from scratch did not train (within a point of
    `CHANCE_TOP1`): the layer's own level is then not known."""
    recovered, original, scratch = last['recovered'], last['original'], last['scratch_full']
    choice = 'convert' if recovered >= scratch - SEED_NOISE else f'from scratch (+{scratch - recovered:.2f})'
    if recovered >= original - 0.3:
        return f'{choice}; within 0.3 of the original'
    below = f'{choice}; {original - recovered:.2f} below the original'
    if scratch < CHANCE_TOP1 + 1:
        return f"{below}; PatchNorm from scratch does not train by this recipe (chance): the layer's level is not known"
    stop = ('the layer: from scratch is ' + f'{original - scratch:.2f} below the original' if scratch < original - 0.3
            else 'the recovery')
    return f'{below}, stopped by {stop}'


def scratch_share(group: List[Dict[str, Any]]) -> str:
    """The images of the largest budget's recovery as a share of those PatchNorm from scratch needs to reach its
    top-1: scratch's top-1 is interpolated linearly in log images between its measured runs (each budget's images
    and the original's whole budget); past them, a bound."""
    last = max(group, key=lambda r: r['budget'])
    full_images = last['original_epochs'] * last['train_images']
    points = sorted({(r['images'], r['scratch']) for r in group} | {(full_images, last['scratch_full'])})
    target = last['recovered']
    if points[0][1] >= target:
        return f"> {100 * last['images'] / points[0][0]:.0f}%"
    for (i0, t0), (i1, t1) in zip(points, points[1:]):
        if t0 < target <= t1:
            needed = math.exp(math.log(i0) + (target - t0) / (t1 - t0) * (math.log(i1) - math.log(i0)))
            return f"{100 * last['images'] / needed:.0f}%"
    return f"< {100 * last['images'] / full_images:.0f}% (not reached)"


def summary_table(rows: List[Dict[str, Any]]) -> str:
    """One line per original (model and recipe): its top-1 and epochs, the conversion's, the recovered after each
    budget, PatchNorm from scratch on the images of the largest budget and on the original's whole budget, and the
    `verdict`, and the recovery's images as a share of those from scratch to the same top-1 (`scratch_share`)."""
    groups: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        if r['options'].get('seed', 0) == 0:
            groups.setdefault(row_key(dict(r, budget=None)), []).append(r)
    budgets = sorted({r['budget'] for r in rows})
    lines = ['| model | recipe | original (epochs) | converted | '
             + ' | '.join(f'recovered, {b:g} epoch' for b in budgets)
             + ' | from scratch, same images | from scratch, whole budget | images against from scratch | verdict |',
             '|---|---|---:|---:|' + '---:|' * len(budgets) + '---:|---:|---:|---|']
    defaults = recipe_of(RecoverOptions(**MEASURED))
    for group in sorted(groups.values(), key=lambda g: (family_rank(g[0]['model']), g[0]['model'], g[0]['recipe'])):
        by_budget = {r['budget']: r for r in group}
        last = by_budget[max(by_budget)]
        changed = {**{k: v for k, v in last['options'].items() if defaults.get(k) != v},
                   **{f'convert.{k}': v for k, v in last['convert_options'].items()}}
        label = f"`{last['model']}`" + (f" ({_kwargs_text(changed)})" if changed else '')
        cells = [f"{by_budget[b]['recovered']:.2f}" if b in by_budget else '' for b in budgets]
        lines.append(f"| {label} | {last['recipe']} | {last['original']:.2f} ({last['original_epochs']}) | "
                     f"{last['converted']:.2f} | " + ' | '.join(cells) + f" | {last['scratch']:.2f} | "
                     f"{last['scratch_full']:.2f} | {scratch_share(group)} | {verdict(last)} |")
    return '\n'.join(lines)


def defaults_row(r: Dict[str, Any]) -> str:
    """A --command-defaults row's line: the options it changes from `RecoverOptions`' defaults beside its model, the
    test top-1s, why it stopped, the training images it spent (with the rate's choice, where the report counts
    them apart) of its budget's, and PatchNorm from scratch on the original's whole budget."""
    base = recipe_of(RecoverOptions())
    changed = {**({'epochs': r['budget']} if r['budget'] != RecoverOptions().epochs else {}),
               **{k: v for k, v in r['options'].items() if base.get(k) != v},
               **{f'convert.{k}': v for k, v in r['convert_options'].items()}}
    label = f"`{r['model']}`" + (f" ({_kwargs_text(changed)})" if changed else '')
    report = r['report']
    spent = r['images'] + report.get('sweep_images', 0)
    return (f"| {label} | {r['original']:.2f} | {r['converted']:.2f} | **{r['recovered']:.2f}** | {r['stopped']} | "
            f"{spent:,} of {report['budget_images']:,} | {r['scratch_full']:.2f} |")


def defaults_tables(rows: List[Dict[str, Any]]) -> str:
    """Per recipe, the --command-defaults rows (`defaults_row`), in the families' order."""
    recipes = sorted({r['recipe'] for r in rows}, key=lambda n: (list(RECIPES) + [n]).index(n))
    tables = []
    for recipe in recipes:
        group = sorted((r for r in rows if r['recipe'] == recipe), key=lambda r: (
            family_rank(r['model']), r['model'], r['budget'], json.dumps(r['options'], sort_keys=True)))
        tables.append(f"With the command's defaults ({recipe} originals; test top-1; the recovery's choices on "
                      f"{group[0]['val_images']} held-out training images):\n\n"
                      '| family | original | converted | recovered (defaults) | stopped | images spent | '
                      'from scratch, whole budget |\n|---|---:|---:|---:|---|---:|---:|\n'
                      + '\n'.join(defaults_row(r) for r in group))
    return '\n\n'.join(tables)


def _options_are(row: Dict[str, Any], **over: Any) -> bool:
    """Whether a --command-defaults row was measured with `RecoverOptions()` changed by `over` alone."""
    return row['options'] == recipe_of(RecoverOptions(**over)) and not row['convert_options']


#: The peak rates measured beside the sweep's choice, each with today's stop rule, to judge the choice
FIXED_RATES = (3e-4, 1e-3)


def comparison_tables(rows: List[Dict[str, Any]]) -> str:
    """ Per recipe, each original's test top-1 recovered with the previous defaults (`OLD_DEFAULTS`) and with today's,
    the rate today's sweep chose, the training images spent (the sweep's included), PatchNorm from scratch on the
    original's whole budget, whether today's defaults reach the target (the higher of the original less 0.3 and
    PatchNorm from scratch), and, where measured, today's defaults at each of `FIXED_RATES` instead of the sweep."""
    kinds = [('new', {}), ('old', OLD_DEFAULTS)] + [(lr, dict(lr=lr)) for lr in FIXED_RATES]
    tables = []
    for recipe in sorted({r['recipe'] for r in rows}, key=lambda n: (list(RECIPES) + [n]).index(n)):
        by_model: Dict[str, Dict[Any, Dict[str, Any]]] = {}
        for r in rows:
            if r['recipe'] != recipe or r['budget'] != RecoverOptions().epochs:
                continue
            kind = next((k for k, over in kinds if _options_are(r, **over)), None)
            if kind is not None:
                by_model.setdefault(r['model'], {})[kind] = r
        rates = [lr for lr in FIXED_RATES if any(lr in kinds for kinds in by_model.values())]
        lines = [f'Previous defaults against today\'s ({recipe} originals, one epoch; test top-1):\n',
                 '| family | original | converted | previous defaults | defaults | change | rate chosen | images spent '
                 '| from scratch, whole budget | target met |' + ''.join(f' at {lr:g} |' for lr in rates),
                 '|---|---:|---:|---:|---:|---:|---:|---:|---:|---|' + '---:|' * len(rates)]
        for model in sorted(by_model, key=family_rank):
            measured = by_model[model]
            old, new = measured.get('old'), measured.get('new')
            some = new or old or next(iter(measured.values()))
            cells = [f"{old['recovered']:.2f}" if old else '', f"**{new['recovered']:.2f}**" if new else '',
                     f"{new['recovered'] - old['recovered']:+.2f}" if old and new else '']
            if new:
                report = new['report']
                target = max(some['original'] - 0.3, some['scratch_full'])
                spent = f"{new['images'] + report.get('sweep_images', 0):,} of {report['budget_images']:,}"
                cells += [f"{report['lr']:g}", spent, f"{some['scratch_full']:.2f}",
                          'yes' if new['recovered'] >= target else f"no ({new['recovered'] - target:+.2f})"]
            else:
                cells += ['', '', f"{some['scratch_full']:.2f}", '']
            cells += [f"{measured[lr]['recovered']:.2f}" if lr in measured else '' for lr in rates]
            lines.append(f"| `{model}` | {some['original']:.2f} | {some['converted']:.2f} | " + ' | '.join(cells)
                         + ' |')
        tables.append('\n'.join(lines))
    return '\n\n'.join(tables)


def stop_rule_table(rows: List[Dict[str, Any]]) -> str:
    """ The stop rules on the measured held-out curves of today's defaults: where each would have stopped (the
    evaluation, of the curve's), and whether the curve's end is better than what it would have kept. Today's rule:
    held-out loss, 2 evaluations worse than the best by more than 2 standard errors; the previous one: held-out top-1,
    2 evaluations that do not better the best. A stop is false where the end is better on the rule's own statistic
    (for the previous rule, by more than 2 standard errors of held-out top-1 too). Only curves that ran to their
    budget's end show where a rule would have stopped them."""
    lines = ['The stop rules on the held-out curves of today\'s defaults (evaluation it stops at, of the curve\'s; '
             'the end against what it keeps):\n',
             '| family | recipe | today\'s rule (loss, 2 SE) | end against kept, loss | previous rule (top-1) | '
             'end against kept, top-1 (2 SE) |', '|---|---|---:|---:|---:|---:|']
    stops = dict(new=[0, 0], old=[0, 0, 0])
    curves = 0
    for r in sorted((r for r in rows if _options_are(r) and r['report']['stopped'] in ('budget', 'converted')),
                    key=lambda r: (family_rank(r['model']), r['recipe'])):
        curve = r['report']['curve']
        loss, loss_se, top1 = ([p[k] for p in curve] for k in ('loss', 'loss_se', 'top1'))
        top1_se = [math.sqrt(max(t * (100 - t), 0.) / r['val_images']) for t in top1]
        curves += 1
        # a rule that fires at the last evaluation stops nothing early
        new_at = next((k for k in range(1, len(curve))
                       if plateau_reached(loss[:k], loss_se[:k], 2, 2., lower_is_better=True)), None)
        old_at = next((k for k in range(1, len(curve)) if plateau_reached(top1[:k], top1_se[:k], 2)), None)
        cells = []
        if new_at:
            kept = min(loss[:new_at])
            stops['new'][0] += 1
            stops['new'][1] += loss[-1] < kept
            cells += [f'{new_at} of {len(curve)}', f'{loss[-1] - kept:+.4f}']
        else:
            cells += [f'none ({len(curve)})', '']
        if old_at:
            best = max(range(old_at), key=lambda i: top1[i])
            gain = top1[-1] - top1[best]
            stops['old'][0] += 1
            stops['old'][1] += gain > 0
            stops['old'][2] += gain > 2 * math.hypot(top1_se[-1], top1_se[best])
            cells += [f'{old_at} of {len(curve)}', f'{gain:+.2f}']
        else:
            cells += [f'none ({len(curve)})', '']
        lines.append(f"| `{r['model']}` | {r['recipe']} | " + ' | '.join(cells) + ' |')
    lines.append(f"\nOf {curves} curves, today's rule stops {stops['new'][0]} early, {stops['new'][1]} of them with "
                 f"the end better on held-out loss; the previous rule stops {stops['old'][0]} early, "
                 f"{stops['old'][1]} of them with the end better on held-out top-1, {stops['old'][2]} by more than "
                 'its noise (2 standard errors).')
    return '\n'.join(lines)


def seeds_table(rows: List[Dict[str, Any]]) -> str:
    """Per original and budget measured with more than one recovery seed (`--recover-kwargs seed=N`; the same
    original and conversion): the recovered top-1 of each seed and their spread (max - min)."""
    cells: Dict[tuple, Dict[int, float]] = {}
    for r in rows:
        options = dict(r['options'], seed=0)
        key = (r['model'], r['recipe'], r['budget'], row_key(dict(r, options=options, budget=None)))
        cells.setdefault(key, {})[r['options'].get('seed', 0)] = r['recovered']
    lines = ['| model | recipe | budget (epochs) | recovered, by seed | spread |', '|---|---|---:|---|---:|']
    for (model, recipe, budget, _), by_seed in sorted(cells.items(), key=lambda item: (
            family_rank(item[0][0]), item[0][:3])):
        if len(by_seed) > 1:
            values = ' / '.join(f'{by_seed[s]:.2f}' for s in sorted(by_seed))
            lines.append(f'| `{model}` | {recipe} | {budget:g} | {values} | '
                         f'{max(by_seed.values()) - min(by_seed.values()):.2f} |')
    return '\n'.join(lines) if len(lines) > 2 else ''


def main(argv=None) -> int:
    parser = command_parser('measure_family_recovery', __doc__, prog='scripts/measure_family_recovery.py')
    parser.add_argument('--models', nargs='+', default=list(FAMILIES), help='timm model names (default: every family)')
    parser.add_argument('--recipes', nargs='+', choices=list(RECIPES),
                        help="how the originals are trained (measure_family_conversion's recipes; default: "
                             f"{' and '.join(DEFAULT_RECIPES)}; with --quick: adamw)")
    parser.add_argument('--model-kwargs', nargs='*', default=None, action=ParseKwargs,
                        help="the model's arguments (default: the family's model in FAMILIES)")
    parser.add_argument('--budgets', type=positive_float, nargs='+',
                        help="the recovery's budgets, in epochs of the original's training images (default: "
                             f"{' '.join(f'{b:g}' for b in BUDGETS)}; with --command-defaults: the command's, "
                             f'{RecoverOptions().epochs:g})')
    parser.add_argument('--runs', default='runs/family-conversion',
                        help='where the trained originals (shared with measure_family_conversion) and the PatchNorm '
                             'models trained from scratch are kept')
    parser.add_argument('--output', default='runs/family-recovery', help="the recovery runs' folders")
    parser.add_argument('--epochs', type=positive_int,
                        help="the originals' epochs, the schedule spanning them (default: until held-out top-1 "
                             'stops rising)')
    parser.add_argument('--train-images', type=positive_int, help="the recipes' images (default: each recipe's)")
    parser.add_argument('--calib-batches', type=positive_int, default=32)
    parser.add_argument('--heldout-images', type=non_negative_int, default=HELDOUT_IMAGES)
    parser.add_argument('--distill-images', type=non_negative_int, default=DISTILL_IMAGES)
    parser.add_argument('--test-images', type=positive_int, default=10000)
    parser.add_argument('--convert-kwargs', nargs='*', default={}, action=ParseKwargs,
                        help='ConvertOptions over their defaults, by dotted names (e.g. distill.epochs=0)')
    parser.add_argument('--recover-kwargs', nargs='*', default={}, action=ParseKwargs,
                        help=f'RecoverOptions over their defaults and {MEASURED} (with --command-defaults: over '
                             'their defaults alone; e.g. lr=1e-4 distill_weight=0.7)')
    parser.add_argument('--command-defaults', action='store_true',
                        help="measure what the command gives: RecoverOptions' defaults, the conversion kept where it "
                             'is better, choices on --val-images held-out training images')
    parser.add_argument('--val-images', type=positive_int, default=VAL_IMAGES,
                        help="the recovery's validation split with --command-defaults: the last N of the training "
                             "split's fixed order")
    parser.add_argument('--workers', type=non_negative_int, default=0, help="the recovery's data loading processes")
    parser.add_argument('--originals-only', action='store_true',
                        help='train the missing originals and PatchNorm from scratch on their whole budgets (what '
                             'no recovery option changes), and stop')
    parser.add_argument('--table-only', action='store_true', help="measure nothing: the tables of --json's rows")
    parser.add_argument('--quick', action='store_true',
                        help=f'a check of the script in seconds: {QUICK}, originals and runs under --output')
    parser.add_argument('--json', help='append each row as a JSON line to this file; rows there are not measured again')
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK, runs=str(Path(args.output) / 'originals'))
    args.recipes = args.recipes or (['adamw'] if args.quick else DEFAULT_RECIPES)
    args.budgets = args.budgets or ([RecoverOptions().epochs] if args.command_defaults else list(BUDGETS))
    wrong = sorted(set(args.recover_kwargs) - {f.name for f in dataclasses.fields(RecoverOptions)} | (
        {'epochs', 'keep_converted'} & set(args.recover_kwargs)))
    if wrong:
        parser.error(f"--recover-kwargs: {', '.join(wrong)} is not a RecoverOptions field set here (the budget is "
                     '--budgets; the trained model is measured, or with --command-defaults what the command keeps)')
    unknown = [name for name in args.models if not timm.is_model(name)]
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} is not a timm model name (timm.list_models() has them)")
    if args.table_only and not read_rows(args.json):
        parser.error('--table-only shows the rows of --json: pass a file of them')
    done = {row_key(r) for r in read_rows(args.json)}
    rows = []
    for recipe_name in [] if args.table_only else args.recipes:
        recipe = dataclasses.replace(RECIPES[recipe_name], epochs=args.epochs or RECIPES[recipe_name].epochs,
                                     images=args.train_images or RECIPES[recipe_name].images)
        for name in args.models:
            kwargs = FAMILIES.get(name, {}) if args.model_kwargs is None else args.model_kwargs
            rows += measure(name, kwargs, recipe_name, recipe, args.budgets, done, args)
    shown = read_rows(args.json) if args.json else rows
    fixed = [r for r in shown if not r.get('defaults')]
    if fixed or not shown:
        print('| model | recipe | budget (epochs) | images | original top-1 | converted | recovered | change | '
              'PatchNorm from scratch, same images | PatchNorm from scratch, whole budget |')
        print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|')
        print('\n'.join(table_row(r) for r in fixed))
    if fixed:
        print('\n' + summary_table(fixed))
        seeds = seeds_table(fixed)
        if seeds:
            print('\nThe recovery seeds (same original and conversion):\n\n' + seeds)
    if len(fixed) < len(shown):
        defaults = [r for r in shown if r.get('defaults')]
        print('\n' + defaults_tables(defaults))
        print('\n' + comparison_tables(defaults))
        print('\n' + stop_rule_table(defaults))
    print(f'{len(rows)} rows measured' + (f', {len(done)} already in {args.json}' if done else ''), file=sys.stderr)
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

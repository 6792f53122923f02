#!/usr/bin/env python3
""" A lever for the recovery, measured: the stage-by-stage swap, against the same loop with every stage converted from
the first update. Fashion-MNIST at 32x32, the originals of `measure_family_conversion.py`, test top-1.

The swap splits the model into `--stages` groups of consecutive parts (its children, timm's stages or blocks by
their own children) and trains a hybrid: the converted groups so far, the rest the original's (frozen, BatchNorm in
eval mode). Group k is swapped in after k/stages of the budget; at the end the model is the whole converted model,
trained. Both arms run one loop: `RecoverOptions`' recipe (AdamW at its peak rate, warm-up then a cosine over the
budget, labels and distillation from the original half and half), on the original's training images, from the same
conversion (`measure_family_recovery.converted_model`). Each row is appended to --json as it is measured; rows there
are not measured again, and --table-only prints the table of its rows, measuring nothing. --quick is one narrow
ResNet-18 on 128 training and 64 test images (seconds).

    python scripts/measure_recovery_swap.py --quick --json runs/recovery-swap-quick.jsonl
"""
import copy
import dataclasses
import json
import sys
import time
from typing import Any, Dict, List

import torch
import torch.nn as nn
from measure_family_conversion import RECIPES, Schedule, _kwargs_text, _tensors, _top1, append_row, trained_original
from measure_family_recovery import QUICK, converted_model, data_order, read_rows
from paper.models import FAMILIES
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.utils import ParseKwargs

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import non_negative_int, positive_float, positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.errors import OptionError
from timm_affinediv.model_io import DISTILL_IMAGES, HELDOUT_IMAGES, load_trained_model
from timm_affinediv.recover import RecoverOptions
from timm_affinediv.train.distill import DistillationLoss

QUICK_RUNS = 'runs/recovery-swap-quick'


def swap_units(model: nn.Module) -> List[List[str]]:
    """The model's parts in forward order, by name, as the swap moves them: its children, a `Sequential` or
    `ModuleList` child (timm's `stages`, `blocks`, `layers`, `features`) by its own children; parts without
    parameters left out. A part with no weight of two or more dimensions (a norm alone) is one unit with both its
    neighbours: which one the conversion paired it with (a norm after a convolution, or before a linear map) is not
    cut from it."""
    parts = []
    for name, child in model.named_children():
        inner = child.named_children() if type(child) in (nn.Sequential, nn.ModuleList) else [('', child)]
        parts += [(f'{name}.{sub}' if sub else name, module) for sub, module in inner
                  if any(True for _ in module.parameters())]
    units: List[List[str]] = []
    glue = False
    for name, module in parts:
        norm_only = all(p.dim() < 2 for p in module.parameters())
        if units and (glue or norm_only):
            units[-1].append(name)
        else:
            units.append([name])
        glue = norm_only
    return units


def swap_groups(model: nn.Module, stages: int) -> List[List[str]]:
    """`swap_units` cut into `stages` runs of consecutive units, as equal in number as they divide."""
    units = swap_units(model)
    if stages > len(units):
        raise OptionError(f'--stages {stages}: the model has only {len(units)} units to swap; give at most that')
    return [[name for unit in units[len(units) * i // stages:len(units) * (i + 1) // stages] for name in unit]
            for i in range(stages)]


class SwapHybrid:
    """`converted`, with the parts of the groups not yet swapped in replaced by frozen copies of the original's."""

    def __init__(self, original: nn.Module, converted: nn.Module, groups: List[List[str]]):
        self.model, self.groups = converted, groups
        self.kept = {name: converted.get_submodule(name) for group in groups for name in group}
        self.frozen: List[nn.Module] = []
        for group in groups[1:]:
            for name in group:
                part = _frozen_copy(original.get_submodule(name))
                converted.set_submodule(name, part)
                self.frozen.append(part)
        self.swapped = 1  # groups converted in the model: the first from the start

    def swap_next(self) -> None:
        for name in self.groups[self.swapped]:
            self.model.set_submodule(name, self.kept[name])
        self.swapped += 1

    def train(self) -> None:
        self.model.train()
        for part in self.frozen:
            part.eval()


def _frozen_copy(module: nn.Module) -> nn.Module:
    part = copy.deepcopy(module).eval()
    part.requires_grad_(False)
    return part


def recover_swapped(original: nn.Module, converted: nn.Module, x: torch.Tensor, y: torch.Tensor, images: int,
                    stages: int, options: RecoverOptions) -> nn.Module:
    """`converted` trained for `images` of (x, y) by `options`' recipe, its groups swapped in one by one
    (`stages` 1: every group from the first update)."""
    torch.manual_seed(options.seed)
    steps = max(1, images // options.batch_size)
    # over every converted parameter, those swapped in later included
    optimizer = create_optimizer_v2(converted, options.opt, lr=options.lr, weight_decay=options.weight_decay)
    hybrid = SwapHybrid(original, converted, swap_groups(original, stages))
    warmup = max(1, round(options.warmup * steps))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, Schedule(warmup, decay_from=warmup, total=steps))
    loss_fn = DistillationLoss(LabelSmoothingCrossEntropy(options.smoothing), options.distill_weight,
                               options.distill_temperature)
    original.eval()
    order = data_order(len(x), steps * options.batch_size)
    for step in range(steps):
        while hybrid.swapped < stages and step >= steps * hybrid.swapped // stages:
            hybrid.swap_next()
        hybrid.train()
        batch = order[step * options.batch_size:(step + 1) * options.batch_size]
        with torch.no_grad():
            teacher = original(x[batch])
        loss = loss_fn(converted(x[batch]), teacher, y[batch])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    while hybrid.swapped < stages:
        hybrid.swap_next()
    return converted.eval()


def main(argv=None) -> int:
    parser = command_parser('measure_recovery_swap', __doc__, prog='scripts/measure_recovery_swap.py')
    parser.add_argument('--models', nargs='+', default=['resnet18', 'convnext_atto', 'mobilenetv3_small_050',
                                                        'tinynet_e', 'densenet121'], help='timm model names')
    parser.add_argument('--recipes', nargs='+', default=['adamw'], choices=list(RECIPES),
                        help='how the originals were trained')
    parser.add_argument('--budgets', type=positive_float, nargs='+', default=[0.25, 1.0],
                        help="the recovery's budgets, in epochs of the original's training images")
    parser.add_argument('--stages', type=positive_int, nargs='+', default=[1, 4],
                        help='groups swapped in one after the other (1: all from the first update)')
    parser.add_argument('--seeds', type=non_negative_int, nargs='+', default=[0])
    parser.add_argument('--runs', default='runs/family-conversion', help='where the trained originals are kept')
    parser.add_argument('--calib-batches', type=positive_int, default=32)
    parser.add_argument('--heldout-images', type=non_negative_int, default=HELDOUT_IMAGES)
    parser.add_argument('--distill-images', type=non_negative_int, default=DISTILL_IMAGES)
    parser.add_argument('--test-images', type=positive_int, default=10000)
    parser.add_argument('--train-images', type=positive_int, help="the recipes' images (default: each recipe's)")
    parser.add_argument('--epochs', type=positive_int, help="the originals' fixed epochs (default: to a plateau)")
    parser.add_argument('--convert-kwargs', nargs='*', default={}, action=ParseKwargs,
                        help='ConvertOptions over their defaults, by dotted names (e.g. distill.epochs=0)')
    parser.add_argument('--quick', action='store_true',
                        help=f'a check of the script in seconds: {QUICK}, originals under {QUICK_RUNS}')
    parser.add_argument('--table-only', action='store_true', help="measure nothing: the table of --json's rows")
    parser.add_argument('--json', help='append each row as a JSON line to this file; rows there are not measured again')
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK, runs=QUICK_RUNS)
    if args.table_only and not read_rows(args.json):
        parser.error('--table-only shows the rows of --json: pass a file of them')
    done = {row_key(r) for r in read_rows(args.json)}
    rows = []
    for recipe_name in [] if args.table_only else args.recipes:
        recipe = dataclasses.replace(RECIPES[recipe_name], epochs=args.epochs or RECIPES[recipe_name].epochs,
                                     images=args.train_images or RECIPES[recipe_name].images)
        x, y = _tensors('train', recipe.images)
        tx, ty = _tensors('validation', args.test_images)
        for name in args.models:
            todo = [(b, s, seed) for b in args.budgets for s in args.stages for seed in args.seeds
                    if row_key(dict(model=name, recipe=recipe_name, budget=b, stages=s, seed=seed,
                                    test_images=args.test_images, convert_options=args.convert_kwargs)) not in done]
            if not todo:
                continue
            kwargs = FAMILIES.get(name, {})
            checkpoint = trained_original(name, kwargs, recipe_name, recipe, args.runs)
            original = load_trained_model(name, checkpoint=str(checkpoint), num_classes=10, in_chans=1, **kwargs)
            converted = converted_model(original, args)
            top1_original, top1_converted = _top1(original, tx, ty), _top1(converted, tx, ty)
            for budget, stages, seed in todo:
                start = time.perf_counter()
                model = recover_swapped(original, copy.deepcopy(converted), x, y, round(budget * recipe.images), stages,
                                        RecoverOptions(seed=seed))
                row = dict(model=name, model_kwargs=_kwargs_text(kwargs), recipe=recipe_name, budget=budget,
                           stages=stages, seed=seed, test_images=args.test_images,
                           convert_options=args.convert_kwargs, original=top1_original,
                           converted=top1_converted, recovered=_top1(model, tx, ty),
                           seconds=round(time.perf_counter() - start, 1))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                append_row(args.json, row)
    print(swap_table(read_rows(args.json) if args.json else rows))
    return 0


def row_key(row: Dict[str, Any]) -> tuple:
    """What makes two rows the same measurement."""
    return tuple(json.dumps(row.get(k), sort_keys=True) for k in (
        'model', 'recipe', 'budget', 'stages', 'seed', 'test_images', 'convert_options'))


def swap_table(rows: List[Dict[str, Any]]) -> str:
    """Per original and budget: the converted model, recovered with every group from the first update and with the
    swap (mean over the seeds, their count), and the swap's change."""
    cells: Dict[tuple, Dict[int, List[float]]] = {}
    for r in rows:
        cells.setdefault((r['model'], r['recipe'], r['budget'], r['original'], r['converted']), {}).setdefault(
            r['stages'], []).append(r['recovered'])
    stages = sorted({r['stages'] for r in rows})
    lines = ['| model | recipe | budget (epochs) | original | converted | '
             + ' | '.join(f'recovered, {s} stage{"s" if s > 1 else ""}' for s in stages) + ' | swap - all at once |',
             '|---|---|---:|---:|---:|' + '---:|' * (len(stages) + 1)]
    for (model, recipe, budget, original, converted), by_stages in cells.items():
        means = {s: sum(v) / len(v) for s, v in by_stages.items()}
        shown = [f'{means[s]:.2f} ({len(by_stages[s])})' if s in means else '' for s in stages]
        change = f'{means[max(means)] - means[1]:+.2f}' if 1 in means and len(means) > 1 else ''
        lines.append(f'| `{model}` | {recipe} | {budget:g} | {original:.2f} | {converted:.2f} | '
                     + ' | '.join(shown) + f' | {change} |')
    return '\n'.join(lines)


if __name__ == '__main__':
    sys.exit(run_main(main))

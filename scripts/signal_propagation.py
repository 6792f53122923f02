#!/usr/bin/env python3
""" Signal propagation of the from-scratch families (ResNet-18, full-width ResNet-50, RegNetX-200MF) with BatchNorm,
GroupNorm (4 groups), `patchnorm` and `patchnorm` under timm's initialisation, at initialisation and over the first
updates of the families experiment's SGD recipe (scripts/paper: Nesterov SGD, weight decay 5e-4, 5% warm-up then a
cosine over 3 epochs of 5000 Fashion-MNIST images at 32x32, batch 64), every norm at the same rate.

Every `--every` updates, on one fixed batch of 256 training images (train mode), per residual stage: the mean
squared channel mean and the mean channel variance of the stage's output, the share of its pooled features'
energy that varies between images (`spread`: the variance over images over the mean squared norm; 0 when every
image gives the same features), the mean cosine similarity of pooled features between images, the residual
branches' variance against the skip's (mean over the stage's blocks); the logits' spread over the images; and,
from the update just taken, each stage's median gradient norm and update-to-weight ratio over its weight tensors.
One JSON line per model, norm and step in --json; --table-only rebuilds the table and the plot from it.

    python scripts/signal_propagation.py --json docs/results/signal-propagation.jsonl \\
        --plot docs/results/signal-propagation.png --table docs/results/signal-propagation.md
    python scripts/signal_propagation.py --quick --json runs/signal-quick.jsonl
"""
import functools
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from measure_family_conversion import append_row, read_rows
from paper.data import load_fashion_mnist
from paper.models import family_model
from paper.runs import recipe_optimizer

from timm_affinediv.cli import positive_float, positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.files import atomic_write

MODELS = ('resnet18', 'resnet50', 'regnetx_002')
NORMS = ('batchnorm', 'groupnorm', 'patchnorm', 'patchnorm_timm_init')
#: the last norm of each residual branch (the one timm's `zero_init_last` zeroes), by block class name
_BRANCH_END = dict(BasicBlock='bn2', Bottleneck=('bn3', 'conv3.bn'))
STEPS_PER_EPOCH, EPOCHS, BATCH = 78, 3, 64


def build(model: str, norm: str) -> nn.Module:
    """The families experiment's `model` with `norm` (its variant `native` for BatchNorm)."""
    return family_model('native' if norm == 'batchnorm' else norm, model)


def _stages(model: nn.Module) -> Dict[str, nn.Module]:
    return {n: m for n, m in model.named_children() if n.startswith(('layer', 's')) and n[-1].isdigit()}


def _branch_end(block: nn.Module) -> Optional[nn.Module]:
    names = _BRANCH_END.get(type(block).__name__, ())
    for name in (names,) if isinstance(names, str) else names:
        try:
            return block.get_submodule(name)
        except AttributeError:
            continue
    return None


class Probe:
    """Forward hooks that keep, per stage, its output and its blocks' branch and skip outputs."""

    def __init__(self, model: nn.Module):
        self.stages = _stages(model)
        self.out: Dict[str, torch.Tensor] = {}
        self.ratios: Dict[str, List[float]] = {}
        for name, stage in self.stages.items():
            stage.register_forward_hook(functools.partial(self._keep_output, name))
            for block in stage.children():
                end = _branch_end(block)
                if end is not None:
                    self._watch_block(name, block, end)

    def _keep_output(self, name, module, args, output):
        self.out[name] = output.detach()

    def _watch_block(self, stage: str, block: nn.Module, end: nn.Module) -> None:
        seen: Dict[str, torch.Tensor] = {}
        block.register_forward_pre_hook(lambda m, args: seen.__setitem__('skip', args[0].detach()))
        downsample = getattr(block, 'downsample', None)
        if isinstance(downsample, nn.Module):
            downsample.register_forward_hook(lambda m, a, out: seen.__setitem__('skip', out.detach()))

        def branch(module, args, output):
            seen['branch'] = output.detach()

        def record(module, args, output):
            skip_var = seen['skip'].var(0).mean().item()
            self.ratios.setdefault(stage, []).append(seen['branch'].var(0).mean().item() / max(skip_var, 1e-30))
        end.register_forward_hook(branch)
        block.register_forward_hook(record)

    def measure(self, logits: torch.Tensor) -> Dict[str, Any]:
        stages = {}
        for name, out in self.out.items():
            pooled = out.float().mean((2, 3))
            unit = F.normalize(pooled, dim=1)
            cos = unit @ unit.T
            n = len(pooled)
            ratios = self.ratios.get(name, [])
            stages[name] = dict(
                channel_mean_sq=out.mean((0, 2, 3)).pow(2).mean().item(),
                channel_var=out.var((0, 2, 3)).mean().item(),
                spread=(pooled.var(0).sum() / pooled.pow(2).sum(1).mean().clamp_min(1e-30)).item(),
                cosine=((cos.sum() - cos.diagonal().sum()) / (n * (n - 1))).item(),
                branch_over_skip=sum(ratios) / len(ratios) if ratios else None)
        self.ratios.clear()
        return dict(stages=stages, logit_spread=logits.float().std(0).mean().item())


def _stage_of(param_name: str, stages: Sequence[str]) -> str:
    head = param_name.split('.')[0]
    return head if head in stages else ('head' if head in ('fc', 'head') else 'stem')


def _update_stats(model: nn.Module, before: Dict[str, torch.Tensor], grads: Dict[str, float],
                  stages: Sequence[str]) -> Dict[str, Dict[str, float]]:
    """Per stage (and stem, head): the median gradient norm and update-to-weight ratio over its weight tensors."""
    per_stage: Dict[str, Dict[str, List[float]]] = {}
    for name, param in model.named_parameters():
        if name in before:
            stage = per_stage.setdefault(_stage_of(name, stages), dict(grad=[], update=[]))
            stage['grad'].append(grads.get(name, 0.0))
            step = (param.detach() - before[name]).norm() / before[name].norm().clamp_min(1e-12)
            stage['update'].append(step.item())
    return {s: dict(grad_norm=_median(v['grad']), update_ratio=_median(v['update'])) for s, v in per_stage.items()}


def _median(values: List[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float('nan')


def trace(model_name: str, norm: str, lr: float, steps: int, every: int, data) -> List[Dict[str, Any]]:
    """The rows of one model and norm: at initialisation and after every `every` updates up to `steps`."""
    torch.manual_seed(0)
    model = build(model_name, norm).train()
    probe = Probe(model)
    optimizer, schedule = recipe_optimizer(model, 'sgd', lr, STEPS_PER_EPOCH * EPOCHS)
    images, targets = data.train
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(0))
    rows: List[Dict[str, Any]] = []
    losses: List[float] = []
    updates: Dict[str, Dict[str, float]] = {}
    for step in range(steps + 1):
        if step % every == 0:
            with torch.no_grad():
                row = probe.measure(model(images[:256]))
            loss = sum(losses[-every:]) / every if losses else None
            rows.append(dict(model=model_name, norm=norm, lr=lr, step=step, train_loss=loss, updates=updates, **row))
        if step == steps:
            return rows
        index = order[(step % STEPS_PER_EPOCH) * BATCH:(step % STEPS_PER_EPOCH + 1) * BATCH]
        loss = F.cross_entropy(model(images[index]), targets[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        last = (step + 1) % every == 0
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() > 1} if last else {}
        grads = {n: p.grad.norm().item() for n, p in model.named_parameters() if n in before and p.grad is not None}
        optimizer.step()
        schedule(step)
        losses.append(loss.item())
        if last:
            updates = _update_stats(model, before, grads, list(probe.stages))
    return rows


def _last_stage(row: Dict[str, Any]) -> Dict[str, Any]:
    return row['stages'][list(row['stages'])[-1]]


def table(rows: Sequence[Dict[str, Any]]) -> str:
    """Per model and norm: the last stage's spread, cosine and branch/skip ratio and the logits' spread at
    initialisation; the stages' gradient norm (median over the stages of each one's median) after the first
    measured interval; the last stage's spread, the logits' spread and the training loss at the last step traced."""
    by = {}
    for row in rows:
        by.setdefault((row['model'], row['norm']), []).append(row)
    lines = ['| model | norm | rate | last stage: spread, init | cosine, init | branch / skip, init | logit spread, '
             'init | stages\' gradient, first interval | step | spread | logit spread | train loss (last updates) |',
             '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
    for (model, norm), own in by.items():
        own = sorted(own, key=lambda r: r['step'])
        first, last = own[0], own[-1]
        ratio = _last_stage(first)['branch_over_skip']
        early = own[1]['updates'] if len(own) > 1 else {}
        gradient = _median([v['grad_norm'] for k, v in early.items() if k not in ('stem', 'head')])
        lines.append(
            f"| {model} | {norm} | {first['lr']:g} | {_last_stage(first)['spread']:.3g} | "
            f"{_last_stage(first)['cosine']:.3f} | {'-' if ratio is None else f'{ratio:.3g}'} | "
            f"{first['logit_spread']:.3g} | {gradient:.3g} | {last['step']} | {_last_stage(last)['spread']:.3g} | "
            f"{last['logit_spread']:.3g} | {last['train_loss']:.3f} |")
    return '\n'.join(lines) + '\n'


def plot(rows: Sequence[Dict[str, Any]], path: Path) -> None:
    """Per model (columns): the last stage's feature spread, the logits' spread and the training loss against the
    update, one line per norm."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r['model'] for r in rows))
    metrics = (('last stage: feature spread', lambda r: _last_stage(r)['spread'], True),
               ('logit spread over images', lambda r: r['logit_spread'], True),
               ('train loss (last updates)', lambda r: r['train_loss'], False))
    fig, axes = plt.subplots(len(metrics), len(models), figsize=(4 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        for norm in NORMS:
            own = sorted((r for r in rows if r['model'] == model and r['norm'] == norm), key=lambda r: r['step'])
            for row_i, (title, value, log) in enumerate(metrics):
                points = [(r['step'], value(r)) for r in own if value(r) is not None]
                ax = axes[row_i][col]
                ax.plot([p[0] for p in points], [max(p[1], 1e-9) if log else p[1] for p in points], marker='.',
                        label=norm)
                ax.set_yscale('log' if log else 'linear')
                ax.set_title(f'{model}: {title}', fontsize=8)
                ax.set_xlabel('update', fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + '.tmp.png')
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    tmp.replace(path)


def main(argv: Optional[List[str]] = None) -> int:
    parser = command_parser('signal_propagation', __doc__, prog='scripts/signal_propagation.py')
    parser.add_argument('--models', nargs='+', choices=MODELS, default=list(MODELS), help='(default: all three)')
    parser.add_argument('--norms', nargs='+', choices=NORMS, default=list(NORMS), help='(default: all four)')
    parser.add_argument('--lr', type=positive_float, default=0.05,
                        help="the peak SGD rate of every run (default: 0.05, BatchNorm ResNet-50's tuned rate)")
    parser.add_argument('--steps', type=positive_int, default=100, help='updates traced (default: 100)')
    parser.add_argument('--every', type=positive_int, default=10, help='updates between measurements (default: 10)')
    parser.add_argument('--json', required=True, help='JSON-lines record, appended to (a model and norm already '
                                                      'there at the rate is skipped)')
    parser.add_argument('--table', help='markdown table written from the whole record (default: none)')
    parser.add_argument('--plot', help='PNG plot written from the whole record (default: none)')
    parser.add_argument('--table-only', action='store_true', help='measure nothing: the table and plot from --json')
    parser.add_argument('--quick', action='store_true', help='narrow ResNet-18 only, 4 updates (seconds)')
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = Path(args.json)
    if not args.table_only:
        models, norms, steps, every = args.models, args.norms, args.steps, args.every
        if args.quick:
            models, norms, steps, every = ['resnet18'], ['batchnorm', 'patchnorm'], 4, 2
        data = load_fashion_mnist(5000, 0, 0, size=32)
        done = {(r['model'], r['norm'], r['lr'], r['step']) for r in read_rows(str(path))}
        for model in models:
            for norm in norms:
                if (model, norm, args.lr, steps) in done:
                    continue
                rows = trace(model, norm, args.lr, steps, every, data)
                for row in rows:
                    append_row(str(path), row)
                print(f"{model} {norm}: spread {_last_stage(rows[0])['spread']:.3g} -> "
                      f"{_last_stage(rows[-1])['spread']:.3g}, loss {rows[-1]['train_loss']:.3f}", flush=True)
    rows = read_rows(str(path))
    text = table(rows)
    print(text)
    if args.table:
        atomic_write(Path(args.table), text)
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

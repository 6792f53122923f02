#!/usr/bin/env python3
""" The levers against the from-scratch stall of deep `patchnorm` ResNets, each alone and together, on full-width
ResNet-50 (or another family of the families experiment): the first updates of the families experiment's SGD recipe
(scripts/paper: Nesterov SGD, weight decay 5e-4, 5% warm-up then a cosine over 234 updates, batch 64, 5000
Fashion-MNIST images at 32x32), the training loss every 10 updates and test top-1 on 2000 test images after
--steps updates (a run cut short, so that a lever's effect on the start is seen in a minute).

The levers (joined with `+`):
- `timm`: timm's initialisation (the branches' last slots at gain 0); without it, the default of
  `norm_layer="patchnorm"` (`timm_affinediv.residual_init`);
- `open1`: timm's, with the branches' last slots at gain 1 (`zero_init_last=False`); `open`: at 1/sqrt(N), the
  classifier left as timm draws it;
- `fc0`: the classifier's weight and bias at zero;
- `centred`: every PatchNorm convolution reads its patch with the patch's mean removed, `(W (P - mean(P)) + b) /
  s(P - mean(P))` (a different function, measured only here);
- `agc`: timm's adaptive gradient clipping (`timm.utils.adaptive_clip_grad`, 0.02) on all but the classifier;
- `ws`: every PatchNorm convolution's weight standardised per output channel as timm's `ScaledStdConv2d` does,
  `(W - mean W) / (std W * sqrt(fan_in))`, so its output no longer grows with the weight's scale; `wn`: the same
  without the centring, `W / |W|` (different functions, measured only here).

    python scripts/measure_init_levers.py --json docs/results/init-levers.jsonl --table docs/results/init-levers.md
    python scripts/measure_init_levers.py --quick --json runs/levers-quick.jsonl
"""
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import timm
import torch
import torch.nn.functional as F
from measure_family_conversion import append_row, read_rows
from paper.data import load_fashion_mnist
from paper.models import FAMILIES
from paper.runs import recipe_optimizer
from timm.utils import adaptive_clip_grad
from torch.nn.utils import parametrize

import timm_affinediv
from timm_affinediv import PatchNormConv2d
from timm_affinediv.cli import positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.errors import OptionError
from timm_affinediv.files import atomic_write

LEVERS = ('timm', 'open1', 'open', 'fc0', 'centred', 'agc', 'ws', 'wn', 'default')
DEFAULT_RUNS = ('timm@0.00625', 'timm@0.05', 'open1@0.00625', 'open1@0.05', 'open@0.0125', 'open@0.05',
                'timm+fc0@0.05', 'default@0.0125', 'default@0.05', 'default@0.1', 'centred+timm@0.05',
                'centred@0.05', 'default+agc@0.1', 'default+agc@0.2', 'default+ws@0.05', 'default+ws@0.1',
                'default+ws@0.2', 'default+wn@0.1', 'default+wn@0.2')
TOTAL_STEPS, BATCH = 234, 64


def centred_forward(conv: PatchNormConv2d, x: torch.Tensor) -> torch.Tensor:
    """`(W (P - mean(P)) + b) / s(P - mean(P))` at every output position: the weight centred over each group's fan-in
    (`W (P - mean P) = (W - mean W) P`), the patch's squared norm less its mean's share."""
    pads = conv._reversed_padding_repeated_twice
    weight, bias, post_bias = conv._fused_params()
    groups = conv.groups
    grouped = weight.unflatten(0, (groups, -1))
    weight = (grouped - grouped.mean((2, 3, 4), keepdim=True)).flatten(0, 1)
    x = F.pad(x, pads)
    y = F.conv2d(x, weight, bias, conv.stride, 0, conv.dilation, groups)
    n, c, h, w = x.shape
    per_group = x.view(n, groups, c // groups, h, w)
    ones = torch.ones(groups, 1, *conv.kernel_size, dtype=x.dtype)

    def box(t):
        return F.conv2d(t, ones, None, conv.stride, 0, conv.dilation, groups)
    fan_in = c // groups * conv.kernel_size[0] * conv.kernel_size[1]
    sums = box(per_group.sum(2))
    centred_sq = (box(per_group.pow(2).sum(2)) - sums * sums / fan_in).clamp_min(0)
    inv_s = ((centred_sq + 1) / conv.divergence_constant).rsqrt()
    return conv._scale_output(y, inv_s, post_bias, 1, groups)


class StandardisedWeight(torch.nn.Module):
    """A convolution weight per output channel at unit norm over its fan-in, centred first where `centre`."""

    def __init__(self, centre: bool):
        super().__init__()
        self.centre = centre

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        if self.centre:
            weight = weight - weight.mean((1, 2, 3), keepdim=True)
        return weight * weight.pow(2).sum((1, 2, 3), keepdim=True).add(1e-8).rsqrt()


def build(model_name: str, levers: List[str]) -> torch.nn.Module:
    kwargs: Dict[str, Any] = dict(FAMILIES[model_name], in_chans=1, num_classes=10)
    if 'open1' in levers or 'open' in levers:
        kwargs['zero_init_last'] = False
    policy = 'skipinit' if 'default' in levers or not ({'timm', 'open1', 'open'} & set(levers)) else 'timm'
    with timm_affinediv.residual_init(policy):
        model = timm.create_model(model_name, norm_layer='patchnorm', **kwargs)
    with torch.no_grad():
        if 'open' in levers:
            last = [m for n, m in model.named_modules() if n.endswith(('bn3', 'conv3.bn'))
                    or n.endswith('bn2') and type(model.get_submodule(n.rsplit('.', 1)[0])).__name__ == 'BasicBlock']
            for slot in last:
                slot.weight.fill_(1 / math.sqrt(len(last)))
        if 'fc0' in levers:
            classifier = model.get_classifier()
            classifier.weight.zero_()
            classifier.bias.zero_()
    if 'centred' in levers:
        for module in model.modules():
            if isinstance(module, PatchNormConv2d):
                module.forward = centred_forward.__get__(module)
    if 'ws' in levers or 'wn' in levers:
        for module in model.modules():
            if isinstance(module, PatchNormConv2d):
                parametrize.register_parametrization(module, 'weight', StandardisedWeight('ws' in levers))
    return model


def run(model_name: str, spec: str, steps: int, data) -> Dict[str, Any]:
    levers_text, _, rate = spec.partition('@')
    levers = levers_text.split('+')
    unknown = [lever for lever in levers if lever not in LEVERS]
    if unknown or not rate:
        raise OptionError(f"--runs {spec}: give LEVER[+LEVER...]@RATE with levers from {LEVERS}")
    lr = float(rate)
    torch.manual_seed(0)
    start = time.perf_counter()
    model = build(model_name, levers).train()
    optimizer, schedule = recipe_optimizer(model, 'sgd', lr, TOTAL_STEPS)
    images, targets = data.train
    order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(0))
    per_pass = len(targets) // BATCH
    clipped = [p for n, p in model.named_parameters() if not n.startswith(('fc.', 'head.'))]
    losses: List[float] = []
    for step in range(steps):
        index = order[(step % per_pass) * BATCH:(step % per_pass + 1) * BATCH]
        loss = F.cross_entropy(model(images[index]), targets[index])
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if 'agc' in levers:
            adaptive_clip_grad(clipped, 0.02)
        optimizer.step()
        schedule(step)
    model.eval()
    with torch.no_grad():
        test_images, test_targets = data.test
        top1 = 100.0 * sum((model(test_images[i:i + 500]).argmax(-1) == test_targets[i:i + 500]).sum().item()
                           for i in range(0, len(test_targets), 500)) / len(test_targets)
    curve = [sum(losses[i:i + 10]) / len(losses[i:i + 10]) for i in range(0, len(losses), 10)]
    return dict(model=model_name, levers=levers_text, lr=lr, steps=steps, of_steps=TOTAL_STEPS, top1=top1,
                loss_every_10=[round(v, 4) for v in curve], seconds=round(time.perf_counter() - start, 1))


def table(rows: List[Dict[str, Any]]) -> str:
    lines = ['| model | levers | peak rate | updates | test top-1 | '
             'training loss: first 10 updates -> highest of 10-30 -> last 10 |',
             '|---|---|---:|---:|---:|---|']
    for r in rows:
        curve = r['loss_every_10']
        lines.append(f"| {r['model']} | {r['levers']} | {r['lr']:g} | {r['steps']} of {r['of_steps']} | "
                     f"{r['top1']:.2f} | {curve[0]:.3f} -> {max(curve[1:3], default=curve[0]):.3f} -> "
                     f"{curve[-1]:.3f} |")
    return '\n'.join(lines) + '\n'


def main(argv: Optional[List[str]] = None) -> int:
    parser = command_parser('measure_init_levers', __doc__, prog='scripts/measure_init_levers.py')
    parser.add_argument('--model', choices=sorted(FAMILIES), default='resnet50', help='(default: resnet50)')
    parser.add_argument('--runs', nargs='+', default=list(DEFAULT_RUNS),
                        help='LEVER[+LEVER...]@RATE each (default: the nineteen of the report)')
    parser.add_argument('--steps', type=positive_int, default=100, help='updates of each run (default: 100)')
    parser.add_argument('--json', required=True, help='JSON-lines record, appended to (a run already there is '
                                                      'skipped)')
    parser.add_argument('--table', help='markdown table written from the whole record (default: none)')
    parser.add_argument('--table-only', action='store_true', help='measure nothing: the table from --json')
    parser.add_argument('--quick', action='store_true', help='narrow ResNet-18, two runs of 4 updates (seconds)')
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = Path(args.json)
    if not args.table_only:
        model, runs, steps = args.model, args.runs, args.steps
        if args.quick:
            model, runs, steps = 'resnet18', ['timm@0.05', 'default+centred+agc@0.05'], 4
        data = load_fashion_mnist(5000, 0, 2000, size=32)
        done = {(r['model'], r['levers'], r['lr'], r['steps']) for r in read_rows(str(path))}
        for spec in runs:
            levers, _, rate = spec.partition('@')
            if (model, levers, float(rate or 'nan'), steps) in done:
                continue
            row = run(model, spec, steps, data)
            append_row(str(path), row)
            print(f"{model} {spec}: top-1 {row['top1']:.2f}, loss {row['loss_every_10'][-1]:.3f}", flush=True)
    text = table(read_rows(str(path)))
    print(text)
    if args.table:
        atomic_write(Path(args.table), text)
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

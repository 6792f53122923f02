#!/usr/bin/env python3
""" The families experiment's longer budget with each norm's rate tuned at that budget, not carried over from the
short one: the experiment's protocol (scripts/paper: the rate grid on the first seed, grown past an edge, then
every seed at the best rate on the validation split) run at `--epochs`, for the given family and norms. Says
whether a gap at the longer budget is the rate's or the norm's. Runs are recorded beside the experiment's
(`--output`/runs/families) and reused.

    python scripts/tune_longer_budget.py --model regnetx_002 --variants native patchnorm --output docs/results
    python scripts/tune_longer_budget.py --model regnetx_002 --variants native patchnorm --output docs/results \
        --workers 0
"""
import sys
from dataclasses import replace
from pathlib import Path
from typing import List, Optional

import torch
from paper import FULL, QUICK, settings
from paper.analysis import summary_row
from paper.models import FAMILIES, LABELS
from paper.runs import tune_and_repeat

from timm_affinediv.cli import non_negative_int, positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.errors import OptionError


def table(results, epochs: int) -> str:
    """Per norm: the rates tried and their validation top-1, the rate chosen, and test top-1 over the seeds."""
    lines = ['| family | norm | epochs | rates tried: val top-1 (seed 0) | chosen | test top-1, mean ± std (seeds) |',
             '|---|---|---:|---|---:|---:|']
    for row in (summary_row(*result) for result in results):
        tried = ', '.join(f'{lr}: {val:.1f}' for lr, val in sorted(row['sweep_val'].items(), key=lambda i: float(i[0])))
        lines.append(f"| {row['model']} | {LABELS[row['variant']]} | {epochs} | {tried} | {row['lr']:g} | "
                     f"{row['test_mean']:.2f} ± {row['test_std']:.2f} ({row['seeds']}) |")
    return '\n'.join(lines) + '\n'


def main(argv: Optional[List[str]] = None) -> int:
    parser = command_parser('tune_longer_budget', __doc__, prog='scripts/tune_longer_budget.py')
    parser.add_argument('--model', choices=sorted(FAMILIES), required=True)
    parser.add_argument('--variants', nargs='+', required=True, help="the norms (the experiment's variant names)")
    parser.add_argument('--epochs', type=positive_int,
                        help="the longer budget (default: the experiment's, 4 x 3 epochs)")
    parser.add_argument('--output', required=True, help="the experiment's output folder (its runs/ are reused)")
    parser.add_argument('--workers', type=non_negative_int, default=1,
                        help='worker processes (default 1; 0: train nothing, the table of what is recorded)')
    parser.add_argument('--quick', action='store_true', help="the experiment's --quick data and grid (seconds)")
    args = parser.parse_args(argv)
    config = replace(QUICK['families'], models=(args.model,)) if args.quick else FULL['families']
    own = {s.variant: s for s in settings('families', config) if s.model == args.model}
    unknown = [v for v in args.variants if v not in own]
    if unknown:
        raise OptionError(f"{args.model} has no variant {', '.join(unknown)}; choose from {', '.join(own)}")
    torch.set_num_threads(1)
    epochs = args.epochs or config.epochs * config.long_factor
    runs_dir = Path(args.output) / 'runs' / 'families'
    runs_dir.mkdir(parents=True, exist_ok=True)
    chosen = [replace(own[v], epochs=epochs) for v in args.variants]
    results = tune_and_repeat(chosen, config, 0, runs_dir, args.workers, None,
                              lambda line: print(line, file=sys.stderr, flush=True))
    print(table(results, epochs), end='')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

"""Fashion-MNIST experiments testing the affine divergence paper's claims (the `paper` modules beside this script).

    python scripts/experiments.py --output docs/results --workers 2 --overwrite  # all four, full budget
    python scripts/experiments.py --only mlp --quick --output runs/quick  # one experiment, seconds
    python scripts/experiments.py --only mlp --quick --workers 0 --output runs/quick --overwrite  # tables, no runs
    python scripts/experiments.py --only batch --seed 1 --output runs/batch-seed1

Writes <experiment>.json (summary and every run), <experiment>.md (tables) and <experiment>.png per
experiment, and one JSON per run under runs/<experiment>/: a rerun into the same folder skips the
runs already recorded, so an interrupted grid continues where it stopped; `--workers 0` trains nothing
and writes the tables of the settings whose runs are all recorded.
"""
import sys

import torch
from paper import EXPERIMENTS, run_experiment

from timm_affinediv.cli import add_deprecated_alias, existing_dir, non_negative_int, refuse_existing_output, run_main
from timm_affinediv.commands import command_parser


def main(argv: list[str] | None = None) -> int:
    parser = command_parser('experiments', __doc__, prog='scripts/experiments.py')
    parser.add_argument('--only', choices=EXPERIMENTS, action='append',
                        help='run this experiment (repeatable; default: all of ' + ', '.join(EXPERIMENTS) + ')')
    parser.add_argument('--quick', action='store_true', help='tiny budget (seconds), for tests and smoke runs')
    parser.add_argument('--seed', type=int, default=0, help='first seed; the lr is tuned with it (default 0)')
    parser.add_argument('--output', required=True, help='folder for the tables, plots and run records')
    parser.add_argument('--data-dir', type=existing_dir,
                        help='Fashion-MNIST folder (default: Debian dataset-fashion-mnist)')
    add_deprecated_alias(parser, '--data-root', '--data-dir', 'data_dir', type=existing_dir)
    parser.add_argument('--workers', type=non_negative_int, default=1,
                        help='worker processes, one run and one torch thread each (default 1: in this process; '
                             '0: train nothing, write the tables of the runs recorded so far)')
    parser.add_argument('--overwrite', action='store_true',
                        help="replace the experiments' earlier tables in --output (run records already there are "
                             'reused)')
    args = parser.parse_args(argv)
    experiments = args.only or EXPERIMENTS
    if not args.overwrite:
        refuse_existing_output(args.output, names=[f'{e}.{ext}' for e in experiments for ext in ('json', 'md', 'png')])

    torch.set_num_threads(1)
    for experiment in experiments:
        run_experiment(experiment, args.output, seed=args.seed, quick=args.quick, data_root=args.data_dir,
                       workers=args.workers, log=lambda line: print(line, flush=True))
        print(f'wrote {args.output}/{experiment}.{{json,md,png}}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

"""Fashion-MNIST experiments testing the affine divergence paper's claims (see timm_affinediv.experiments).

    timm-affinediv experiments --output docs/results              # all three, full budget
    timm-affinediv experiments --only mlp --quick --output /tmp/q  # one experiment, minutes
    timm-affinediv experiments --only batch --seed 1 --output runs/batch-seed1

Writes <experiment>.json (every run), <experiment>.md (table) and <experiment>.png per experiment.
"""
import sys

import torch

from timm_affinediv.experiments import EXPERIMENTS, run_experiment
from timm_affinediv.commands import command_parser


def main(argv: list[str] | None = None) -> int:
    parser = command_parser('experiments', __doc__)
    parser.add_argument('--only', choices=EXPERIMENTS, action='append',
                        help='run this experiment (repeatable; default: all of ' + ', '.join(EXPERIMENTS) + ')')
    parser.add_argument('--quick', action='store_true', help='tiny budget (seconds), for tests and smoke runs')
    parser.add_argument('--seed', type=int, default=0, help='first seed; the lr is tuned with it (default 0)')
    parser.add_argument('--output', required=True, help='folder for the tables, plots and run records')
    parser.add_argument('--data-root', help='Fashion-MNIST folder (default: Debian dataset-fashion-mnist)')
    parser.add_argument('--threads', type=int, default=1, help='torch CPU threads (default 1)')
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    for experiment in args.only or EXPERIMENTS:
        run_experiment(experiment, args.output, seed=args.seed, quick=args.quick,
                       data_root=args.data_root, log=lambda line: print(line, flush=True))
        print(f'wrote {args.output}/{experiment}.{{json,md,png}}', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(main())

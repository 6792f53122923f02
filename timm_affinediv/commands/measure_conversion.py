"""Top-1 on the Fashion-MNIST test set of a trained model, converted to PatchNorm with several calibration budgets
(default: none, 8, 32 and 128 batches of 64 training images), and the time each conversion takes.

    timm-affinediv measure-conversion local-dir:runs/demo/baseline
"""
import sys
import time
from typing import List, Optional

import timm_affinediv  # noqa: F401
from timm_affinediv.model_io import load_trained_model
from timm_affinediv.train import evaluate
from timm_affinediv.convert import convert_model
from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config
from timm_affinediv.commands import command_parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = command_parser('measure-conversion', __doc__)
    parser.add_argument('model', help='the trained model: local-dir:PATH or hf-hub:org/name')
    parser.add_argument('--calib-batches', type=int, nargs='+', default=[0, 8, 32, 128],
                        help='calibration budgets to convert with (0: the analytic map only)')
    parser.add_argument('-b', '--batch-size', type=int, default=64, help='images per calibration batch')
    args = parser.parse_args(argv)
    model = load_trained_model(args.model)
    cfg = resolve_dataset_data_config('fashion-mnist', model, in_chans=1)
    val = create_eval_loader('fashion-mnist', None, cfg, 256, workers=0)
    rows = [('original', evaluate(model, val)['top1'], 0.0)]
    for nb in args.calib_batches:
        calib = [x for x, _ in create_eval_loader('fashion-mnist', None, cfg, args.batch_size, split='train', subset=nb * args.batch_size, workers=0)] if nb else None
        t = time.perf_counter(); conv, rep = convert_model(model, calibration=calib); dt = time.perf_counter() - t
        rows.append((f'converted, {nb} calibration batches' if nb else 'converted, analytic map only', evaluate(conv, val)['top1'], dt))
        print(rows[-1], flush=True)
    print('| model | top-1 (10k test) % | conversion time s |\n|---|---:|---:|')
    for r in rows: print(f'| {r[0]} | {r[1]:.2f} | {r[2]:.1f} |')
    return 0


if __name__ == '__main__':
    sys.exit(main())

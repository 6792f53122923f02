"""Top-1 on the Fashion-MNIST test set of a trained model, converted to PatchNorm without calibration and with
8/32/128 (or the given counts of) calibration batches of 64 training images by the fit alone, the time each
conversion takes and its ratio to one forward pass of the original over the same calibration images. The
distillation the default conversion adds is off (scripts/measure_family_conversion.py measures the default path).

    python scripts/measure_conversion.py local-dir:runs/demo/baseline
    python scripts/measure_conversion.py local-dir:runs/demo/baseline 0 32
"""
import sys
import time
from typing import List, Optional

import torch

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import model_name, non_negative_int, positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import ConvertOptions, DistillOptions, convert_model
from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config
from timm_affinediv.model_io import load_trained_model
from timm_affinediv.train import evaluate


def main(argv: Optional[List[str]] = None) -> int:
    parser = command_parser('measure-conversion', __doc__, prog='scripts/measure_conversion.py')
    parser.add_argument('model', type=model_name, help='the trained model: local-dir:PATH or hf-hub:org/name')
    parser.add_argument('batches', type=non_negative_int, nargs='*', default=[0, 8, 32, 128],
                        help='calibration batch counts to measure (0: the analytic map only)')
    parser.add_argument('-b', '--batch-size', type=positive_int, default=64, help='images per calibration batch')
    args = parser.parse_args(argv)
    model = load_trained_model(args.model)
    cfg = resolve_dataset_data_config('fashion-mnist', model, in_chans=1)
    val = create_eval_loader('fashion-mnist', None, cfg, 256, workers=0)
    rows = [('original', evaluate(model, val)['top1'], 0.0, 0.0)]
    for nb in args.batches:
        calib = [x for x, _ in create_eval_loader('fashion-mnist', None, cfg, args.batch_size, split='train',
                                                  subset=nb * args.batch_size, workers=0)] if nb else None
        forward = 0.0
        if calib:
            with torch.no_grad():
                start = time.perf_counter()
                for x in calib:
                    model(x)
                forward = time.perf_counter() - start
        start = time.perf_counter()
        converted, _ = convert_model(model, calibration=calib, options=ConvertOptions(distill=DistillOptions(epochs=0)))
        seconds = time.perf_counter() - start
        rows.append((f'converted, {nb} calibration batches' if nb else 'converted, analytic map only',
                     evaluate(converted, val)['top1'], seconds, forward))
        print(rows[-1], flush=True)
    print('| model | top-1 (10k test) % | conversion time s | one forward pass s | ratio |\n|---|---:|---:|---:|---:|')
    for name, top1, seconds, forward in rows:
        ratio = f'{forward:.1f} | {seconds / forward:.1f}' if forward else ' | '
        print(f'| {name} | {top1:.2f} | {seconds:.1f} | {ratio} |')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

#!/usr/bin/env python3
"""Top-1 on the Fashion-MNIST test set of a trained model, converted to PatchNorm without calibration and with
8/32/128 (or the given counts of) calibration batches of 64 training images, the time each conversion takes and
its ratio to one forward pass of the original over the same calibration images.

    python scripts/measure_conversion.py local-dir:runs/demo/baseline
    python scripts/measure_conversion.py local-dir:runs/r50-bn/model 32
"""
import sys
import time

import torch

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import ArgumentParser, model_name, non_negative_int, run_main
from timm_affinediv.workflow import load_trained_model, evaluate
from timm_affinediv.convert import convert_model
from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('model', type=model_name, help='the trained model: local-dir:PATH or hf-hub:org/name')
    parser.add_argument('batches', type=non_negative_int, nargs='*', default=[0, 8, 32, 128],
                        help='calibration batch counts to measure (0: the analytic map only)')
    args = parser.parse_args(argv)
    model = load_trained_model(args.model)
    cfg = resolve_dataset_data_config('fashion-mnist', model, in_chans=1)
    val = create_eval_loader('fashion-mnist', None, cfg, 256, workers=0)
    rows = [('original', evaluate(model, val)['top1'], 0.0, 0.0)]
    for nb in args.batches:
        calib = [x for x, _ in create_eval_loader('fashion-mnist', None, cfg, 64, split='train', subset=nb * 64, workers=0)] if nb else None
        forward = 0.0
        if calib:
            with torch.no_grad():
                t = time.perf_counter(); [model(x) for x in calib]; forward = time.perf_counter() - t
        t = time.perf_counter(); conv, rep = convert_model(model, calibration=calib); dt = time.perf_counter() - t
        rows.append((f'converted, {nb} calibration batches' if nb else 'converted, analytic map only', evaluate(conv, val)['top1'], dt, forward))
        print(rows[-1], flush=True)
    print('| model | top-1 (10k test) % | conversion time s | one forward pass s | ratio |\n|---|---:|---:|---:|---:|')
    for r in rows:
        print(f'| {r[0]} | {r[1]:.2f} | {r[2]:.1f} | {r[3]:.1f} | {r[2] / r[3]:.1f} |' if r[3] else f'| {r[0]} | {r[1]:.2f} | {r[2]:.1f} | | |')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

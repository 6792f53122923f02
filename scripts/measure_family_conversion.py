#!/usr/bin/env python3
""" Conversion of a trained BatchNorm/LayerNorm model of any family to `patchnorm`, measured on Fashion-MNIST: top-1
of the original and of the converted model (calibrated on `--calib-batches` batches of 64 training images, then,
with `--reconstruct-steps`, its blocks reconstructed on them; no labels, no fine-tuning) on the first
`--test-images` test images, their top-1 agreement, and the conversion time.

    python scripts/measure_family_conversion.py --model vit_tiny_patch16_224 \\
        --checkpoint runs/vit-tiny/model.safetensors \\
        --model-kwargs img_size=32 patch_size=4 embed_dim=64 depth=4 num_heads=2
"""
import sys
import time

import torch
from timm.utils import ParseKwargs

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import convert_model
from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config
from timm_affinediv.model_io import load_trained_model


def predictions(model: torch.nn.Module, loader) -> tuple:
    predicted, targets = [], []
    with torch.no_grad():
        for x, y in loader:
            predicted.append(model(x).argmax(1))
            targets.append(y)
    return torch.cat(predicted), torch.cat(targets)


def main(argv=None) -> int:
    parser = command_parser('measure_family_conversion', __doc__, prog='scripts/measure_family_conversion.py')
    parser.add_argument('--model', required=True)
    parser.add_argument('--checkpoint', required=True, help='the trained weights (safetensors)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs)
    parser.add_argument('--calib-batches', type=int, default=8)
    parser.add_argument('--test-images', type=int, default=2000)
    parser.add_argument('--ridge', type=float, default=1e-2, help="convert_model's pull towards the analytic map")
    parser.add_argument('--positions-per-unknown', type=float, default=32.,
                        help="convert_model's sample budget per unknown of a fit (0: every position)")
    parser.add_argument('--reconstruct-steps', type=int, default=0,
                        help="convert_model's block-wise reconstruction: Adam steps per block (0: none)")
    args = parser.parse_args(argv)
    model = load_trained_model(args.model, checkpoint=args.checkpoint, num_classes=10, in_chans=1,
                               **args.model_kwargs)
    cfg = resolve_dataset_data_config('fashion-mnist', model, in_chans=1)
    test = create_eval_loader('fashion-mnist', None, cfg, 250, subset=args.test_images, workers=0)
    calib = [x for x, _ in create_eval_loader('fashion-mnist', None, cfg, 64, split='train',
                                              subset=args.calib_batches * 64, workers=0)]
    start = time.perf_counter()
    converted, report = convert_model(model, calibration=calib, ridge=args.ridge,
                                      positions_per_unknown=args.positions_per_unknown or None,
                                      reconstruct_steps=args.reconstruct_steps)
    seconds = time.perf_counter() - start
    original, targets = predictions(model, test)
    ours, _ = predictions(converted.eval(), test)
    top1 = [(p == targets).float().mean().item() * 100 for p in (original, ours)]
    bound = sum(b.bound for b in timm_affinediv.describe_slots(converted))
    print(f'| {args.model} | {bound}/{len(timm_affinediv.describe_slots(converted))} | {top1[0]:.2f} | {top1[1]:.2f} '
          f'| {top1[1] - top1[0]:+.2f} | {(original == ours).float().mean().item() * 100:.1f} | {seconds:.1f} |')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

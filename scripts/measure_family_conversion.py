#!/usr/bin/env python3
""" Conversion of a trained BatchNorm/LayerNorm model of every README family to `patchnorm`, measured on
Fashion-MNIST at 32x32: top-1 of the original and of the model `convert_model` makes with its default arguments
(calibrated on `--calib-batches` batches of 64 training images, no labels, no fine-tuning) on the first
`--test-images` test images, their agreement, the conversion's seconds and its cost in forward passes of the
original over the calibration batches, and what ran (the fitted logits' error, blocks reconstructed, distillation).
Without `--checkpoint`, each original is trained first by a plain loop (`--epochs` over `--train-images` images,
AdamW, one-cycle) and kept under `--runs`; the command that does only that is printed with the table
(docs/families.md's conversion table).

    python scripts/measure_family_conversion.py                       # every family: train if needed, the table
    python scripts/measure_family_conversion.py --models tinynet_e regnetx_002 --train-only
    python scripts/measure_family_conversion.py --models vit_tiny_patch16_224 \\
        --checkpoint runs/vit-tiny/model.safetensors
"""
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from timm.utils import ParseKwargs

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import convert_model
from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config
from timm_affinediv.model_io import load_trained_model

#: One narrow model per README family, as small as trains in a minute or two on a 2-core CPU at 32x32.
FAMILIES: Dict[str, Dict[str, Any]] = {
    'resnet18': dict(channels=(16, 32, 64, 128), stem_width=16),
    'convnext_atto': dict(dims=(16, 32, 64, 128)),
    'vit_tiny_patch16_224': dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2),
    'deit_tiny_patch16_224': dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2),
    'eva02_tiny_patch14_224': dict(img_size=32, patch_size=4, embed_dim=64, depth=4, num_heads=2),
    'swin_tiny_patch4_window7_224': dict(img_size=32, window_size=4, embed_dim=32, depths=(2, 2), num_heads=(2, 4)),
    'tinynet_e': dict(),
    'regnetx_002': dict(),
    'mobilenetv3_small_050': dict(),
    'densenet121': dict(growth_rate=12, block_config=(2, 2, 2, 2)),
}


def _kwargs_text(kwargs: Dict[str, Any]) -> str:
    return ' '.join(f'{k}={v!r}'.replace(' ', '') for k, v in kwargs.items())


def _tensors(split: str, images: int, model: Optional[nn.Module] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first-`images` fixed random subset of a Fashion-MNIST split, read with the eval transforms (32x32)."""
    cfg = resolve_dataset_data_config('fashion-mnist', model, in_chans=1)
    loader = create_eval_loader('fashion-mnist', None, cfg, 500, split=split, subset=images, workers=0)
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


def train(name: str, kwargs: Dict[str, Any], path: Path, epochs: int, images: int, seed: int = 0) -> None:
    """The original: `epochs` passes over `images` training images in batches of 64, AdamW (lr 3e-3, weight decay
    0.05, one-cycle), no augmentation; BatchNorm statistics then re-estimated on 2048 of the images."""
    x, y = _tensors('train', images)
    torch.manual_seed(seed)
    model = timm.create_model(name, num_classes=10, in_chans=1, **kwargs)
    steps = epochs * (len(x) // 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(x))
        for i in range(len(x) // 64):
            batch = order[i * 64:(i + 1) * 64]
            loss = F.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
    with torch.no_grad():  # exact BatchNorm statistics: the eval-mode model is the one trained
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.reset_running_stats()
                m.momentum = None
        for i in range(0, 2048, 256):
            model(x[i:i + 256])
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(path))


def _top1_and_predictions(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Tuple[float, torch.Tensor]:
    with torch.no_grad():
        predicted = torch.cat([model(x[i:i + 250]).argmax(1) for i in range(0, len(x), 250)])
    return (predicted == y).float().mean().item() * 100, predicted


def forward_pass_seconds(model: nn.Module, batches: List[torch.Tensor]) -> float:
    """One forward pass of `model` over `batches`, the fastest of two."""
    times = []
    with torch.no_grad():
        for _ in range(2):
            start = time.perf_counter()
            for b in batches:
                model(b)
            times.append(time.perf_counter() - start)
    return min(times)


def what_ran(report) -> str:
    """What ran after the fit, in a few words: the blocks reconstructed and their steps, the distillation's epochs
    (with the fitted logits' error that decided it)."""
    ran = [b for b in report.blocks if b.steps]
    text = f'fit (logits error {report.output_error_calibrated:.3f})'
    if ran:
        text += f'; {len(ran)}/{len(report.blocks)} blocks reconstructed, {sum(b.steps for b in ran)} steps'
    d = report.distillation
    if d is not None:
        text += f'; distilled {d.epochs} epochs, KL {d.kl_before:.3f} -> {d.kl_after:.3f}'
    return text


def measure(name: str, kwargs: Dict[str, Any], checkpoint: str, calib_batches: int, test_images: int,
            convert_kwargs: Dict[str, Any]) -> str:
    model = load_trained_model(name, checkpoint=checkpoint, num_classes=10, in_chans=1, **kwargs)
    x, y = _tensors('train', calib_batches * 64, model)
    calib = list(x.split(64))
    tx, ty = _tensors('validation', test_images, model)
    start = time.perf_counter()
    converted, report = convert_model(model, calibration=calib, **convert_kwargs)
    seconds = time.perf_counter() - start
    print(report.format_table(), file=sys.stderr)
    passes = seconds / forward_pass_seconds(model, calib)
    top1, original = _top1_and_predictions(model, tx, ty)
    top1_converted, ours = _top1_and_predictions(converted.eval(), tx, ty)
    agreement = (original == ours).float().mean().item() * 100
    label = f'`{name}`' + (f' ({_kwargs_text(kwargs)})' if kwargs else '')
    return (f'| {label} | {top1:.2f} | {top1_converted:.2f} | **{top1_converted - top1:+.2f}** | {agreement:.1f}% '
            f'| {seconds:.1f} | {passes:.1f} | {what_ran(report)} |')


def main(argv=None) -> int:
    parser = command_parser('measure_family_conversion', __doc__, prog='scripts/measure_family_conversion.py')
    parser.add_argument('--models', nargs='+', default=list(FAMILIES), help='timm model names (default: every family)')
    parser.add_argument('--model-kwargs', nargs='*', default=None, action=ParseKwargs,
                        help="the model's arguments (default: the family's narrow model in FAMILIES)")
    parser.add_argument('--checkpoint', help='the trained weights (safetensors) of the one model of --models')
    parser.add_argument('--runs', default='runs/family-conversion', help='where the trained originals are kept')
    parser.add_argument('--epochs', type=positive_int, default=2)
    parser.add_argument('--train-images', type=positive_int, default=4000)
    parser.add_argument('--train-only', action='store_true', help='train the missing originals and stop')
    parser.add_argument('--calib-batches', type=positive_int, default=32)
    parser.add_argument('--test-images', type=positive_int, default=2000)
    parser.add_argument('--convert-kwargs', nargs='*', default={}, action=ParseKwargs,
                        help="convert_model's keyword arguments over its defaults (e.g. reconstruct_steps=0)")
    args = parser.parse_args(argv)
    if args.checkpoint and len(args.models) != 1:
        parser.error('--checkpoint is the weights of one model: pass one name with --models')
    train_command = ['python', 'scripts/measure_family_conversion.py', '--models', *args.models, '--runs', args.runs,
                     '--epochs', str(args.epochs), '--train-images', str(args.train_images), '--train-only']
    rows = []
    for name in args.models:
        kwargs = FAMILIES.get(name, {}) if args.model_kwargs is None else args.model_kwargs
        checkpoint = args.checkpoint or str(Path(args.runs) / name / 'model.safetensors')
        if not args.checkpoint and not Path(checkpoint).is_file():
            start = time.perf_counter()
            train(name, kwargs, Path(checkpoint), args.epochs, args.train_images)
            print(f'trained {name} in {time.perf_counter() - start:.0f} s: {checkpoint}', file=sys.stderr)
        if not args.train_only:
            rows.append(measure(name, kwargs, checkpoint, args.calib_batches, args.test_images, args.convert_kwargs))
            print(rows[-1], file=sys.stderr)
    if rows:
        print('| model (narrow) | original top-1 | converted top-1 | change | agreement | conversion s '
              '| forward passes | what ran |')
        print('|---|---:|---:|---:|---:|---:|---:|---|')
        print('\n'.join(rows))
        if not args.checkpoint:
            print(f'\noriginals trained by: {shlex.join(train_command)}')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

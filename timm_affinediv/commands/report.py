"""Measure the affine divergence of a timm model: the effective-update factor of every affine layer.

    timm-affinediv report --model resnet18                    # BatchNorm: a spread
    timm-affinediv report --model resnet18 --norm patchnorm   # one factor per layer
    timm-affinediv report --model resnet18 --checkpoint model.safetensors --data random

For each nn.Linear/nn.Conv2d, one SGD step per sampled (image, output position) on a batch of
Fashion-MNIST (1 channel, 32x32) or random data; prints a markdown table (min, median, max and
spread = max/min of the factor, and the largest deviation from the closed form) and writes a PNG
per layer plus summary.png and report.md/report.json under --output.
"""
import json
import sys
from pathlib import Path

import timm
import torch

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm', 'l2norm', 'l2norm2d'
from timm_affinediv.diagnostics import divergence_report, format_report, plot_report
from timm_affinediv.commands import command_parser


def load_batch(data: str, batch_size: int, seed: int, data_root: str | None) -> torch.Tensor:
    """`batch_size` Fashion-MNIST test images (normalised, 32x32) or standard normal data, (N, 1, 32, 32)."""
    if data == 'random':
        return torch.randn(batch_size, 1, 32, 32, generator=torch.Generator().manual_seed(seed))
    from timm_affinediv.experiments import load_fashion_mnist
    return load_fashion_mnist(0, 0, batch_size, size=32, root=data_root).test[0]


def main(argv: list[str] | None = None) -> int:
    parser = command_parser('report', __doc__)
    parser.add_argument('--model', required=True, help='timm model name, e.g. resnet18')
    parser.add_argument('--norm', help="norm_layer for timm.create_model, e.g. batchnorm, patchnorm (default: the model's)")
    parser.add_argument('--checkpoint', help='weights to load (timm checkpoint_path); default: random init')
    parser.add_argument('--data', choices=('fashion-mnist', 'random'), default='fashion-mnist')
    parser.add_argument('--data-root', help='Fashion-MNIST folder (default: Debian dataset-fashion-mnist)')
    parser.add_argument('--batch-size', type=int, default=64, help='images in the batch (default 64)')
    parser.add_argument('--samples', type=int, default=8, help='images measured per layer (default 8)')
    parser.add_argument('--positions', type=int, default=8, help='output positions measured per image (default 8)')
    parser.add_argument('--num-classes', type=int, default=10)
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--threads', type=int, default=1, help='torch CPU threads (default 1)')
    parser.add_argument('--output', help='folder for report.md, report.json and the PNGs')
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    kwargs = dict(norm_layer=args.norm) if args.norm else {}
    model = timm.create_model(args.model, in_chans=1, num_classes=args.num_classes,
                              checkpoint_path=args.checkpoint or '', **kwargs)
    batch = load_batch(args.data, args.batch_size, args.seed, args.data_root)
    # an untrained model's running statistics are the initial ones: use the batch's instead
    report = divergence_report(model, batch, samples=args.samples, positions_per_sample=args.positions,
                               seed=args.seed, batch_stats=args.checkpoint is None)
    table = format_report(report)
    print(table)
    if args.output:
        out = Path(args.output)
        plot_report(report, out / 'layers', title=f'{args.model} {args.norm or ""} ({args.data})')
        (out / 'report.md').write_text(table + '\n')
        (out / 'report.json').write_text(json.dumps(
            dict(vars(args), layers=[s.as_dict() for s in report]), indent=1))
        print(f'wrote {out}/report.md, report.json, layers/*.png')
    return 0


if __name__ == '__main__':
    sys.exit(main())

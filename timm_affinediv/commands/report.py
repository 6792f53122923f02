"""Measure the affine divergence of a timm model: the effective-update factor of every affine layer.

    timm-affinediv report --model resnet18                    # BatchNorm: a spread
    timm-affinediv report --model resnet18 --norm patchnorm   # one factor per layer
    timm-affinediv report --model resnet18 --checkpoint model.safetensors --num-classes 10 --in-chans 1
    timm-affinediv report --model resnet50.a1_in1k --pretrained --dataset '' --data-dir PATH
    timm-affinediv report --model local-dir:runs/demo/model --dataset random --img-size 64

For each nn.Linear/nn.Conv2d, one SGD step per sampled (image, output position) on a batch of
Fashion-MNIST (1 channel, 32x32 unless --img-size), an image folder (read with the model's own eval
transforms) or random data; prints a markdown table (min, median, max and spread = max/min of the factor,
and the largest deviation from the closed form) and writes a PNG per layer plus summary.png and
report.md/report.json under --output. Weights given (--checkpoint, --pretrained, local-dir:, hf-hub:) that
cannot be loaded are an error; without any, the model is measured at its random initialisation (say so).
"""
import json
import sys
from pathlib import Path

import timm
import torch

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm', 'l2norm', 'l2norm2d'
from timm_affinediv.cli import (
    add_data_args,
    add_model_args,
    create_model_kwargs,
    data_location,
    norm_name,
    positive_int,
    refuse_existing_output,
    run_main,
)
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import model_in_chans
from timm_affinediv.data import DataError, create_eval_loader, is_fashion_mnist, resolve_dataset_data_config
from timm_affinediv.diagnostics import divergence_report, format_report, plot_report
from timm_affinediv.layers import describe_kernel_paths, layer_kernel_paths
from timm_affinediv.model_io import load_trained_model

REPORT_FILES = ('report.md', 'report.json', 'layers')


def load_batch(data: str, model: torch.nn.Module, batch_size: int, seed: int, img_size: int | None,
               data_dir: str | None) -> torch.Tensor:
    """`batch_size` images: Fashion-MNIST test images, an image folder's (the model's own eval transforms), or
    standard normal data at the model's input size (or `img_size`)."""
    in_chans = model_in_chans(model)
    if data == 'random':
        size = img_size or timm.data.resolve_data_config({}, model=model)['input_size'][-1]
        return torch.randn(batch_size, in_chans, size, size, generator=torch.Generator().manual_seed(seed))
    fmnist = is_fashion_mnist(data)
    if fmnist and in_chans != 1:
        raise DataError(f'Fashion-MNIST has 1 channel, the model takes {in_chans}: pass --in-chans 1, or an image '
                        'folder / --dataset random')
    config = resolve_dataset_data_config(data if fmnist else '', model, in_chans=in_chans, img_size=img_size)
    loader = create_eval_loader(data if fmnist else '', data_dir if fmnist else data, config, batch_size,
                                subset=batch_size, workers=0)
    return next(iter(loader))[0]


def main(argv: list[str] | None = None) -> int:
    parser = command_parser('report', __doc__)
    group = add_model_args(parser, help={
        '--model': 'timm model name, hf-hub:org/name or local-dir:PATH',
        '--checkpoint': 'weights to load (.safetensors or timm checkpoint); default: random init',
        '--in-chans': "input channels (default: 1 for Fashion-MNIST, else the model's)",
        '--num-classes': 'classes of the head (default: 10 for a random-init model on Fashion-MNIST, else the '
                         "model's)"})
    group.add_argument('--norm', type=norm_name,
                       help="norm_layer for timm.create_model, e.g. batchnorm, patchnorm (default: the model's)")
    group.add_argument('--img-size', type=positive_int,
                       help="input size (default: 32 for Fashion-MNIST, else the model's)")
    add_data_args(parser, builtins=('fashion-mnist', 'random'), old_source_flags=('--data',),
                  old_dir_flags=('--data-root',))
    parser.add_argument('--batch-size', type=positive_int, default=64, help='images in the batch (default 64)')
    parser.add_argument('--samples', type=positive_int, default=8, help='images measured per layer (default 8)')
    parser.add_argument('--positions', type=positive_int, default=8,
                        help='output positions measured per image (default 8)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--threads', type=positive_int, default=1, help='torch CPU threads (default 1)')
    parser.add_argument('--output', help='folder for report.md, report.json and the PNGs')
    parser.add_argument('--overwrite', action='store_true', help='replace the report already in --output')
    args = parser.parse_args(argv)
    if args.output and not args.overwrite:
        refuse_existing_output(args.output, names=REPORT_FILES)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    data = data_location(args)
    fmnist = is_fashion_mnist(data)
    weights = bool(args.checkpoint or args.pretrained or args.model.startswith(('hf-hub:', 'local-dir:')))
    kwargs = create_model_kwargs(args, norm_layer=args.norm)
    if fmnist and not weights:
        kwargs.setdefault('in_chans', 1)
        kwargs.setdefault('num_classes', 10)
    # --model's check leaves a timm name whenever no weights are given
    model = (load_trained_model(args.model, args.checkpoint, pretrained=args.pretrained, **kwargs) if weights
             else timm.create_model(args.model, **kwargs))
    batch = load_batch(data, model, args.batch_size, args.seed, args.img_size, args.data_dir)
    # an untrained model's running statistics are the initial ones: use the batch's instead
    report = divergence_report(model, batch, samples=args.samples, positions_per_sample=args.positions,
                               seed=args.seed, batch_stats=not weights)
    table = format_report(report)
    state = 'trained weights' if weights else 'random init'
    print(f'{args.model} ({state}), input {tuple(batch.shape[1:])}')
    print(describe_kernel_paths(model) + '\n')
    print(table)
    if args.output:
        out = Path(args.output)
        plot_report(report, out / 'layers', title=f'{args.model} {args.norm or ""} ({Path(data).name})')
        (out / 'report.md').write_text(table + '\n')
        (out / 'report.json').write_text(json.dumps(
            dict(vars(args), weights=state, input_shape=list(batch.shape[1:]), kernels=layer_kernel_paths(model),
                 layers=[s.as_dict() for s in report]), indent=1))
        print(f'wrote {out}/report.md, report.json, layers/*.png')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

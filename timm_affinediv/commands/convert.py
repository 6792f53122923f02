"""Convert a trained BatchNorm/LayerNorm timm model to PatchNorm and write a Hub-ready folder.

    timm-affinediv convert --model resnet18 --checkpoint model.safetensors --num-classes 10 --in-chans 1 \\
        --calib-data fashion-mnist --calib-batches 32 --output runs/resnet18-patchnorm
    timm-affinediv convert --model local-dir:runs/baseline --output runs/converted
    timm-affinediv convert --model resnet50.a1_in1k --pretrained --calib-data PATH --calib-images 1024 \
        --eval-images 0 --output runs/resnet50-patchnorm

With an image folder (`PATH/<class>/*`, or `PATH/train/<class>/*` and `PATH/validation/<class>/*`) the images
are read with the model's own eval transforms (timm `resolve_data_config` of its `pretrained_cfg`:
size, crop, mean and std).

The folder reloads with `timm.create_model("local-dir:DIR", pretrained=True)` after `import timm_affinediv`.
"""
import logging
import sys
from pathlib import Path

from timm.utils import ParseKwargs

import timm_affinediv  # noqa: F401  (registers the layers with timm)
from timm_affinediv.cli import (
    data_source, existing_dir, existing_file, model_name, non_negative_int, positive_float, positive_int,
    refuse_existing_output, run_main)
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import CONVERSION_NORMS
from timm_affinediv.model_io import convert_to_folder, load_trained_model


def main(argv=None) -> int:
    parser = command_parser('convert', __doc__)
    parser.add_argument('--model', required=True, type=model_name, help='timm model name (with --checkpoint or --pretrained), hf-hub:org/name or local-dir:PATH')
    parser.add_argument('--pretrained', action='store_true', help="timm's pretrained weights for the model name")
    parser.add_argument('--checkpoint', type=existing_file, help='weights for a timm model name: .safetensors or a timm/PyTorch checkpoint')
    parser.add_argument('--num-classes', type=positive_int, help='classes of the checkpoint (timm model name only)')
    parser.add_argument('--in-chans', type=positive_int, help='input channels of the checkpoint (timm model name only)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                        help='more timm.create_model arguments')
    parser.add_argument('--norm', default='patchnorm', choices=CONVERSION_NORMS)
    parser.add_argument('--calib-data', default='fashion-mnist', type=data_source('fashion-mnist'),
                        help="'fashion-mnist' (built in) or a folder of class sub-folders (<dir>/train/<class>/*)")
    parser.add_argument('--data-dir', type=existing_dir, help='Fashion-MNIST folder, when not the Debian default')
    parser.add_argument('--calib-batches', type=non_negative_int, default=32, help='0: the analytic map only')
    parser.add_argument('--calib-images', type=non_negative_int,
                        help='calibration images (default: --calib-batches x --batch-size)')
    parser.add_argument('-b', '--batch-size', type=positive_int, default=64)
    parser.add_argument('--eval-images', type=non_negative_int,
                        help='validation images for the top-1 figures (default: all; 0: no evaluation)')
    parser.add_argument('--device', default='auto', choices=('auto', 'cpu', 'cuda'),
                        help="'auto': CUDA when available")
    parser.add_argument('--calib-memory', type=positive_float, default=4.0,
                        help='GiB of activations kept in memory during calibration; beyond it they spill to disk')
    parser.add_argument('--output', required=True, help='the Hub-format folder to write')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing output folder')
    args = parser.parse_args(argv)
    if not args.overwrite:
        refuse_existing_output(args.output)
    logging.basicConfig(level=logging.INFO, format='%(message)s')

    dataset, data_dir = args.calib_data, args.data_dir
    if dataset != 'fashion-mnist':
        dataset, data_dir = '', args.calib_data
    model_kwargs = args.model_kwargs
    create_kwargs = dict(model_kwargs)
    if args.num_classes:
        create_kwargs['num_classes'] = args.num_classes
    if args.in_chans:
        create_kwargs['in_chans'] = args.in_chans
    model = load_trained_model(args.model, args.checkpoint, pretrained=args.pretrained, **create_kwargs)
    converted, report, metrics = convert_to_folder(
        model, args.output, norm=args.norm, dataset=dataset, data_dir=data_dir,
        calib_batches=args.calib_batches, batch_size=args.batch_size, calib_images=args.calib_images,
        eval_images=args.eval_images, device=args.device, calib_memory=int(args.calib_memory * 2 ** 30),
        base_model=args.model[len('hf-hub:'):] if args.model.startswith('hf-hub:') else (
            model.pretrained_cfg.get('hf_hub_id') if args.pretrained else None),
        overwrite=args.overwrite, **model_kwargs)
    print(report.format_table())
    if 'converted' in metrics:
        print(f"top-1: original {metrics['original']['top1']:.2f}%, converted {metrics['converted']['top1']:.2f}%")
    print(f'wrote {Path(args.output).resolve()} (conversion_report.json beside the weights)')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

"""Convert a trained BatchNorm/LayerNorm timm model to PatchNorm and write a Hub-ready folder.

    timm-affinediv convert --model resnet18 --checkpoint model.safetensors --num-classes 10 --in-chans 1 \\
        --calib-data fashion-mnist --calib-batches 32 --output runs/resnet18-patchnorm
    timm-affinediv convert --model local-dir:runs/baseline --output runs/converted

The folder reloads with `timm.create_model("local-dir:DIR", pretrained=True)` after `import timm_affinediv`.
"""
import logging
import sys
from pathlib import Path

import timm_affinediv  # noqa: F401  (registers the layers with timm)
from timm_affinediv.convert import CONVERSION_NORMS, ConversionError
from timm_affinediv.data import DataError
from timm_affinediv.hub import HubError
from timm.utils import ParseKwargs

from timm_affinediv.model_io import convert_to_folder, load_trained_model
from timm_affinediv.commands import command_parser


def main(argv=None) -> int:
    parser = command_parser('convert', __doc__)
    parser.add_argument('--model', required=True, help='timm model name (with --checkpoint), hf-hub:org/name or local-dir:PATH')
    parser.add_argument('--checkpoint', help='weights for a timm model name: .safetensors or a timm/PyTorch checkpoint')
    parser.add_argument('--num-classes', type=int, help='classes of the checkpoint (timm model name only)')
    parser.add_argument('--in-chans', type=int, help='input channels of the checkpoint (timm model name only)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                        help='more timm.create_model arguments')
    parser.add_argument('--norm', default='patchnorm', choices=CONVERSION_NORMS)
    parser.add_argument('--calib-data', default='fashion-mnist',
                        help="'fashion-mnist' (built in) or a folder of class sub-folders (<dir>/train/<class>/*)")
    parser.add_argument('--data-dir', help='Fashion-MNIST folder, when not the Debian default')
    parser.add_argument('--calib-batches', type=int, default=32, help='0: the analytic map only')
    parser.add_argument('-b', '--batch-size', type=int, default=64)
    parser.add_argument('--eval-images', type=int, help='validation images for the top-1 figures (default: all)')
    parser.add_argument('--output', required=True, help='the Hub-format folder to write')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing output folder')
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(message)s')

    dataset, data_dir = args.calib_data, args.data_dir
    if dataset != 'fashion-mnist':
        dataset, data_dir = '', args.calib_data
    try:
        model_kwargs = args.model_kwargs
        create_kwargs = dict(model_kwargs)
        if args.num_classes:
            create_kwargs['num_classes'] = args.num_classes
        if args.in_chans:
            create_kwargs['in_chans'] = args.in_chans
        model = load_trained_model(args.model, args.checkpoint, **create_kwargs)
        converted, report, metrics = convert_to_folder(
            model, args.output, norm=args.norm, dataset=dataset, data_dir=data_dir,
            calib_batches=args.calib_batches, batch_size=args.batch_size, eval_images=args.eval_images,
            base_model=args.model[len('hf-hub:'):] if args.model.startswith('hf-hub:') else None,
            overwrite=args.overwrite, **model_kwargs)
    except (ConversionError, DataError, FileExistsError, HubError) as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(report.format_table())
    print(f"top-1: original {metrics['original']['top1']:.2f}%, converted {metrics['converted']['top1']:.2f}%")
    print(f'wrote {Path(args.output).resolve()} (conversion_report.json beside the weights)')
    return 0


if __name__ == '__main__':
    sys.exit(main())

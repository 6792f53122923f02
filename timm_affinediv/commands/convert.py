"""Convert a trained BatchNorm/LayerNorm timm model to PatchNorm and write a Hub-ready folder.

    timm-affinediv convert --model resnet18 --checkpoint model.safetensors --num-classes 10 --in-chans 1 \\
        --dataset fashion-mnist --calib-batches 32 --output runs/resnet18-patchnorm
    timm-affinediv convert --model local-dir:runs/baseline --output runs/converted
    timm-affinediv convert --model resnet50.a1_in1k --pretrained --dataset '' --data-dir PATH --calib-images 1024 \\
        --eval-images 0 --output runs/resnet50-patchnorm

`--dataset` takes what `timm-affinediv finetune` reads: an image folder (`--dataset '' --data-dir PATH`:
`PATH/<class>/*`, or `PATH/train/<class>/*` and `PATH/validation/<class>/*`) or timm's `torch/`, `hfds/`, `hfids/`,
`wds/`, `tfds/` datasets (a stream's first images); they are read with the model's own eval transforms (timm
`resolve_data_config` of its `pretrained_cfg`: size, crop, mean and std).

The folder reloads with `timm.create_model("local-dir:DIR", pretrained=True)` after `import timm_affinediv`.
"""
import logging
import sys
from pathlib import Path

import timm_affinediv  # noqa: F401  (registers the layers with timm)
from timm_affinediv.cli import (
    add_data_args,
    add_model_args,
    create_model_kwargs,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    refuse_existing_output,
    run_main,
)
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import CONVERSION_NORMS
from timm_affinediv.model_io import convert_to_folder, load_trained_model


def main(argv=None) -> int:
    parser = command_parser('convert', __doc__)
    add_model_args(parser, help={'--num-classes': 'classes of the checkpoint (timm model name only)',
                                 '--in-chans': 'input channels of the checkpoint (timm model name only)'})
    parser.add_argument('--norm', default='patchnorm', choices=CONVERSION_NORMS)
    add_data_args(parser, old_source_flags=('--calib-data',), any_dataset=True)
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
    parser.add_argument('--distill-epochs', type=non_negative_int, default=6,
                        help="epochs of distillation of the whole model on the original's logits after the fit, on "
                             'the calibration images (0: none)')
    parser.add_argument('--distill-threshold', type=non_negative_float, default=0.01,
                        help="it runs where the fitted model's logits have a relative squared error above this "
                             '(0: always)')
    parser.add_argument('--reconstruct-steps', type=non_negative_int, default=0,
                        help='Adam steps per block at most of block-wise reconstruction after the fit, on the '
                             'calibration images, before any distillation (0, the default: none)')
    parser.add_argument('--reconstruct-threshold', type=non_negative_float, default=0.1,
                        help="where the fitted model's logits have a relative squared error above this, the blocks "
                             'whose output has one above it are reconstructed (0: every block)')
    parser.add_argument('--output', required=True, help='the Hub-format folder to write')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing output folder')
    args = parser.parse_args(argv)
    if not args.overwrite:
        refuse_existing_output(args.output)
    logging.basicConfig(level=logging.INFO, format='%(message)s')

    model = load_trained_model(args.model, args.checkpoint, pretrained=args.pretrained, **create_model_kwargs(args))
    converted, report, metrics = convert_to_folder(
        model, args.output, norm=args.norm, dataset=args.dataset, data_dir=args.data_dir,
        calib_batches=args.calib_batches, batch_size=args.batch_size, calib_images=args.calib_images,
        eval_images=args.eval_images, device=args.device, calib_memory=int(args.calib_memory * 2 ** 30),
        reconstruct_steps=args.reconstruct_steps, reconstruct_threshold=args.reconstruct_threshold,
        distill_epochs=args.distill_epochs, distill_threshold=args.distill_threshold,
        base_model=args.model[len('hf-hub:'):] if args.model.startswith('hf-hub:') else (
            model.pretrained_cfg.get('hf_hub_id') if args.pretrained else None),
        overwrite=args.overwrite, **args.model_kwargs)
    print(report.format_table())
    if 'converted' in metrics:
        print(f"top-1: original {metrics['original']['top1']:.2f}%, converted {metrics['converted']['top1']:.2f}%")
    print(f'wrote {Path(args.output).resolve()} (conversion_report.json beside the weights)')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

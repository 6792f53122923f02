"""Export a trained timm model (patchnorm, affinediv or plain) to ONNX, validated against eager with ONNX Runtime.

    timm-affinediv export --model local-dir:runs/converted --output runs/model.onnx
    timm-affinediv export --model resnet18 --norm-layer patchnorm --checkpoint runs/demo/model/model.safetensors \\
        --model-kwargs "channels=(16,32,64,128)" stem_width=16 --num-classes 10 --in-chans 1 --img-size 28 \\
        --output runs/model-28.onnx [--no-dynamo] [--opset 17]

The .onnx file has a dynamic batch axis and is written only once ONNX Runtime reproduces the eager model's
outputs on random batches to --tolerance (relative to the largest output); the worst relative error is printed,
and the script exits 1 above the tolerance (2 on bad input).
"""
import argparse
import sys
from pathlib import Path

import timm_affinediv  # noqa: F401  (registers the layers with timm)
from timm_affinediv._timm_compat import get_model_input_config
from timm_affinediv.cli import (
    add_model_args,
    create_model_kwargs,
    norm_name,
    positive_float,
    positive_int,
    refuse_existing_output,
    run_main,
)
from timm_affinediv.commands import command_parser
from timm_affinediv.export import DEFAULT_OPSET, ExportError, export_onnx
from timm_affinediv.model_io import load_trained_model


def main(argv=None) -> int:
    parser = command_parser('export', __doc__)
    group = add_model_args(parser, checkpoint_type=str, help={
        '--num-classes': 'classes of the checkpoint (timm model name only)',
        '--in-chans': 'input channels of the checkpoint (timm model name only)'})
    group.add_argument('--norm-layer', type=norm_name,
                       help="norm_layer of the checkpoint's model (e.g. patchnorm, affinediv)")
    parser.add_argument('--img-size', type=positive_int, help="input height and width (default: the model's)")
    parser.add_argument('--output', required=True, help='the .onnx file to write')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing --output file')
    parser.add_argument('--opset', type=positive_int, default=DEFAULT_OPSET, help='ONNX opset (17 or newer)')
    parser.add_argument('--dynamo', action=argparse.BooleanOptionalAction, default=True,
                        help="PyTorch's torch.export-based exporter (default), or --no-dynamo: the TorchScript-based "
                             'one')
    parser.add_argument('--batch-size', type=positive_int, default=4,
                        help='validation batch (a second one is one larger)')
    parser.add_argument('--tolerance', type=positive_float, default=1e-5, help='largest relative error accepted')
    args = parser.parse_args(argv)
    if not args.overwrite:
        refuse_existing_output(args.output)
    if args.opset < 17:
        parser.error(f'--opset {args.opset}: the layers need opset 17 or newer')

    model = load_trained_model(args.model, args.checkpoint, pretrained=args.pretrained,
                               **create_model_kwargs(args, norm_layer=args.norm_layer))
    # timm's input config of the model as built (its channels: --in-chans), not its pretrained_cfg's (ImageNet's 3)
    input_size = get_model_input_config(model)['input_size']
    if args.img_size:
        input_size = (input_size[0], args.img_size, args.img_size)
    try:
        error = export_onnx(model, args.output, input_size, opset=args.opset, dynamo=args.dynamo,
                            tolerance=args.tolerance, batch_sizes=(args.batch_size, args.batch_size + 1))
    except ExportError as e:
        print(f'error: {e}', file=sys.stderr)
        return 1
    print(f'worst relative error against eager (ONNX Runtime, batches {args.batch_size} and {args.batch_size + 1}, '
          f'input {tuple(input_size)}): {error:.2e} (tolerance {args.tolerance:g})')
    print(f'wrote {Path(args.output).resolve()}')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

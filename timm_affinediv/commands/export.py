"""Export a trained timm model (patchnorm, affinediv or plain) to ONNX, validated against eager with ONNX Runtime.

    timm-affinediv export --model local-dir:runs/converted --output runs/model.onnx
    timm-affinediv export --model resnet18 --norm-layer patchnorm --checkpoint model.safetensors \\
        --num-classes 10 --in-chans 1 --img-size 28 --output runs/model.onnx [--no-dynamo] [--opset 17]

The .onnx file has a dynamic batch axis and is written only once ONNX Runtime reproduces the eager model's
outputs on random batches to --tolerance (relative to the largest output); the worst relative error is printed,
and the script exits 1 above the tolerance (2 on bad input).
"""
import argparse
import sys
from pathlib import Path

from timm.data import resolve_model_data_config
from timm.utils import ParseKwargs

import timm_affinediv  # noqa: F401  (registers the layers with timm)
from timm_affinediv.export import DEFAULT_OPSET, ExportError, export_onnx
from timm_affinediv.model_io import load_trained_model
from timm_affinediv.cli import model_name, norm_name, positive_float, positive_int, refuse_existing_output, run_main
from timm_affinediv.commands import command_parser


def main(argv=None) -> int:
    parser = command_parser('export', __doc__)
    parser.add_argument('--model', required=True, type=model_name, help='timm model name (with --checkpoint), hf-hub:org/name or local-dir:PATH')
    parser.add_argument('--checkpoint', help='weights for a timm model name: .safetensors or a timm/PyTorch checkpoint')
    parser.add_argument('--norm-layer', type=norm_name, help="norm_layer of the checkpoint's model (e.g. patchnorm, affinediv)")
    parser.add_argument('--num-classes', type=positive_int, help='classes of the checkpoint (timm model name only)')
    parser.add_argument('--in-chans', type=positive_int, help='input channels of the checkpoint (timm model name only)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                        help='more timm.create_model arguments')
    parser.add_argument('--img-size', type=positive_int, help="input height and width (default: the model's)")
    parser.add_argument('--output', required=True, help='the .onnx file to write')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing --output file')
    parser.add_argument('--opset', type=positive_int, default=DEFAULT_OPSET, help='ONNX opset (17 or newer)')
    parser.add_argument('--dynamo', action=argparse.BooleanOptionalAction, default=True,
                        help="PyTorch's torch.export-based exporter (default), or --no-dynamo: the TorchScript-based one")
    parser.add_argument('--batch-size', type=positive_int, default=4, help='validation batch (a second one is one larger)')
    parser.add_argument('--tolerance', type=positive_float, default=1e-5, help='largest relative error accepted')
    args = parser.parse_args(argv)
    if not args.overwrite:
        refuse_existing_output(args.output)
    if args.opset < 17:
        parser.error(f'--opset {args.opset}: the layers need opset 17 or newer')

    create_kwargs = dict(args.model_kwargs)
    for key in ('norm_layer', 'num_classes', 'in_chans'):
        if getattr(args, key) is not None:
            create_kwargs[key] = getattr(args, key)
    model = load_trained_model(args.model, args.checkpoint, **create_kwargs)
    input_size = resolve_model_data_config(model)['input_size']
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

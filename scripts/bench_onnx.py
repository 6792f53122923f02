"""Time ONNX Runtime (CPU) inference of BatchNorm/LayerNorm timm models against the same models with
`norm_layer="patchnorm"`, both exported the same way, side by side.

Each model is exported with `timm_affinediv.export.export_onnx` (validated against eager before timing), then the
two ONNX Runtime sessions run in paired rounds (ABBA, `scripts/bench.py`'s `paired_rounds`). Printed per model: the
median seconds of each and the median of the per-round ratios, with the middle half (quartiles) of those ratios.

    python scripts/bench_onnx.py [--reps 15] [--models convnext_tiny] [--no-dynamo] [--threads 2]
"""
import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import timm
import torch
from bench import MODELS, create_bench_model, paired_rounds

import timm_affinediv  # noqa: F401  (registers patchnorm)
from timm_affinediv.cli import positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.export import export_onnx


def _session(path: Path, threads: int):
    import onnxruntime as ort  # the onnx extra, needed here only

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=['CPUExecutionProvider'])


def _runner(session, x):
    feed = {session.get_inputs()[0].name: x}
    return lambda: session.run(None, feed)


def main(argv=None) -> int:
    parser = command_parser('bench-onnx', __doc__, prog='scripts/bench_onnx.py')
    parser.add_argument('--reps', type=positive_int, default=15, help='paired rounds per model')
    parser.add_argument('--models', nargs='+', default=list(MODELS), choices=list(MODELS))
    parser.add_argument('--batch-size', type=positive_int, default=8)
    parser.add_argument('--img-size', type=positive_int, default=224)
    parser.add_argument('--dynamo', action=argparse.BooleanOptionalAction, default=True,
                        help="export with the torch.export-based exporter (default) or the TorchScript-based one")
    parser.add_argument('--threads', type=int, default=0, help='ONNX Runtime intra-op threads (default: all cores)')
    args = parser.parse_args(argv)
    if args.reps < 4:
        parser.error(f'--reps {args.reps}: quartiles of the per-round ratios need at least 4 rounds')
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size).numpy()
    input_size = (3, args.img_size, args.img_size)
    exporter = 'dynamo' if args.dynamo else 'TorchScript-based'
    import onnxruntime
    print(f'onnxruntime {onnxruntime.__version__}, torch {torch.__version__}, timm {timm.__version__}, '
          f'{exporter} exporter, '
          f'batch {args.batch_size}, {args.img_size}x{args.img_size}, {args.reps} paired rounds (ABBA)')
    print('| model | reference norm | reference s | patchnorm s | ratio (median of rounds) | middle half | '
          'export error (ref, patchnorm) |')
    print('|---|---|---:|---:|---:|---:|---:|')
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            sessions, errors = [], []
            for tag, kwargs in (('reference', {}), ('patchnorm', dict(norm_layer='patchnorm'))):
                path = Path(tmp) / f'{name}-{tag}.onnx'
                model = create_bench_model(name, args.img_size, **kwargs)
                errors.append(export_onnx(model, path, input_size, dynamo=args.dynamo))
                sessions.append(_session(path, args.threads))
            ref, patch = paired_rounds(*(_runner(s, x) for s in sessions), args.reps)
            q1, ratio, q3 = statistics.quantiles([p / r for r, p in zip(ref, patch)], n=4)
            print(f'| {name} | {MODELS[name]} | {statistics.median(ref):.3f} | {statistics.median(patch):.3f} | '
                  f'{ratio:.3f} | {q1:.3f} to {q3:.3f} | {errors[0]:.1e}, {errors[1]:.1e} |', flush=True)
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

"""Time BatchNorm/LayerNorm timm models against the same models with `norm_layer="patchnorm"`, side by side.

Each pair runs in one process in paired rounds, the two going first in alternate rounds (ABBA), so both
see the same machine state; a round's ratio compares the two steps timed next to each other. Printed per
model and mode: the median seconds of each and the median of the per-round ratios, with the middle half
(quartiles) of those ratios, which shows how much the shared machine moved them.

    python scripts/bench.py [--reps 15] [--models convnext_tiny] [--modes train]
"""
import statistics
import sys
import time

import timm
import torch

import timm_affinediv  # noqa: F401  (registers patchnorm)
from timm_affinediv.cli import positive_int, run_main
from timm_affinediv.commands import command_parser

MODELS = {'resnet50': 'batchnorm', 'convnext_tiny': 'layernorm', 'vit_small_patch16_224': 'layernorm'}
MODES = ('train', 'inference')


def _train_step(model, optimizer, x, y):
    def step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def _inference(model, x):
    @torch.inference_mode()
    def infer():
        model(x)
    return infer


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def create_bench_model(name: str, img_size: int, **kwargs) -> torch.nn.Module:
    """`timm.create_model(name, **kwargs)` for `img_size` inputs: a model with a fixed input size (ViT's patch
    grid) is built for it; one without takes any size."""
    try:
        return timm.create_model(name, img_size=img_size, **kwargs)
    except TypeError:  # a convolutional network takes no img_size
        return timm.create_model(name, **kwargs)


def paired_rounds(reference, candidate, reps: int, warmup: int = 1):
    """Seconds of `reference` and `candidate` in each of `reps` rounds (after `warmup`), the first alternating."""
    ref_times, cand_times = [], []
    for i in range(warmup + reps):
        if i % 2:
            cand, ref = _timed(candidate), _timed(reference)
        else:
            ref, cand = _timed(reference), _timed(candidate)
        if i >= warmup:
            ref_times.append(ref)
            cand_times.append(cand)
    return ref_times, cand_times


def main(argv=None) -> int:
    parser = command_parser('bench', __doc__, prog='scripts/bench.py')
    parser.add_argument('--reps', type=positive_int, default=15, help='paired rounds per model and mode')
    parser.add_argument('--models', nargs='+', default=list(MODELS), choices=list(MODELS))
    parser.add_argument('--modes', nargs='+', default=list(MODES), choices=MODES)
    parser.add_argument('--batch-size', type=positive_int, default=8)
    parser.add_argument('--img-size', type=positive_int, default=224)
    parser.add_argument('--threads', type=positive_int, default=None,
                        help='torch intra-op threads (default: all cores)')
    args = parser.parse_args(argv)
    if args.reps < 4:
        parser.error(f'--reps {args.reps}: quartiles of the per-round ratios need at least 4 rounds')
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    y = torch.randint(0, 1000, (args.batch_size,))
    print(f'torch {torch.__version__}, timm {timm.__version__}, {torch.get_num_threads()} threads, '
          f'batch {args.batch_size}, {args.img_size}x{args.img_size}, {args.reps} paired rounds (ABBA)')
    print('| model | mode | reference norm | reference s | patchnorm s | ratio (median of rounds) | middle half |')
    print('|---|---|---|---:|---:|---:|---:|')
    for name in args.models:
        models = [create_bench_model(name, args.img_size),
                  create_bench_model(name, args.img_size, norm_layer='patchnorm')]
        for mode in args.modes:
            if mode == 'train':
                fns = [_train_step(m.train(), torch.optim.SGD(m.parameters(), lr=1e-3), x, y) for m in models]
            else:
                fns = [_inference(m.eval(), x) for m in models]
            ref, patch = paired_rounds(*fns, args.reps)
            q1, ratio, q3 = statistics.quantiles([p / r for r, p in zip(ref, patch)], n=4)
            print(f'| {name} | {mode} | {MODELS[name]} | {statistics.median(ref):.3f} | '
                  f'{statistics.median(patch):.3f} | {ratio:.3f} | {q1:.3f} to {q3:.3f} |', flush=True)
    return 0

    return 0

if __name__ == '__main__':
    sys.exit(run_main(main))

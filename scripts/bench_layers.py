"""Time BatchNorm/LayerNorm timm models against the same models with `norm_layer="patchnorm"`, side by side.

Each pair is timed interleaved (A, B, A, B, ...) in one process, so both see the same machine
state; the ratio of the medians is printed. Usage: `python scripts/bench_layers.py [--reps 5]`.
"""
import argparse
import statistics
import time

import timm
import torch

import timm_affinediv  # noqa: F401  (registers patchnorm)

MODELS = (('resnet50', 'batchnorm'), ('convnext_tiny', 'layernorm'))


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


def interleaved_medians(fns, reps: int, warmup: int = 1):
    """Median seconds of each function, run alternately `reps` times after `warmup` rounds."""
    times = [[] for _ in fns]
    for i in range(warmup + reps):
        for fn, t in zip(fns, times):
            elapsed = _timed(fn)
            if i >= warmup:
                t.append(elapsed)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--reps', type=int, default=5)
    parser.add_argument('--batch-size', type=int, default=8)
    parser.add_argument('--img-size', type=int, default=224)
    parser.add_argument('--threads', type=int, default=None, help='torch intra-op threads (default: all cores)')
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.img_size, args.img_size)
    y = torch.randint(0, 1000, (args.batch_size,))
    print(f'torch {torch.__version__}, timm {timm.__version__}, {torch.get_num_threads()} threads, '
          f'batch {args.batch_size}, {args.img_size}x{args.img_size}, median of {args.reps} interleaved runs')
    print(f"| model | mode | {'reference norm':<14} | reference s | patchnorm s | ratio |")
    print('|---|---|---|---:|---:|---:|')
    for name, reference in MODELS:
        models = [timm.create_model(name), timm.create_model(name, norm_layer='patchnorm')]
        for mode in ('train', 'inference'):
            if mode == 'train':
                fns = [_train_step(m.train(), torch.optim.SGD(m.parameters(), lr=1e-3), x, y) for m in models]
            else:
                fns = [_inference(m.eval(), x) for m in models]
            ref, patch = interleaved_medians(fns, args.reps)
            print(f'| {name} | {mode} | {reference:<14} | {ref:.3f} | {patch:.3f} | {patch / ref:.3f} |', flush=True)


if __name__ == '__main__':
    main()

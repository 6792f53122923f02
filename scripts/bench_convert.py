"""Conversion cost in forward passes: the least-squares fit's time (`convert_model` without distillation) / one
forward pass of the original over the same calibration set, for full-width models (random weights: the fit's cost
does not depend on them). The fit is what a trained ResNet or ConvNeXt gets by default; a random-weight model's
fitted logits are off enough to trigger the distillation, which a trained one does not need (its cost on trained
models: scripts/measure_family_conversion.py).

    python scripts/bench_convert.py        # resnet50, convnext_tiny; 224 synthetic, 32 F-MNIST
    python scripts/bench_convert.py --models resnet50 --settings synthetic-224 --batches 8 32 --batch-size 8 64 \\
        --device cuda
    python scripts/bench_convert.py --models resnet50 --settings fashion-mnist-32 --reps 1 --breakdown

Prints a markdown table: calibration set, one forward pass (s), conversion (s), ratio. Each is the median of
`--reps` paired rounds, a round timing one forward pass and one conversion next to each other (in alternate
order), so that both see the same machine state; the ratio is the median of the rounds' ratios, and their range
shows how much the machine moved them. Run on an idle machine.
"""
import statistics
import sys
import time

import timm
import torch

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import positive_int, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import ConvertOptions, DistillOptions, convert_model
from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config
from timm_affinediv.device import resolve_device


def calibration_set(setting: str, batches: int, batch_size: int, model: torch.nn.Module) -> list:
    if setting == 'synthetic-224':
        generator = torch.Generator().manual_seed(0)
        return [torch.randn(batch_size, 3, 224, 224, generator=generator) for _ in range(batches)]
    cfg = resolve_dataset_data_config('fashion-mnist', model, in_chans=1)
    loader = create_eval_loader('fashion-mnist', None, cfg, batch_size, split='train', subset=batches * batch_size,
                                workers=0)
    return [x for x, _ in loader]


def forward_seconds(model: torch.nn.Module, batches: list, device: torch.device) -> float:
    model.to(device)
    with torch.no_grad():
        start = time.perf_counter()
        for x in batches:
            model(x.to(device))
        if device.type == 'cuda':
            torch.cuda.synchronize()
        return time.perf_counter() - start


def conversion_seconds(model: torch.nn.Module, batches: list, device: torch.device) -> float:
    model.cpu()
    start = time.perf_counter()
    convert_model(model, calibration=batches, options=ConvertOptions(distill=DistillOptions(epochs=0),
                                                                     device=str(device)))
    return time.perf_counter() - start


#: Where a fit's time goes (`--breakdown`): the functions whose cumulative time is summed, by what they do.
PHASES = {
    'the walks: one forward pass of each model over the calibration images': ('graph.py', 'run_until'),
    "the products U^T U, U^T Z (NormalEquations.add)": ('solver.py', 'add'),
    'the solves (NormalEquations.fit)': ('solver.py', 'fit'),
    "the features' gathering (patch_features)": ('features.py', 'patch_features'),
    'the rebuild (build_converted)': ('rebuild.py', 'build_converted'),
}


def breakdown(model: torch.nn.Module, batches: list, device: torch.device, forward: float) -> None:
    """One conversion under cProfile: the seconds of each phase (`PHASES`) and in forward passes (`forward` s)."""
    import cProfile
    import pstats
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.runcall(conversion_seconds, model, batches, device)
    total = time.perf_counter() - start
    stats = pstats.Stats(profile).stats
    print(f'  where the {total:.1f} s go (cProfile, {total / forward:.1f} forward passes of {forward:.2f} s):')
    for phase, (file, function) in PHASES.items():
        seconds = sum(entry[3] for (path, _, name), entry in stats.items()
                      if path.endswith(file) and name == function)
        print(f'    {phase}: {seconds:.1f} s, {seconds / forward:.2f} passes')


def main(argv=None) -> int:
    parser = command_parser('bench-convert', __doc__, prog='scripts/bench_convert.py')
    parser.add_argument('--models', nargs='+', default=['resnet50', 'convnext_tiny'])
    parser.add_argument('--settings', nargs='+', default=['synthetic-224', 'fashion-mnist-32'],
                        choices=['synthetic-224', 'fashion-mnist-32'])
    parser.add_argument('--batches', type=positive_int, nargs=2, default=(8, 32), metavar=('AT_224', 'AT_32'),
                        help='calibration batches at 224 and at 32 (default 8 and 32)')
    parser.add_argument('--batch-size', type=positive_int, nargs=2, default=(8, 64), metavar=('AT_224', 'AT_32'))
    parser.add_argument('--device', default='auto', choices=('auto', 'cpu', 'cuda'))
    parser.add_argument('--reps', type=positive_int, default=3, help='paired rounds per model and setting')
    parser.add_argument('--breakdown', action='store_true',
                        help="then one more conversion under cProfile: the seconds of the walks, the products, the "
                             "solves and the features' gathering")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    rows = []
    for setting in args.settings:
        i = 0 if setting == 'synthetic-224' else 1
        for name in args.models:
            kwargs = dict(num_classes=1000, in_chans=3) if i == 0 else dict(num_classes=10, in_chans=1)
            model = timm.create_model(name, **kwargs).eval()
            batches = calibration_set(setting, args.batches[i], args.batch_size[i], model)
            forward_seconds(model, batches[:1], device)  # warm-up
            rounds = []
            for r in range(args.reps):
                # side by side, in alternate order: a single forward pass's time varies by a fifth here
                if r % 2:
                    seconds = conversion_seconds(model, batches, device)
                    forward = forward_seconds(model, batches, device)
                else:
                    forward = forward_seconds(model, batches, device)
                    seconds = conversion_seconds(model, batches, device)
                rounds.append((forward, seconds, seconds / forward))
            forward, seconds, ratio = (statistics.median(column) for column in zip(*rounds))
            spread = f'{min(r[2] for r in rounds):.1f} to {max(r[2] for r in rounds):.1f}'
            rows.append((name, setting, f'{len(batches)} x {batches[0].shape[0]}', forward, seconds, ratio, spread))
            print(f'{name} {setting}: forward {forward:.1f} s, conversion {seconds:.1f} s, ratio {ratio:.1f} '
                  f'({spread})', flush=True)
            if args.breakdown:
                breakdown(model, batches, device, forward)
    print(f'\n| model | data | calibration batches | one forward pass s | conversion s | ratio | rounds |  ({device}, '
          f'{args.reps} rounds)')
    print('|---|---|---|---:|---:|---:|---:|')
    for name, setting, calib, forward, seconds, ratio, spread in rows:
        print(f'| {name} | {setting} | {calib} | {forward:.2f} | {seconds:.2f} | {ratio:.1f} | {spread} |')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

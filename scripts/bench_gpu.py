#!/usr/bin/env python3
""" Throughput of patchnorm models against the same models with their native norm, on one GPU

For each model: train steps (SGD, cross-entropy) and inference, eager and `torch.compile`d, native and patchnorm
timed in alternating rounds in this one process (CUDA-synchronised timers, after warm-up steps), in bf16 autocast
and channels-last at 224x224 by default. Prints img/s of both, the ratio (patchnorm's step time over native's:
1.00x is parity), the peak memory a step allocates above the resident weights, and the first step's time (with
compilation for compiled models).

    python scripts/bench_gpu.py                                   # resnet50, convnext_tiny
    python scripts/bench_gpu.py --models resnet18 --modes eager --kernels torch
    python scripts/bench_gpu.py --device cpu --quick --backend aot_eager   # tiny sizes: checks the script end to end
"""
import dataclasses
import datetime
import json
import statistics
import sys
import time
from typing import Callable, Dict, List

import timm
import torch
import torch.nn.functional as F

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm'
from timm_affinediv.cli import run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.files import atomic_write
from timm_affinediv.layers import layer_kernel_paths
from timm_affinediv.layers.kernels import KERNEL_MODES, set_kernels


@dataclasses.dataclass
class Settings:
    device: str
    batch_train: int
    batch_infer: int
    size: int
    steps: int
    warmup: int
    rounds: int
    dtype: torch.dtype
    channels_last: bool
    backend: str


@dataclasses.dataclass
class Row:
    model: str
    step: str
    mode: str
    native_img_s: float
    patchnorm_img_s: float
    ratio: float
    native_peak_gib: float
    patchnorm_peak_gib: float
    memory_ratio: float
    native_first_step_s: float
    patchnorm_first_step_s: float


def _sync(device: str) -> None:
    if device == 'cuda':
        torch.cuda.synchronize()


def _peak_gib(device: str, resident: int) -> float:
    return (torch.cuda.max_memory_allocated() - resident) / 2 ** 30 if device == 'cuda' else float('nan')


class Runner:
    """One model variant's step function, its first-step time and its timed rounds."""

    def __init__(self, name: str, norm: str, step: str, mode: str, s: Settings):
        torch.manual_seed(0)
        kwargs = {'norm_layer': 'patchnorm'} if norm == 'patchnorm' else {}
        model = timm.create_model(name, **kwargs).to(s.device)
        if s.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.paths = layer_kernel_paths(model)
        self.batch = s.batch_train if step == 'train' else s.batch_infer
        memory_format = torch.channels_last if s.channels_last else torch.contiguous_format
        self.x = torch.randn(self.batch, 3, s.size, s.size, device=s.device).to(memory_format=memory_format)
        self.y = torch.randint(0, model.num_classes, (self.batch,), device=s.device)
        self.s = s
        forward = torch.compile(model, backend=s.backend) if mode == 'compiled' else model
        autocast = dict(device_type=s.device, dtype=s.dtype, enabled=s.dtype != torch.float32)
        if step == 'train':
            model.train()
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

            def run():
                with torch.autocast(**autocast):
                    loss = F.cross_entropy(forward(self.x), self.y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            model.eval()

            def run():
                with torch.no_grad(), torch.autocast(**autocast):
                    forward(self.x)
        self.run: Callable[[], None] = run
        self.times: List[float] = []
        self.peak = 0.
        self.first_step = self._first_step()

    def _first_step(self) -> float:
        _sync(self.s.device)
        start = time.perf_counter()
        self.run()
        _sync(self.s.device)
        first = time.perf_counter() - start
        for _ in range(self.s.warmup):
            self.run()
        return first

    def time_round(self) -> None:
        device = self.s.device
        _sync(device)
        resident = 0
        if device == 'cuda':
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        for _ in range(self.s.steps):
            self.run()
        _sync(device)
        self.times.append((time.perf_counter() - start) / self.s.steps)
        self.peak = max(self.peak, _peak_gib(device, resident))

    @property
    def img_s(self) -> float:
        return self.batch / statistics.median(self.times)


def bench(name: str, step: str, mode: str, s: Settings) -> Row:
    runners = {norm: Runner(name, norm, step, mode, s) for norm in ('native', 'patchnorm')}
    for _ in range(s.rounds):  # A/B rounds: drifts of clock and temperature hit both alike
        for runner in runners.values():
            runner.time_round()
    native, patch = runners['native'], runners['patchnorm']
    paths = sorted(set(patch.paths.values()))
    print(f"  {name} {step} {mode}: patchnorm layers on {'/'.join(paths) or '-'} path", flush=True)
    return Row(name, step, mode, native.img_s, patch.img_s, native.img_s / patch.img_s, native.peak, patch.peak,
               patch.peak / native.peak if native.peak > 0 else float('nan'), native.first_step, patch.first_step)


def _environment(args, s: Settings) -> Dict[str, str]:
    gpu = torch.cuda.get_device_name() if s.device == 'cuda' else 'none (cpu)'
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = 'not installed'
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'), gpu=gpu,
                torch=torch.__version__, timm=timm.__version__, triton=triton_version, kernels=args.kernels,
                dtype=str(s.dtype).replace('torch.', ''), channels_last=str(s.channels_last), size=str(s.size),
                batch_train=str(s.batch_train), batch_infer=str(s.batch_infer), compile_backend=s.backend)


def _rate(img_s: float) -> str:
    return f'{img_s:.0f}' if img_s >= 100 else f'{img_s:.3g}'


def _memory(r: Row) -> str:
    if r.native_peak_gib != r.native_peak_gib:  # nan: not measured off the GPU
        return '-'
    return f'{r.native_peak_gib:.2f} / {r.patchnorm_peak_gib:.2f} ({r.memory_ratio:.2f}x)'


def _print_table(rows: List[Row]) -> None:
    header = ('| model | step | mode | native img/s | patchnorm img/s | ratio | peak GiB native / patchnorm (ratio) '
              '| first step s native / patchnorm |')
    print(header)
    print('|' + '---|' * 8)
    for r in rows:
        print(f'| {r.model} | {r.step} | {r.mode} | {_rate(r.native_img_s)} | {_rate(r.patchnorm_img_s)} | '
              f'{r.ratio:.2f}x | {_memory(r)} '
              f'| {r.native_first_step_s:.1f} / {r.patchnorm_first_step_s:.1f} |')


def main(argv=None) -> int:
    parser = command_parser('bench_gpu', __doc__, prog='scripts/bench_gpu.py')
    parser.add_argument('--models', default='resnet50,convnext_tiny', help='comma-separated timm model names')
    parser.add_argument('--steps', default='train,inference', help='train and/or inference')
    parser.add_argument('--modes', default='eager,compiled', help='eager and/or compiled (torch.compile)')
    parser.add_argument('--kernels', default='auto', choices=KERNEL_MODES, help="patchnorm's path (auto: Triton "
                        'on CUDA)')
    parser.add_argument('--device', default='cuda', choices=('cuda', 'cpu'),
                        help='cpu checks the script end to end (with --quick); its figures are no GPU figures')
    parser.add_argument('--dtype', default=None, choices=('bfloat16', 'float16', 'float32'),
                        help='autocast dtype (default bfloat16 on cuda, float32 on cpu)')
    parser.add_argument('--nchw', action='store_true', help="timm's default layout instead of channels-last")
    parser.add_argument('--backend', default='inductor', help="torch.compile's backend (aot_eager: a quick check of "
                        'the compiled path, without code generation)')
    parser.add_argument('--quick', action='store_true', help='fewer steps and rounds; on cpu also tiny sizes')
    parser.add_argument('--json', default=None, metavar='OUT', help='also save the table and environment here')
    args = parser.parse_args(argv)
    if args.device == 'cuda' and not torch.cuda.is_available():
        parser.error('no CUDA GPU is visible: run it on a GPU machine, or check the script with --device cpu --quick')
    steps, modes = args.steps.split(','), args.modes.split(',')
    if not set(steps) <= {'train', 'inference'} or not set(modes) <= {'eager', 'compiled'}:
        parser.error(f'--steps takes train,inference and --modes eager,compiled; got {args.steps!r}, {args.modes!r}')
    set_kernels(args.kernels)
    tiny = args.quick and args.device == 'cpu'
    dtype = getattr(torch, args.dtype or ('bfloat16' if args.device == 'cuda' else 'float32'))
    s = Settings(device=args.device, batch_train=4 if tiny else 128, batch_infer=8 if tiny else 256,
                 size=32 if tiny else 224, steps=2 if tiny else (10 if args.quick else 20),
                 warmup=1 if tiny else (3 if args.quick else 5), rounds=2 if args.quick else 3, dtype=dtype,
                 channels_last=not args.nchw, backend=args.backend)
    if args.device == 'cuda':
        torch.backends.cudnn.benchmark = True
    env = _environment(args, s)
    print(' '.join(f'{k}={v}' for k, v in env.items()), flush=True)
    rows = []
    for name in args.models.split(','):
        for mode in modes:
            for step in steps:
                rows.append(bench(name, step, mode, s))
                if args.device == 'cuda':
                    torch.cuda.empty_cache()
    _print_table(rows)
    if args.json:
        atomic_write(args.json, json.dumps(dict(environment=env, rows=[dataclasses.asdict(r) for r in rows]), indent=2))
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

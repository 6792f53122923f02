#!/usr/bin/env python3
""" The Triton kernels compiled for real GPUs without one: registers per thread and spills of every specialisation
that train steps launch

1. Record: one train step (forward, backward) of each patchnorm model, in bfloat16 autocast and in float32,
   channels-last and NCHW, runs under `FakeTensorMode`: shapes, strides and dtypes are a real step's, no arithmetic
   is done. The custom ops run their bodies, whose launchers record each launch's arguments (the results come from
   the kernels' torch twins), so a 224 px step costs what its Python costs. The kernels' self-check
   (`layers/kernels/selfcheck.py`: what a GPU runs before their first use) is recorded the same way, at its GPU
   sizes, in each dtype and layout.
2. Specialise: Triton's own JIT binder turns each launch into the specialisation the GPU would compile (integer
   arguments equal to 1 become constants, integers divisible by 16 and 16-byte aligned pointers get attributes).
3. Compile each distinct specialisation ahead of time with `triton.compile` for each target (`ptxas` from Triton's
   wheel, as the JIT runs it) and read its registers and local memory (spills) with the wheel's `cuobjdump`.

Fails (exit 1) where a specialisation does not compile, spills, or needs more registers per thread than `--budget`
at its launch's warps. Triton caches compiled kernels (`~/.triton/cache`), so a second run compiles nothing.

    python scripts/kernel_registers.py                      # resnet50, convnext_tiny, vit_small; sm_80 and sm_90a
    python scripts/kernel_registers.py --models resnet18 --img-size 64 --archs sm_90a --json rows.json
"""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import timm
import torch

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm'
from timm_affinediv._torch_compat import FakeTensorMode, fakes_run_bodies
from timm_affinediv.cli import run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.files import atomic_write

MODELS = ('resnet50', 'convnext_tiny', 'vit_small_patch16_224')
ARCHS = {'sm_80': 80, 'sm_90a': 90}


def _describe(arg):
    """What Triton's specialisation reads of a launch argument: a tensor's dtype and alignment, a scalar itself."""
    if isinstance(arg, torch.Tensor):
        # a GPU allocation is 16-byte aligned: a view is as aligned as its offset
        return ['tensor', str(arg.dtype).removeprefix('torch.'), arg.storage_offset() * arg.element_size() % 16]
    return arg


def record(models: List[str], img_size: int) -> Tuple[Dict[str, int], Dict[str, Any]]:
    """`{launch: count}` over one fake train step of each model, dtype and layout (see the module's docstring), and
    the kernels launched, by name."""
    from timm_affinediv.layers.kernels import selfcheck
    from timm_affinediv.layers.kernels.recording import custom_ops, recorded_launches
    launches, kernels = collections.Counter(), {}

    def launch(kernel, args, constexprs):
        kernels[kernel.__name__] = kernel
        launches[json.dumps([kernel.__name__, [_describe(a) for a in args], constexprs])] += 1

    # under FakeTensorMode the ops run their bodies, not their shape functions
    with recorded_launches(launch) as launchers, fakes_run_bodies(custom_ops()):
        for name in models:
            for dtype in (torch.bfloat16, torch.float32):
                for channels_last in (True, False):
                    torch.manual_seed(0)
                    model = timm.create_model(name, norm_layer='patchnorm', num_classes=10).train()
                    if channels_last:
                        model = model.to(memory_format=torch.channels_last)
                    with FakeTensorMode(allow_non_fake_inputs=True):
                        x = torch.randn(1, 3, img_size, img_size)
                        if channels_last:
                            x = x.to(memory_format=torch.channels_last)
                        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                            out = model(x)
                        out.float().square().mean().backward()
        for dtype in (torch.bfloat16, torch.float32):
            for channels_last in (True, False):
                with FakeTensorMode(allow_non_fake_inputs=True):
                    cases = selfcheck.run_cases(launchers, torch.device('cpu'), dtype, channels_last,
                                                selfcheck.GPU_SIZES)
                    for _ in cases:
                        pass
    return dict(launches), kernels


class _Pointer:
    """A tensor argument as Triton's specialisation sees it: a dtype and an address."""

    def __init__(self, dtype: str, misalignment: int):
        self.dtype, self._address = getattr(torch, dtype), 1024 + misalignment

    def data_ptr(self) -> int:
        return self._address


def _specialise(kernel, launch: list, target):
    """`(signature, constexprs, attrs, options)` of a recorded launch for `target`, as Triton's JIT compiles it: its
    binder gives each argument's `(type, attribute)` ('constexpr' and the value for a constant), the constants and
    attributes are keyed by the argument's path (one index: these kernels take no tuple arguments), and the launch's
    keywords give the options."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    _, args, kwargs = launch
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*[_Pointer(a[1], a[2]) if isinstance(a, list) else a for a in args], **kwargs)
    values = list(bound.values())
    signature = {param.name: kind for param, (kind, _) in zip(kernel.params, specialization)}
    constexprs = {(i,): values[i] for i, (kind, _) in enumerate(specialization) if kind == 'constexpr'}
    # a constant's attribute is '' (none), a runtime argument's the binder's string ('D': divisible by 16), if any
    attrs = {(i,): backend.parse_attr('' if kind == 'constexpr' else attr) for i, (kind, attr) in
             enumerate(specialization) if kind == 'constexpr' or isinstance(attr, str)}
    return signature, constexprs, attrs, backend.parse_options(kwargs)


def _resources(cubin: bytes, folder: str) -> Dict[str, int]:
    """Registers per thread and local memory (spills, bytes per thread) of a compiled kernel, from cuobjdump."""
    import triton
    path = os.path.join(folder, 'kernel.cubin')
    with open(path, 'wb') as f:
        f.write(cubin)
    tool = os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', 'cuobjdump')
    usage = subprocess.run([tool, '-res-usage', path], capture_output=True, text=True, check=True).stdout
    found = re.search(r'REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)', usage)
    return dict(registers=int(found[1]), stack=int(found[2]), local=int(found[3]))


def compile_all(launches: Dict[str, int], kernels: Dict[str, Any], archs: List[str]) -> List[dict]:
    """One row per distinct specialisation and target: its constants, launches, warps, registers, spills, error."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows, seen = [], {}
    for arch in archs:
        target = GPUTarget('cuda', ARCHS[arch], 32)
        for key, count in launches.items():
            launch = json.loads(key)
            kernel = kernels[launch[0]]
            signature, constexprs, attrs, options = _specialise(kernel, launch, target)
            spec = json.dumps([launch[0], arch, signature, sorted(map(str, constexprs.items())),
                               sorted(map(str, attrs.items())), options.num_warps])
            if spec in seen:
                seen[spec]['launches'] += count
                continue
            names = kernel.arg_names
            row = dict(kernel=launch[0], arch=arch, launches=count, warps=options.num_warps, error='',
                       constants={names[k[0]]: v for k, v in constexprs.items() if names[k[0]].isupper()},
                       pointers=sorted({t for t in signature.values() if t.startswith('*')}))
            try:
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                          options=options.__dict__)
                with tempfile.TemporaryDirectory() as folder:
                    row.update(_resources(compiled.asm['cubin'], folder))
            except Exception as error:
                row.update(registers=0, stack=0, local=0, error=f'{type(error).__name__}: {str(error)[:300]}')
            rows.append(row)
            seen[spec] = row
    return rows


def failures(rows: List[dict], budget: int) -> List[dict]:
    return [r for r in rows if r['error'] or r['local'] or r['registers'] > budget]


def main(argv=None) -> int:
    parser = command_parser('kernel_registers', __doc__, prog='scripts/kernel_registers.py')
    parser.add_argument('--models', nargs='+', default=list(MODELS))
    parser.add_argument('--img-size', type=int, default=224)
    parser.add_argument('--archs', nargs='+', default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument('--budget', type=int, default=128, help='registers per thread a kernel may take (128: four '
                        'blocks of 128 threads an SM)')
    parser.add_argument('--json', help='write the rows here')
    args = parser.parse_args(argv)
    if os.environ.get('TRITON_INTERPRET') == '1':
        parser.error('TRITON_INTERPRET=1 makes Triton define interpreted functions, which do not compile: unset it')
    start = time.perf_counter()
    launches, kernels = record(args.models, args.img_size)
    recorded = time.perf_counter()
    rows = compile_all(launches, kernels, args.archs)
    bad = failures(rows, args.budget)
    for row in sorted(rows, key=lambda r: -r['registers']):
        if row in bad or row['registers'] > 96:
            print(f"{row['kernel']} {row['arch']} warps {row['warps']} registers {row['registers']} local "
                  f"{row['local']} launches {row['launches']} {row['constants']} {row['error']}")
    for arch in args.archs:
        mine = [r for r in rows if r['arch'] == arch]
        print(f'{arch}: {len(mine)} specialisations ({sum(r["launches"] for r in mine)} launches), registers '
              f'{min(r["registers"] for r in mine)}-{max(r["registers"] for r in mine)}, over 96: '
              f'{sum(r["registers"] > 96 for r in mine)}, over {args.budget}: '
              f'{sum(r["registers"] > args.budget for r in mine)}, spilling: {sum(r["local"] > 0 for r in mine)}, '
              f'failed: {sum(bool(r["error"]) for r in mine)}')
    print(f'recorded in {recorded - start:.0f} s, compiled in {time.perf_counter() - recorded:.0f} s')
    if args.json:
        atomic_write(args.json, json.dumps(dict(launches=len(launches), rows=rows), indent=1))
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(run_main(main))

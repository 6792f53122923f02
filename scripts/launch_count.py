#!/usr/bin/env python3
""" Kernel launches in one train step of a patchnorm model on the Triton path against the model with its native norm,
counted on the CPU

A train step is forward, cross-entropy, backward and an SGD step (momentum, foreach), in bfloat16 autocast on
channels-last tensors, after one warm-up step. In eager mode every aten operation that is not a view, an allocation
or metadata is one kernel launch on a GPU, and so is every Triton kernel call: the count is the outermost aten
operations of a profiler trace (custom ops transparent: the operations inside them count) plus the Triton launches.
The kernels' values come from their torch twins (`layers/kernels/_torch.py`), which the count leaves out, so no
interpreter is needed; the launchers' own operations (allocations, the reduction of partial sums) count.

    python scripts/launch_count.py --json counts.json    # resnet50, convnext_tiny: 64 px, batch 2; also a record
    python scripts/launch_count.py --json counts.json --table-only   # the record's table, nothing counted
    python scripts/launch_count.py --models resnet18 --top 10
"""
import collections
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import timm
import torch
import torch.nn.functional as F

import timm_affinediv  # noqa: F401  registers norm_layer='patchnorm'
from timm_affinediv.cli import run_main
from timm_affinediv.commands import command_parser

# views, allocations and metadata: no kernel on a GPU (a dtype or layout copy, `_to_copy`, is counted inside `to`)
FREE = {
    'detach', 'view', '_unsafe_view', 't', 'transpose', 'permute', 'expand', 'as_strided', 'unsqueeze', 'squeeze',
    'slice', 'select', 'alias', '_reshape_alias', 'reshape', 'empty', 'new_empty', 'lift_fresh', 'is_same_size',
    'empty_like', 'empty_strided', 'new_empty_strided', 'detach_', 'result_type', 'resolve_conj', 'resolve_neg',
    'size', 'stride', 'dim', 'contiguous', 'numel', 'to', '_to_copy', 'promote_types', 'unflatten', 'flatten', 'split',
    'chunk', 'unbind', 'narrow', 'view_as', 'expand_as', 'movedim', 'unsafe_split', 'split_with_sizes',
    'is_contiguous', 'item', '_local_scalar_dense'}
# the operations autocast runs in bfloat16/float16: it casts their float32 arguments inside them
AUTOCAST_OPS = {
    'conv1d', 'conv2d', 'conv3d', 'conv_transpose1d', 'conv_transpose2d', 'conv_transpose3d', 'linear', 'matmul', 'mm',
    'bmm', 'addmm', 'baddbmm', 'addbmm', 'prelu', 'scaled_dot_product_attention'}
_HIDDEN = 'kernel values (torch twin)'
AUTOCAST_CAST = 'autocast cast'


def _casts(event) -> int:
    """Tensor casts (`to` / `_to_copy` of a tensor, not a wrapped scalar) at `event`."""
    if event.name == 'aten::to':
        return sum(map(_casts, event.cpu_children))
    return int(event.name == 'aten::_to_copy' and bool(event.input_shapes and event.input_shapes[0]))


def _count_events(events) -> collections.Counter:
    """ Launching aten ops among the outermost ones (walking into custom ops, views' and copies' children), and
    under `AUTOCAST_CAST` the tensor casts autocast makes inside the outermost ones (`AUTOCAST_OPS`), which are
    launches too: the native model's weight casts happen there, where the patchnorm layers' own are outermost."""
    counts = collections.Counter()

    def walk(event, inside_aten: bool):
        if event.name == _HIDDEN:
            return
        aten = event.name.startswith('aten::')
        if aten and not inside_aten:
            name = event.name[len('aten::'):]
            if name not in FREE:
                counts[name] += 1
            if name in ('to', '_to_copy', 'contiguous'):  # their copy_ is the launch
                for child in event.cpu_children:
                    walk(child, False)
                return
            if name in AUTOCAST_OPS:
                counts[AUTOCAST_CAST] += sum(map(_casts, event.cpu_children))
        for child in event.cpu_children:
            walk(child, inside_aten or aten)

    for event in [e for e in events if e.cpu_parent is None]:
        walk(event, False)
    return counts


def count(name: str, norm: str, img_size: int, batch: int) -> Tuple[collections.Counter, int]:
    """(launching aten ops by name, Triton launches) of one train step."""
    from timm_affinediv.layers.kernels.recording import recorded_launches
    triton_launches = [0]

    def launch(kernel, args, constexprs):
        triton_launches[0] += 1

    # the torch twins' values, out of the count
    with recorded_launches(launch, lambda: torch.profiler.record_function(_HIDDEN)):
        torch.manual_seed(0)
        kwargs = {'norm_layer': norm} if norm else {}
        model = timm.create_model(name, **kwargs).to(memory_format=torch.channels_last).train()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
        x = torch.randn(batch, 3, img_size, img_size).to(memory_format=torch.channels_last)
        target = torch.randint(0, 1000, (batch,))

        def step():
            with torch.autocast('cpu', dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        triton_launches[0] = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            step()
    return _count_events(prof.events()), triton_launches[0]


def _table(rows) -> List[str]:
    lines = ['| model | native | patchnorm (aten + Triton) | ratio | native, autocast casts counted | patchnorm, '
             'autocast casts counted | ratio | most added aten ops |', '|---|---:|---:|---:|---:|---:|---:|---|']
    for r in rows:
        native, total, triton = r['native'], r['patchnorm'], r['patchnorm_triton']
        native_cast, cast = native + r['native_autocast_casts'], total + r['patchnorm_autocast_casts']
        top = ', '.join(f'{op} +{n}' for op, n in r['added'])
        lines.append(f"| {r['model']} | {native} | {total} ({total - triton} + {triton}) | {total / native:.2f}x | "
                     f'{native_cast} | {cast} | {cast / native_cast:.2f}x | {top} |')
    return lines


def main(argv=None) -> int:
    parser = command_parser('launch_count', __doc__, prog='scripts/launch_count.py')
    parser.add_argument('--models', nargs='+', default=['resnet50', 'convnext_tiny'])
    parser.add_argument('--img-size', type=int, default=64)
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--top', type=int, default=8, help='aten ops listed where patchnorm launches more')
    parser.add_argument('--json', default=None, metavar='FILE', help='also write the counts here (a record)')
    parser.add_argument('--table-only', action='store_true',
                        help='count nothing: print the table of the record --json names')
    args = parser.parse_args(argv)
    if args.table_only:
        if not args.json or not Path(args.json).is_file():
            parser.error('--table-only reads the record that --json names: give an existing file')
        print('\n'.join(_table(json.loads(Path(args.json).read_text())['rows'])))
        return 0
    rows = []
    for name in args.models:
        native, _ = count(name, '', args.img_size, args.batch_size)
        patchnorm, triton_launches = count(name, 'patchnorm', args.img_size, args.batch_size)
        native_casts, casts = native.pop(AUTOCAST_CAST, 0), patchnorm.pop(AUTOCAST_CAST, 0)
        added: Dict[str, int] = {op: n - native.get(op, 0) for op, n in patchnorm.items() if n > native.get(op, 0)}
        rows.append(dict(model=name, native=sum(native.values()),
                         patchnorm=sum(patchnorm.values()) + triton_launches, patchnorm_triton=triton_launches,
                         native_autocast_casts=native_casts, patchnorm_autocast_casts=casts,
                         added=sorted(added.items(), key=lambda kv: -kv[1])[:args.top]))
        print(_table(rows)[-1] if len(rows) > 1 else '\n'.join(_table(rows)), flush=True)
    if args.json:
        record = dict(torch=torch.__version__, timm=timm.__version__, img_size=args.img_size,
                      batch_size=args.batch_size, rows=rows)
        Path(args.json).write_text(json.dumps(record, indent=1) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

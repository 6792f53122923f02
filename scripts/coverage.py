#!/usr/bin/env python3
""" Coverage of `norm_layer="patchnorm"` over timm: which families build, bind, train and infer with it.

Part 1: one small model of every timm module (`timm.list_modules()`, the fewest parameters among the module's
models, counted on the meta device), built with `norm_layer="patchnorm"` (the string; the slot class where the
constructor only calls a class), then a forward and backward in train mode and a forward in eval mode on a batch of
2 at the model's smallest input size, and the divergence factor of its bound layers measured (one SGD step,
float64) against the constant `c`. Part 2 (`--families`): every model of the named families, built and bound.

Writes `docs/results/coverage.md` (a table and the summary line "N of M timm families") and its record
`docs/results/coverage.json`; `--merge docs/results/coverage.json` writes the table again from the record alone.

    python scripts/coverage.py                      # part 1
    python scripts/coverage.py --families resnet convnext vision_transformer   # part 2 too
    python scripts/coverage.py --no-forward --output a.md && python scripts/coverage.py --modules vit deit \
        --output b.md && python scripts/coverage.py --merge a.json b.json      # bind-only rows, some checked
"""
import contextlib
import copy
import gc
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

import timm
import torch
import torch.nn as nn
from timm.models import model_entrypoint

import timm_affinediv
from timm_affinediv import AffineDivLinear, AffineDivLSTM, PatchNorm2d, PatchNormConv2d, describe_slots, update_factor
from timm_affinediv._timm_compat import get_model_input_config
from timm_affinediv.cli import run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.layers.register import norm_layer_refusal
from timm_affinediv.layers.slot import PatchNormSlot

README_FAMILIES = ['resnet', 'convnext', 'vision_transformer', 'deit', 'eva', 'swin_transformer', 'efficientnet',
                   'regnet', 'mobilenetv3', 'densenet']



@dataclass
class Row:
    family: str
    model: str
    params_m: float = 0.0
    # 'string', 'class' (the constructor only calls a class), 'swapped' (the entrypoint fixes it), 'none' (no kwarg)
    norm_layer: str = ''
    slots: int = 0
    bound: int = 0
    corrected_layers: int = 0
    input_size: str = ''
    finite: Optional[bool] = None
    factor_exact: Optional[bool] = None
    factor_max_rel_err: Optional[float] = None
    status: str = ''  # 'working' or 'refused'
    reason: str = ''
    standalone: List[str] = field(default_factory=list)
    seconds: float = 0.0


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int):
    def stop(*_):
        raise Timeout(f'over the {seconds} s limit')
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def param_count(name: str) -> float:
    """Millions of parameters of the plain model, built on the meta device (nothing allocated)."""
    with torch.device('meta'):
        model = timm.create_model(name)
    return sum(p.numel() for p in model.parameters()) / 1e6


def smallest_model(module: str, candidates: int) -> tuple:
    """The model of `module` with the fewest parameters, among `candidates` picked by name (test/tiny ones first)."""
    names = timm.list_models(module=module)
    hints = ('test_', 'atto', 'femto', 'pico', 'nano', 'tiny', 'xxs', '_xs', 'small', '_s', 'b0', '18', 'lite')
    names = sorted(names, key=lambda n: (next((i for i, h in enumerate(hints) if h in n), len(hints)), len(n)))
    counted = []
    for name in names[:candidates]:
        try:
            counted.append((param_count(name), name))
        except Exception:
            continue
    return min(counted) if counted else (0.0, names[0])


def build(name: str, row: Row, img_size: Optional[int] = None) -> nn.Module:
    """ The model with norm_layer='patchnorm' (the string, or the slot class where the family only calls a class),
    at `img_size` where its constructor takes one and builds at that size."""
    create_fn = model_entrypoint(name)  # timm's own, without timm_affinediv's retry, to see how the family takes it
    size = {} if img_size is None else dict(img_size=img_size)
    try:
        model = create_fn(pretrained=False, norm_layer='patchnorm', **size)
        row.norm_layer = 'string'
    except (TypeError, KeyError) as e:
        refusal = norm_layer_refusal(e)
        if refusal == 'class':
            model = create_fn(pretrained=False, norm_layer=PatchNorm2d, **size)
            row.norm_layer = 'class'
        elif refusal == 'swapped':
            model = timm.create_model(name, norm_layer='patchnorm', **size)  # the entrypoint sets it: swapped
            row.norm_layer = 'swapped'
        elif 'norm_layer' in str(e):
            row.norm_layer = 'none'
            raise
        else:
            raise
    return model


def smaller(name: str, row: Row, img_size: int) -> Optional[nn.Module]:
    """The model built at `img_size` (a fixed-size model that takes `img_size`: ViT, Swin, ...), if it runs there."""
    try:
        model = build(name, row, img_size)
        with torch.no_grad():
            model.eval()(torch.randn(1, get_model_input_config(model)['input_size'][0], img_size, img_size))
        return model
    except Exception:
        return None


def input_sizes(model: nn.Module) -> List[tuple]:
    """The model's fixed input size, or small sizes to try, smallest first (64 px, its minimum, then larger)."""
    config = get_model_input_config(model)
    channels, nominal = config['input_size'][0], tuple(config['input_size'][1:])
    if config['fixed_input_size']:
        return [(channels, *nominal)]
    cfg = getattr(model, 'pretrained_cfg', {}) or {}
    low = max(64, *cfg.get('min_input_size', (3, 64, 64))[1:])
    return [(channels, side, side) for side in dict.fromkeys((low, 128, 224)) if side <= max(nominal + (low,))]


def check_factors(model: nn.Module, x: torch.Tensor, max_layers: int) -> float:
    """ The largest relative deviation of a bound layer's measured update factor from its constant `c` (times the
    slot's gain squared at a producer, where the slot's affine is fused), on float64 copies of up to `max_layers`
    bound layers fed their inputs of one forward."""
    modules = dict(model.named_modules())
    pairs = [(b, p) for b in describe_slots(model) for p in filter(None, (b.producer, *b.consumers))]
    pairs = pairs[::max(1, len(pairs) // max_layers)][:max_layers]
    inputs, handles = {}, []

    def keep_input(path):
        def hook(module, args, output):
            inputs.setdefault(path, args[0].detach().clone())
        return hook
    for _, path in pairs:
        handles.append(modules[path].register_forward_hook(keep_input(path)))
    with torch.no_grad():
        model.eval()(x)
    for handle in handles:
        handle.remove()
    worst = 0.0
    for _, path in pairs:
        layer, layer_in = copy.deepcopy(modules[path]).double(), inputs[path].double()
        if isinstance(layer, AffineDivLSTM):  # the corrected map is its first layer's input map
            params = [p for pair in layer.first_layer_maps() for p in pair]
            forward = lambda: layer.input_map(layer_in)  # noqa: E731
        else:
            params = [layer.weight, layer.bias]
            forward = lambda: layer(layer_in)  # noqa: E731
        out = forward()
        index = [0] * out.dim()
        index[1 if isinstance(layer, nn.Conv2d) else -1] = slice(None)
        expected = torch.full(out[tuple(index)].shape, float(layer.divergence_constant), dtype=torch.float64)
        if params[1] is None:  # c |P|^2 / (|P|^2 + eps) = c - eps / s^2: 0 where a patch is all zero (after a ReLU)
            expected = expected - layer.eps * _inv_scale_at(layer, layer_in, index, len(expected)) ** 2
        if getattr(layer, 'fused_slot', None) is not None:  # random gains: zero-initialised last norms give 0
            gain = layer.fused_slot.weight
            with torch.no_grad():
                gain.uniform_(0.5, 1.5)
            expected = expected * gain.detach() ** 2
        factor = update_factor(forward, params, tuple(index))
        worst = max(worst, ((factor - expected).abs() / expected.abs().clamp_min(1e-12)).max().item())
    return worst


def _inv_scale_at(layer: nn.Module, layer_in: torch.Tensor, index: list, outputs: int) -> torch.Tensor:
    """`1 / s` of the patch (or row) each of the `outputs` channels of `layer` reads at the position `index` picks."""
    if isinstance(layer, nn.Conv2d):
        inv_s = layer.inv_scale(layer_in, layer._reversed_padding_repeated_twice)[0, :, 0, 0]  # one per group
        return inv_s.repeat_interleave(layer.out_channels // layer.groups)
    return layer.inv_scale(layer_in)[tuple(index[:-1])].expand(outputs)


def train_step(model: nn.Module, sizes: List[tuple]) -> tuple:
    """A forward and backward in train mode at the first of `sizes` the model takes; (input, all finite)."""
    for i, size in enumerate(sizes):
        x = torch.randn(2, *size)
        try:
            out = model.train()(x)
            break
        except RuntimeError:
            if i == len(sizes) - 1:
                raise
    out = out if isinstance(out, torch.Tensor) else out[0]
    out.float().square().mean().backward()
    finite = bool(torch.isfinite(out).all()) and all(
        bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    return x, finite


def _timm_norm_fails_alike(name: str, message: str) -> bool:
    """Whether the entrypoint fails with the same message given timm's own norm layer (timm's tf_ EfficientNets
    pass `bn_eps`, which the constructor takes only without a norm_layer)."""
    try:
        model_entrypoint(name)(pretrained=False, norm_layer='batchnorm')
    except Exception as e:
        return (str(e).strip().splitlines() or [''])[0][:300] == message
    return False


def cover(family: str, name: str, params: float, forward: bool, max_layers: int, img_size: int = 64) -> Row:
    row = Row(family, name, params_m=round(params, 2))
    start = time.perf_counter()
    try:
        model = build(name, row)
        if forward and get_model_input_config(model)['fixed_input_size']:
            model = smaller(name, row, img_size) or model
        slots = [m for m in model.modules() if isinstance(m, PatchNormSlot)]
        bindings = describe_slots(model)
        row.slots, row.bound = len(bindings), sum(b.bound for b in bindings)
        row.standalone = [f'{b.slot}: {b.note}' for b in bindings if not b.bound]
        row.corrected_layers = sum(isinstance(m, (PatchNormConv2d, AffineDivLinear, AffineDivLSTM))
                                   for m in model.modules())
        if not slots:
            row.status, row.reason = 'refused', 'the constructor takes norm_layer but builds no norm from it'
            return row
        if forward:
            torch.manual_seed(0)
            x, finite = train_step(model, input_sizes(model))
            row.input_size = 'x'.join(map(str, x.shape[2:]))
            model.eval()
            with torch.no_grad():
                out = model(x)
            row.finite = finite and bool(torch.isfinite(out if isinstance(out, torch.Tensor) else out[0]).all())
            if row.bound:
                row.factor_max_rel_err = check_factors(model, x, max_layers)
                row.factor_exact = row.factor_max_rel_err < 1e-6
        working = row.finite is not False and row.factor_exact is not False
        row.status = ('working' if forward else 'bound') if working else 'failing'
        if not working:
            row.reason = 'non-finite outputs or gradients' if row.finite is False else 'inexact divergence factor'
    except Timeout as e:
        row.status, row.reason = 'timeout', str(e)
    except Exception as e:
        message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ''
        if row.norm_layer == 'none':
            row.status, row.reason = 'refused', 'the constructor has no norm_layer argument'
        else:
            row.status, row.reason = 'refused', f'{type(e).__name__}: {message}'
            if _timm_norm_fails_alike(name, message):
                row.reason = f"timm's entrypoint takes no norm_layer here: {row.reason} (the same with timm's own " \
                             "norm_layer='batchnorm')"
    finally:
        row.seconds = round(time.perf_counter() - start, 1)
    return row


def write(rows: List[Row], output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix('.json.tmp')
    tmp.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    tmp.replace(output.with_suffix('.json'))
    part1 = [r for r in rows if not r.family.endswith(' (all)')]
    working = sorted({r.family for r in part1 if r.status == 'working'})
    bound_only = sorted({r.family for r in part1 if r.status == 'bound'})
    families = sorted({r.family for r in part1})
    bound = sum(r.bound for r in part1 if r.status == 'working')
    slots = sum(r.slots for r in part1 if r.status == 'working')
    lines = [
        '# `norm_layer="patchnorm"` across timm', '',
        'Which timm families take `norm_layer="patchnorm"` and which refuse it, and why: a table made by a script.',
        '',
        f'**{len(working)} of {len(families)} timm families** (modules of `timm.list_modules()`, timm '
        f'{timm.__version__}) build, bind, train and infer with `norm_layer="patchnorm"`, with exact divergence '
        f'factors; {bound} of {slots} slots bound in them. '
        + (f'{len(bound_only)} more build and bind but were not put through the training step and the factor '
           'measurement in this run (status `bound`). ' if bound_only else '')
        + 'The others are refused, each with its reason.', '',
        'Made by `python scripts/coverage.py` (one small model per family: the fewest parameters among a few '
        'picked by name; batch of 2 at the smallest input size; factors of up to 4 bound layers measured by one SGD '
        'step in float64). `norm_layer`: how the family takes it (`string`: resolved through timm\'s factory; '
        '`class`: the constructor calls it, and `create_model` passes the slot class for the string; `swapped`: the '
        'entrypoint fixes `norm_layer` itself, and `create_model` swaps its BatchNorms for slots).', '',
        '| family | model | M params | norm_layer | slots bound | corrected layers | input | fwd/bwd/eval finite '
        '| factor exact | status | reason / standalone slots |',
        '|---|---|---|---|---|---|---|---|---|---|---|',
    ]
    for r in part1:
        note = r.reason or '; '.join(r.standalone[:3]) + (f' (+{len(r.standalone) - 3} more)' if len(r.standalone) > 3
                                                          else '')
        flag = {True: 'yes', False: 'NO', None: ''}
        lines.append(
            f'| {r.family} | {r.model} | {r.params_m} | {r.norm_layer} | {r.bound}/{r.slots} | {r.corrected_layers} '
            f'| {r.input_size} | {flag[r.finite]} | {flag[r.factor_exact]} | {r.status} | {note.replace("|", "/")} |')
    lines += _sweep_lines([r for r in rows if r.family.endswith(' (all)')])
    tmp = output.with_suffix('.md.tmp')
    tmp.write_text('\n'.join(lines) + '\n')
    tmp.replace(output)


def _sweep_lines(sweep: List[Row]) -> List[str]:
    """Part 2 in words: per family, how many of its models bind every slot, some, or are refused; then each model
    that does not bind every slot, with the reason."""
    if not sweep:
        return []
    lines = ['', '## Every model of the families README names', '',
             f'Part 2 (`--families`): every model of these families up to the size limit, built with '
             f'`norm_layer="patchnorm"` and bound (no forward): {len(sweep)} models.', '',
             '| family | models | every slot bound | some slots standalone | refused |', '|---|---|---|---|---|']
    for family in sorted({r.family for r in sweep}):
        models = [r for r in sweep if r.family == family]
        refused = sum(r.status not in ('bound', 'working') for r in models)
        whole = sum(r.status in ('bound', 'working') and r.bound == r.slots for r in models)
        lines.append(f'| {family[:-len(" (all)")]} | {len(models)} | {whole} | {len(models) - whole - refused} '
                     f'| {refused} |')
    partial = [r for r in sweep if r.status not in ('bound', 'working') or r.bound != r.slots]
    if partial:
        lines += ['', '| model | slots bound | status | reason / standalone slots |', '|---|---|---|---|']
        for r in partial:
            note = r.reason or '; '.join(r.standalone[:2]) + (f' (+{len(r.standalone) - 2} more)'
                                                               if len(r.standalone) > 2 else '')
            lines.append(f'| {r.model} | {r.bound}/{r.slots} | {r.status} | {note.replace("|", "/")[:300]} |')
    return lines


def main(argv=None) -> int:
    parser = command_parser('coverage', __doc__, prog='scripts/coverage.py')
    parser.add_argument('--output', default='docs/results/coverage.md',
                        help='the table; its record is written beside it, as .json')
    parser.add_argument('--modules', nargs='*', help='timm modules to cover (default: all)')
    parser.add_argument('--families', nargs='*', default=[],
                        help=f'sweep every model of these modules, build and bind only (README: {README_FAMILIES})')
    parser.add_argument('--max-params', type=float, default=100.0, help='sweep: models up to this many M params')
    parser.add_argument('--candidates', type=int, default=6)
    parser.add_argument('--time-limit', type=int, default=120, help='seconds per model')
    parser.add_argument('--max-layers', type=int, default=4)
    parser.add_argument('--no-forward', action='store_true',
                        help='build and bind only (status "bound"): no training step, no factor measurement')
    parser.add_argument('--merge', nargs='+', metavar='JSON',
                        help='only write the table from earlier runs\' JSON files: a later file\'s row replaces an '
                             'earlier one of the same family (part 2: model), unless it ran out of time')
    parser.add_argument('--update', action='store_true',
                        help='replace the rows of the covered modules in an existing table, keep the others')
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    timm_affinediv.register()
    if args.merge:
        merged = {}
        for path in args.merge:
            for r in json.loads(Path(path).read_text()):
                key = (r['family'], r['model'] if r['family'].endswith(' (all)') else '')  # part 2: a row per model
                if key not in merged or r['status'] != 'timeout':
                    merged[key] = Row(**r)
        write(sorted(merged.values(), key=lambda r: r.family), Path(args.output))
        return 0
    rows: List[Row] = []
    covered = args.modules or ([] if args.families else timm.list_modules())  # --families alone: part 2 only
    swept = {f'{module} (all)' for module in args.families}
    previous = Path(args.output).with_suffix('.json')
    if (args.update or not covered) and previous.is_file():
        rows = [Row(**r) for r in json.loads(previous.read_text())
                if r['family'] not in covered and r['family'] not in swept]
    for module in covered:
        if module == 'hub':  # timm_affinediv's own loader entry (hf-hub:/local-dir: folders), not a timm family
            continue
        try:
            params, name = smallest_model(module, args.candidates)
        except Exception as e:
            rows.append(Row(module, '', status='refused', reason=f'no model: {e}'))
            continue
        with time_limit(args.time_limit):
            row = cover(module, name, params, forward=not args.no_forward, max_layers=args.max_layers)
        rows.append(row)
        rows.sort(key=lambda r: r.family)
        print(f'{module:28s} {name:40s} {row.status:8s} {row.bound}/{row.slots} {row.seconds}s {row.reason[:90]}',
              flush=True)
        gc.collect()
        write(rows, Path(args.output))
    for module in args.families:
        for name in timm.list_models(module=module):
            try:
                params = param_count(name)
            except Exception:
                params = float('nan')
            if params > args.max_params:
                continue
            with time_limit(args.time_limit):
                row = cover(module, name, params, forward=False, max_layers=0)
            row.family = f'{module} (all)'
            rows.append(row)
            print(f'{module:28s} {name:40s} {row.status:8s} {row.bound}/{row.slots} {row.seconds}s', flush=True)
            gc.collect()
        write(rows, Path(args.output))
    write(rows, Path(args.output))
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

""" Converting a pretrained BatchNorm/LayerNorm timm model to PatchNorm without losing what it learned

`convert_model(model, norm="patchnorm", calibration=batches)` rebuilds the model's architecture with
`timm.create_model(arch, norm_layer=norm)`, carries every weight over, and maps each norm onto
its slot analytically. Swapping a normaliser changes every activation, so the analytic map alone
loses most of the accuracy; with calibration data the divergence-corrected layers are then fitted,
one after the other in forward order, each on the inputs the converted prefix gives it, so that its
output reproduces the original model's at the same place (the norm's output for a producer, the
layer's own output for a consumer).

The calibration costs a fixed number of forward passes, whatever the depth: both models are traced
(torch.fx) and walked over all calibration batches together, node by node in graph order, pausing at
each corrected layer to fit it on the values cached there (the converted model's input to the layer, the
original's output at its target); the values a later node still needs (a residual block's input, read by
its shortcut) stay cached, within `calib_memory` bytes, and spill to a temporary folder beyond it. Each
node thus runs once per batch: one pass of each model, plus one of the converted model for the analytic
map's agreement, plus the fits.

Each fit is a ridge-regularised least squares problem, exact and closed form: a corrected layer
computes, for each output channel `o` and position `p`,

    z_o,p = v_o . u_p + beta_o,     u_p = [P_p; 1] / s(P_p)

(`v_o = g_o [W_o, b_o]` with the slot's gain `g_o` folded in, `beta_o` the slot's shift, present
only where a slot follows), linear in `(v_o, beta_o)`. The normal equations are accumulated over
the calibration batches (a random subset of positions per batch), and solved with a penalty
`lambda |v_o - v_o^0|^2` pulling towards the analytic map, as post-training quantisation methods do.
The fitted `v_o` is split back into the slot's gain (the ratio of `|v_o|` to the original
convolution's row norm, so that the weights keep their scale) and the layer's weight and bias.

The analytic map (also the starting point of the fit): with BatchNorm `z = gamma (W x + b - mu) /
sigma + beta`, the slot gets `gamma / sigma` and `beta`, the convolution keeps `W` and gets the
pre-division bias `b - mu`: exact wherever the patch's root mean square `s(P)` is 1. With
LayerNorm the slot takes `gamma` and `beta` as they are.
"""
import contextlib
import functools
import logging
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Hashable, Iterable, List, Optional, Tuple

import timm
import torch
import torch.nn as nn
import torch.fx as fx
import torch.nn.functional as F
from timm.layers import get_notrace_functions, get_notrace_modules
from timm.models._input import get_model_args

from .layers.affine_div import AffineDivLinear, PatchNormConv2d
from .layers.binding import SlotLayoutError
from .layers.slot import PatchNormSlot

__all__ = ['convert_model', 'ConversionError', 'ConversionReport', 'LayerFit', 'CONVERSION_NORMS']

_logger = logging.getLogger(__name__)

CONVERSION_NORMS = ('patchnorm', 'affinediv')
_BATCHNORMS = (nn.BatchNorm2d, nn.BatchNorm1d)
_LAYERNORMS = (nn.LayerNorm, nn.GroupNorm)


class ConversionError(ValueError):
    """A model or checkpoint that cannot be converted; the message lists what and why."""


@dataclass
class LayerFit:
    """How well one corrected layer reproduces the original at `target`, before and after fitting."""
    layer: str
    target: str
    positions: int
    rel_err_before: float
    cos_before: float
    rel_err_after: float
    cos_after: float


@dataclass
class ConversionReport:
    architecture: str
    norm: str
    calibration_batches: int
    calibration_images: int
    seconds: float
    top1_agreement_analytic: Optional[float] = None
    analytic_images: int = 0
    top1_agreement_calibrated: Optional[float] = None
    layers: List[LayerFit] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def format_table(self) -> str:
        """The per-layer fidelity as a markdown table, then the whole-model agreement."""
        lines = ['| layer | target | rel. err before | cos before | rel. err after | cos after |',
                 '|---|---|---:|---:|---:|---:|']
        lines += [f'| {f.layer} | {f.target} | {f.rel_err_before:.4f} | {f.cos_before:.4f} | '
                  f'{f.rel_err_after:.4f} | {f.cos_after:.4f} |' for f in self.layers]
        lines.append('')
        if self.top1_agreement_analytic is not None:
            lines.append(f'top-1 agreement with the original: analytic map {100 * self.top1_agreement_analytic:.2f}% '
                         f'(first {self.analytic_images} images)'
                         + ('' if self.top1_agreement_calibrated is None else
                            f', calibrated {100 * self.top1_agreement_calibrated:.2f}%'))
        lines.append(f'{self.architecture} -> {self.norm}, {self.calibration_batches} calibration batches '
                     f'({self.calibration_images} images), {self.seconds:.1f} s')
        return '\n'.join(lines)


def _architecture(model: nn.Module) -> str:
    arch = getattr(model, 'pretrained_cfg', {}).get('architecture')
    if not arch:
        raise ConversionError(
            f'{type(model).__name__} has no pretrained_cfg["architecture"]: create it with timm.create_model.')
    return arch


def model_in_chans(model: nn.Module) -> int:
    """The input channels of a model: those of its first convolution."""
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    if first is None:
        raise ConversionError(f'{type(model).__name__} has no Conv2d: nothing to convert to PatchNorm.')
    return first.in_channels


def build_converted(model: nn.Module, norm: str = 'patchnorm', **model_kwargs) -> nn.Module:
    """`timm.create_model(arch, norm_layer=norm)` with the arguments `model` was created with (timm records them),
    in `model`'s dtype."""
    if norm not in CONVERSION_NORMS:
        raise ConversionError(f'norm must be one of {CONVERSION_NORMS}, got {norm!r}')
    kwargs = dict(num_classes=getattr(model, 'num_classes', 1000), in_chans=model_in_chans(model))
    kwargs.update({k: v for k, v in get_model_args(model).items() if k != 'norm_layer'})
    kwargs.update(model_kwargs)
    try:
        return timm.create_model(_architecture(model), norm_layer=norm, **kwargs).to(next(model.parameters()).dtype)
    except SlotLayoutError as e:
        raise ConversionError(f'cannot convert {_architecture(model)}: {e}') from e


def _check_norms(model: nn.Module, converted: nn.Module) -> Dict[str, nn.Module]:
    """The original norm module at each slot's path; lists what cannot be converted."""
    original = dict(model.named_modules())
    slots = {n: m for n, m in converted.named_modules() if isinstance(m, PatchNormSlot)}
    problems = []
    for name, slot in slots.items():
        norm = original.get(name)
        if not isinstance(norm, _BATCHNORMS + _LAYERNORMS):
            problems.append(f'{name}: the original has {type(norm).__name__}, not a BatchNorm/LayerNorm')
        elif not slot.bound:
            problems.append(f'{name}: the slot is standalone ({slot.binding.note})')
    left = [n for n, m in model.named_modules() if isinstance(m, _BATCHNORMS + _LAYERNORMS) and n not in slots]
    problems += [f'{n}: {type(original[n]).__name__} has no patchnorm slot in the rebuilt model' for n in left]
    if problems:
        raise ConversionError('cannot convert every norm of {}:\n  {}'.format(
            _architecture(model), '\n  '.join(problems)))
    return {name: original[name] for name in slots}


def _carry_weights(model: nn.Module, converted: nn.Module, norms: Dict[str, nn.Module]) -> None:
    """Copy every weight whose name and shape match, then map each norm analytically onto its slot."""
    source = model.state_dict()
    target = converted.state_dict()
    mismatched = [k for k in target if k in source and source[k].shape != target[k].shape]
    if mismatched:
        raise ConversionError(f'shapes differ between the original and the rebuilt model: {mismatched[:10]}')
    with torch.no_grad():
        for key, value in target.items():
            if key in source:
                value.copy_(source[key])
        modules = dict(converted.named_modules())
        for name, norm in norms.items():
            slot = modules[name]
            if isinstance(norm, _BATCHNORMS):
                inv_sigma = (norm.running_var + norm.eps).rsqrt()
                slot.weight.copy_(norm.weight * inv_sigma if norm.affine else inv_sigma)
                slot.bias.copy_(norm.bias if norm.affine else torch.zeros_like(slot.bias))
                producer = slot.binding.producer
                if producer is not None:
                    modules[producer].bias.sub_(norm.running_mean)
            elif norm.weight is not None:
                slot.weight.copy_(norm.weight)
                slot.bias.copy_(norm.bias)


class _ActivationCache:
    """ Per-batch activations kept between two stretches of the calibration walk, within `budget` bytes.

    Tensors are kept in `dtype` (float32 by default: exact; float16 halves the memory) while they fit
    the budget; beyond it they are written to a temporary folder and read back (memory-mapped) when needed.
    """

    def __init__(self, budget: int, dtype: Optional[torch.dtype] = None):
        self.budget = budget
        self.dtype = dtype
        self.used = 0
        self._entries: Dict[Hashable, Tuple[str, Any]] = {}
        self._folder: Optional[tempfile.TemporaryDirectory] = None
        self._files = 0

    def put(self, key: Hashable, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            self._entries[key] = ('object', value)
            return
        value = value.detach()
        stored = value.to(self.dtype) if self.dtype is not None and value.is_floating_point() else value
        if self.used + stored.nbytes <= self.budget:
            self._entries[key] = ('memory', (stored, value.dtype))
            self.used += stored.nbytes
            return
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix='timm-affinediv-calib-')
        path = os.path.join(self._folder.name, f'{self._files}.pt')
        self._files += 1
        torch.save(value.cpu(), path)
        self._entries[key] = ('disk', (path, value.device))

    def get(self, key: Hashable) -> Any:
        kind, entry = self._entries[key]
        if kind == 'object':
            return entry
        if kind == 'memory':
            stored, dtype = entry
            return stored.to(dtype)
        path, device = entry
        return torch.load(path, mmap=True).to(device)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def drop(self, key: Hashable) -> None:
        kind, entry = self._entries.pop(key)
        if kind == 'memory':
            self.used -= entry[0].nbytes
        elif kind == 'disk':
            os.remove(entry[0])

    def close(self) -> None:
        self._entries.clear()
        self.used = 0
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None


class _LeafTracer(fx.Tracer):
    """torch.fx tracing that keeps timm's leaf modules, the corrected layers and slots, and `leaves` whole."""

    def __init__(self, leaves: Iterable[str] = ()):
        super().__init__(autowrap_functions=tuple(get_notrace_functions()))
        self.leaves = set(leaves)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (qualname in self.leaves or isinstance(m, (PatchNormConv2d, AffineDivLinear, PatchNormSlot))
                or type(m) in get_notrace_modules() or super().is_leaf_module(m, qualname))


def _trace(model: nn.Module, leaves: Iterable[str] = ()) -> fx.GraphModule:
    try:
        return fx.GraphModule(model, _LeafTracer(leaves).trace(model))
    except Exception as e:  # torch.fx raises many kinds of errors on untraceable Python
        raise ConversionError(
            f'{_architecture(model)} cannot be traced by torch.fx ({type(e).__name__}: {e}); calibration walks '
            'the traced graph. Convert without calibration data, or register the offending module with '
            'timm.layers.register_notrace_module.') from e


class _GraphWalk:
    """ A traced model run over every calibration batch one stretch of its graph at a time.

    Each node runs once per batch; a value still needed by a later node is kept in the shared cache between
    stretches. So walking the whole graph costs one forward pass, however often it is paused (to fit a layer
    on the inputs reaching it). Residual connections need nothing special: the block input a shortcut reads
    later stays in the cache until its last user has run.
    """

    def __init__(self, traced: fx.GraphModule, batches: List[torch.Tensor], cache: _ActivationCache):
        self.traced = traced
        self.modules = dict(traced.named_modules())
        self.nodes = list(traced.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.last_use = {n: max((self.index[u] for u in n.users), default=i) for i, n in enumerate(self.nodes)}
        self.batches = batches
        self.cache = cache
        self.position = 0
        self.outputs: List[Any] = [None] * len(batches)

    def calls(self, module_path: str) -> List[fx.Node]:
        return [n for n in self.nodes if n.op == 'call_module' and n.target == module_path]

    def node(self, module_path: str) -> fx.Node:
        """The one node calling the module at `module_path`."""
        found = self.calls(module_path)
        if len(found) != 1:
            raise ConversionError(f'{module_path} is called {len(found)} times by the forward pass; calibration '
                                  'fits a layer called exactly once')
        return found[0]

    def value(self, node: fx.Node, batch: int) -> Any:
        return self.cache.get((id(self), node, batch))

    def run_until(self, node: Optional[fx.Node], inclusive: bool = False) -> None:
        """Run every node before `node` (and `node` itself if `inclusive`; None: to the end) on every batch."""
        stop = len(self.nodes) if node is None else self.index[node] + inclusive
        if stop <= self.position:
            if node is not None and inclusive and (id(self), node, 0) not in self.cache:
                raise ConversionError(f'{node.target} was needed after the walk had passed it')
            return
        stretch = self.nodes[self.position:stop]
        for b, x in enumerate(self.batches):
            local: Dict[fx.Node, Any] = {}

            def load(n: fx.Node) -> Any:
                return local[n] if n in local else self.value(n, b)
            for n in stretch:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), load)
                local[n] = self._run(n, x, args, kwargs, b)
            for n, value in local.items():
                if self.last_use[n] >= stop:
                    self.cache.put((id(self), n, b), value)
        for n in self.nodes[:self.position]:  # values whose last user has now run
            if self.position <= self.last_use[n] < stop:
                for b in range(len(self.batches)):
                    self.cache.drop((id(self), n, b))
        self.position = stop

    def _run(self, n: fx.Node, x: torch.Tensor, args: Tuple, kwargs: Dict, batch: int) -> Any:
        if n.op == 'placeholder':
            return x
        if n.op == 'get_attr':
            return functools.reduce(getattr, n.target.split('.'), self.traced)
        if n.op == 'call_module':
            return self.modules[n.target](*args, **kwargs)
        if n.op == 'call_function':
            return n.target(*args, **kwargs)
        if n.op == 'call_method':
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        self.outputs[batch] = args[0]  # 'output'
        return None


def _pixels(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """`x` padded as the convolution pads it, as contiguous (N, H, W, C) pixels: a patch is then kh x kw rows."""
    left, right, top, bottom = layer._reversed_padding_repeated_twice
    if layer.padding_mode != 'zeros':
        x = F.pad(x, (left, right, top, bottom), mode=layer.padding_mode)
    elif left or right or top or bottom:
        n, c, h, w = x.shape
        padded = x.new_zeros(n, h + top + bottom, w + left + right, c)
        padded[:, top:top + h, left:left + w] = x.permute(0, 2, 3, 1)
        return padded
    return x.permute(0, 2, 3, 1).contiguous()  # no copy where x is channels-last already


def _positions(keep: torch.Tensor, height: int, width: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(image, row, column) of output positions numbered image first, then row-major (as `F.unfold` numbers them)."""
    image, at = keep.div(height * width, rounding_mode='floor'), keep.remainder(height * width)
    return image, at.div(width, rounding_mode='floor'), at.remainder(width)


def _features(layer: nn.Module, x: torch.Tensor, keep: Optional[torch.Tensor], shift: bool = False) -> torch.Tensor:
    """ `u = [P; 1] / s(P)` at the output positions `keep` (all if None), and a constant 1 after it for a slot's
    shift if `shift`: (groups, positions, K (+1) (+1)), a patch's features in (kh, kw, C) order (`_fit_order`).

    Only the kept patches are gathered, so the im2col of every position is never materialised.
    """
    bias = layer.bias is not None
    c = layer.divergence_constant
    if isinstance(layer, AffineDivLinear):
        cols = x.reshape(-1, x.shape[-1])
        cols = (cols if keep is None else cols[keep]).unsqueeze(0)             # (1, P, K)
    else:
        (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.stride, layer.dilation
        left, right, top, bottom = layer._reversed_padding_repeated_twice
        out_h = (x.shape[2] + top + bottom - dh * (kh - 1) - 1) // sh + 1
        out_w = (x.shape[3] + left + right - dw * (kw - 1) - 1) // sw + 1
        if keep is None:
            keep = torch.arange(x.shape[0] * out_h * out_w, device=x.device)
        image, row, column = _positions(keep, out_h, out_w)
        rows = row[:, None, None] * sh + torch.arange(kh, device=x.device)[:, None] * dh                # (P, kh, 1)
        columns = column[:, None, None] * sw + torch.arange(kw, device=x.device) * dw                  # (P, 1, kw)
        if layer.groups == 1:
            patches = _pixels(x, layer)[image[:, None, None], rows, columns]                # (P, kh, kw, C)
            cols = patches.view(1, len(keep), -1)                                              # (1, P, K)
        else:
            # gathered channels first, a depthwise layer's features are already (G, P, K), with no transposing copy
            mode = 'constant' if layer.padding_mode == 'zeros' else layer.padding_mode
            x = F.pad(x, (left, right, top, bottom), mode=mode)
            patches = x.transpose(0, 1)[:, image[:, None, None], rows, columns]             # (C, P, kh, kw)
            patches = patches.unflatten(0, (layer.groups, -1)).permute(0, 2, 3, 4, 1)      # (G, P, kh, kw, C/G)
            cols = patches.flatten(2)                                                          # (G, P, K)
    sq = torch.linalg.vector_norm(cols, dim=-1, keepdim=True).square_()
    scale = sq.add_(1. if bias else layer.eps).reciprocal_().mul_(c).sqrt_()            # sqrt(c / (|P|^2 + 1))
    k = cols.shape[-1]
    u = cols.new_empty(cols.shape[:-1] + (k + bias + shift,))
    torch.mul(cols, scale, out=u[..., :k])
    if bias:
        u[..., k:k + 1] = scale
    if shift:
        u[..., -1] = 1.
    return u


def _targets(out: torch.Tensor, channels: int, conv: bool, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """The original's values at the output positions `keep` (all if None) as (positions, channels), whatever
    layout the original produced them in; only the kept positions are copied."""
    if not conv:
        rows = out.reshape(-1, channels)
        return rows if keep is None else rows[keep]
    if out.dim() == 4 and out.shape[1] != channels:
        out = out.permute(0, 3, 1, 2)                                            # channels-last norm output
    pixels = out.permute(0, 2, 3, 1)                                             # (N, H, W, C)
    if keep is None:
        return pixels.reshape(-1, channels)
    return pixels[_positions(keep, pixels.shape[1], pixels.shape[2])]


Fidelity = Tuple[float, float]


class _NormalEquations:
    """ The ridge least-squares fit of `U v ~ Z` per group, from rows (sampled positions) added batch by batch.

    While the rows are fewer than the features they are kept as they are: such a fit is solved in its dual
    form, on the `n x n` products of its rows, and the features no row reaches (the kernel taps that only read
    padding, as in the last stage of a small input) are left out of it. Beyond that they are pooled into
    products of at least as many rows as features (or `pool_rows`; each product reads and writes all of `U^T U`)
    and summed into `U^T U` and `U^T Z`, of which only the blocks on and above the diagonal are computed. Sums
    and products are in the features' dtype, at least float32 (float32: the GEMMs at about four times float64's
    speed, exact to about 1e-6 of their terms, far inside the ridge); the solve is in float64.
    """

    # blocks of 384 leave about 0.6 of a 2306-feature product to compute (1024: 0.7, a 1154-feature one 0.9) and
    # still run at the GEMM's peak: 6% off ResNet-50's conversion at 32x32, 3% at 224x224
    def __init__(self, pool_rows: int = 4096, block: int = 384):
        self.pool_rows, self.block = pool_rows, block
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_rows = 0
        self._gram = self._cross = self.target_sq = None
        self.count = 0

    def add(self, u: torch.Tensor, z: torch.Tensor) -> None:
        dtype = torch.promote_types(u.dtype, torch.float32)  # a half-precision model's features: summed in float32
        self._pending.append((u.to(dtype), z.to(dtype)))
        self._pending_rows += u.shape[1]
        sq = z.double().square().sum((1, 2))
        self.target_sq = sq if self.target_sq is None else self.target_sq + sq
        self.count += u.shape[1]
        if self.count >= u.shape[-1] and self._pending_rows >= min(self.pool_rows, u.shape[-1]):
            self._flush()

    def _take_pending(self) -> Tuple[torch.Tensor, torch.Tensor]:
        u = torch.cat([u for u, _ in self._pending], 1)
        z = torch.cat([z for _, z in self._pending], 1)
        self._pending, self._pending_rows = [], 0
        return u, z

    def _flush(self) -> None:
        if not self._pending:
            return
        u, z = self._take_pending()
        if self._gram is None:
            self._gram = u.new_zeros(u.shape[0], u.shape[2], u.shape[2])
            self._cross = u.new_zeros(u.shape[0], u.shape[2], z.shape[-1])
        with _float32_highest():
            self._cross.baddbmm_(u.transpose(1, 2), z)
            _add_symmetric_product(self._gram, u.transpose(1, 2), self.block)

    def fit(self, v0: torch.Tensor, ridge: float, free_last: bool) -> Tuple[torch.Tensor, Fidelity, Fidelity]:
        """ `v = argmin |U v - Z|^2 + lambda |v - v0|^2`, `lambda = ridge * mean diag(U^T U)`, the last row (a
        constant feature) free if asked; returns `v` and the (relative error, cosine) of `v0` and of `v`.
        """
        k = v0.shape[1]
        if self._gram is None:  # every row is still a row: fewer than the features, or a single pool
            u, z = self._take_pending()
            lam = ridge * u.square().sum((1, 2)).double() / k
            read = u.ne(0).any(1).any(0)
            if read.all():
                return self._fit_read(u, z, v0, lam, free_last)
            v = v0.clone()
            v[:, read], before, after = self._fit_read(u[..., read], z, v0[:, read], lam, free_last)
            return v, before, after
        self._flush()
        lam = ridge * self._gram.diagonal(dim1=1, dim2=2).sum(1).double() / k
        return _solve_normal_equations(self._gram, self._cross, self.target_sq, v0, lam, free_last, self.block)

    def _fit_read(self, u, z, v0, lam, free_last) -> Tuple[torch.Tensor, Fidelity, Fidelity]:
        if u.shape[1] < u.shape[2]:
            return _dual_fit(u, z, self.target_sq, v0, lam, free_last, self.block)
        self._pending = [(u, z)]
        self._flush()
        return _solve_normal_equations(self._gram, self._cross, self.target_sq, v0, lam, free_last, self.block)



@contextlib.contextmanager
def _float32_highest():
    """float32's own precision for the sums, whatever a training script set (TF32 or bf16 products would lose
    three digits); restored after."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _blocks(k: int, block: int) -> List[slice]:
    edges = list(range(0, k, block)) + [k]
    return [slice(a, b) for a, b in zip(edges[:-1], edges[1:])]


def _add_symmetric_product(out: torch.Tensor, a: torch.Tensor, block: int) -> None:
    """`out += a a^T` (batched) on and above the diagonal, in blocks of `block` rows: the product is symmetric."""
    blocks = _blocks(out.shape[-1], block)
    for i, rows in enumerate(blocks):
        for columns in blocks[i:]:
            out[:, rows, columns].baddbmm_(a[:, rows], a[:, columns].transpose(1, 2))


def _symmetric(upper: torch.Tensor, block: int) -> torch.Tensor:
    """The float64 matrix whose blocks on and above the diagonal are `upper`'s (`_add_symmetric_product`)."""
    full = upper.to(torch.float64, copy=True)
    blocks = _blocks(full.shape[-1], block)
    for i, rows in enumerate(blocks):
        for columns in blocks[i + 1:]:
            full[:, columns, rows] = full[:, rows, columns].transpose(1, 2)
    return full


def _fidelity(fit_sq: torch.Tensor, inner: torch.Tensor, target_sq: torch.Tensor) -> Fidelity:
    """Relative error and cosine similarity of a fit to its target, from `|fit|^2`, `<fit, target>`, `|target|^2`."""
    target_sq = target_sq.sum().clamp_min(1e-30)  # a zero target: a zero-initialised gain
    fit_sq, inner = fit_sq.sum(), inner.sum()
    err_sq = (fit_sq - 2 * inner + target_sq).clamp_min(0)
    return (err_sq / target_sq).sqrt().item(), (inner / (fit_sq * target_sq).sqrt().clamp_min(1e-30)).item()


def _ridge(lam: torch.Tensor, k: int, free_last: bool) -> torch.Tensor:
    """The (groups, K) diagonal of the penalty: `lambda` per group, 0 on a free last row."""
    penalty = torch.ones(k, dtype=torch.float64, device=lam.device)
    if free_last:
        penalty[-1] = 0
    return lam.clamp_min(1e-12).view(-1, 1) * penalty


def _cholesky_solve(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """Solve a symmetric positive (semi-)definite system: Cholesky, at half LU's cost; LU where it is not definite
    (no row reached a free constant feature) and the system is solvable all the same."""
    factor, info = torch.linalg.cholesky_ex(system)
    if info.any():
        return torch.linalg.solve(system, rhs)
    return torch.cholesky_solve(rhs, factor)


def _solve_normal_equations(gram_upper, cross, target_sq, v0, lam, free_last, block) -> Tuple[
        torch.Tensor, Fidelity, Fidelity]:
    """The fit from the sums: `(U^T U + diag(reg)) v = U^T Z + reg v0`; both errors from the sums alone."""
    system = _symmetric(gram_upper, block)
    cross = cross.double()
    before = _fidelity(v0 * (system @ v0), v0 * cross, target_sq)
    reg = _ridge(lam, system.shape[-1], free_last)
    system.diagonal(dim1=1, dim2=2).add_(reg)
    v = _cholesky_solve(system, cross + reg.unsqueeze(-1) * v0)
    gram_v = cross + reg.unsqueeze(-1) * (v0 - v)  # U^T U v, from the normal equations themselves
    return v, before, _fidelity(v * gram_v, v * cross, target_sq)


def _dual_fit(u, z, target_sq, v0, lam, free_last, block) -> Tuple[torch.Tensor, Fidelity, Fidelity]:
    """ The fit from fewer rows than features, on the rows' `n x n` products:
    `v = v0 + U^T (U U^T + lambda I)^-1 (Z - U v0)`. A free last row (a constant feature) is the mean of what the
    others leave of `Z`: the rest is fitted on centred rows.
    """
    def quality(v):
        fit = u @ v.to(u.dtype)
        return _fidelity(fit.double().square(), (fit * z).double(), target_sq)

    with _float32_highest():
        before = quality(v0)
        a, w0, target = u, v0, z
        if free_last:
            a, w0 = u[..., :-1], v0[:, :-1]
            a_mean, z_mean = a.mean(1, keepdim=True), z.mean(1, keepdim=True)
            a, target = a - a_mean, z - z_mean
        residual = (target - a @ w0.to(a.dtype)).double()
        products = a.new_zeros(a.shape[0], a.shape[1], a.shape[1])
        _add_symmetric_product(products, a, block)
        system = _symmetric(products, block)
        system.diagonal(dim1=1, dim2=2).add_(_ridge(lam, system.shape[-1], free_last=False))
        w = w0 + (a.transpose(1, 2) @ _cholesky_solve(system, residual).to(a.dtype)).double()
        v = torch.cat([w, (z_mean - a_mean @ w.to(a.dtype)).double()], 1) if free_last else w
        return v, before, quality(v)


def _fit_order(weight: torch.Tensor) -> torch.Tensor:
    """A weight as (O, K), each row in the order of `_features`' patch features: (kh, kw, C) for a convolution."""
    return weight.permute(0, 2, 3, 1).flatten(1) if weight.dim() == 4 else weight


def _from_fit_order(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`_fit_order`'s inverse: (O, K) rows as a view shaped as `weight`."""
    if weight.dim() != 4:
        return rows
    out, channels, kh, kw = weight.shape
    return rows.view(out, kh, kw, channels).permute(0, 3, 1, 2)


def _layer_params(layer: nn.Module, slot: Optional[PatchNormSlot]) -> torch.Tensor:
    """The current map as `v`: (groups, K (+1 bias) (+1 shift), out per group), the slot's gain folded in."""
    groups = getattr(layer, 'groups', 1)
    w = _fit_order(layer.weight.detach().double())                              # (O, K)
    cols = [w] + ([layer.bias.detach().double()[:, None]] if layer.bias is not None else [])
    v = torch.cat(cols, 1)
    if slot is not None:
        v = v * slot.weight.detach().double()[:, None]
        v = torch.cat([v, slot.bias.detach().double()[:, None]], 1)
    return v.unflatten(0, (groups, -1)).transpose(1, 2)


def _set_layer_params(layer: nn.Module, slot: Optional[PatchNormSlot], v: torch.Tensor) -> None:
    v = v.transpose(1, 2).flatten(0, 1)                                          # (O, K (+1) (+1))
    with torch.no_grad():
        if slot is not None:
            shift, v = v[:, -1], v[:, :-1]
            reference = layer.weight.detach().double().flatten(1).norm(dim=1)
            gain = (v[:, :layer.weight[0].numel()].norm(dim=1) / reference.clamp_min(1e-12))
            gain = torch.where(gain > 0, gain, torch.ones_like(gain))
            v = v / gain[:, None]
            slot.weight.copy_(gain)
            slot.bias.copy_(shift)
        k = layer.weight[0].numel()
        layer.weight.copy_(_from_fit_order(v[:, :k], layer.weight))
        if layer.bias is not None:
            layer.bias.copy_(v[:, k])


def _images(batch) -> torch.Tensor:
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def _check_batch(images, in_chans: int) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[1] != in_chans:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ConversionError(
            f'calibration batches must be image tensors (N, {in_chans}, H, W) (or (images, labels) pairs), '
            f'got {shape}: use data with {in_chans} channel(s) and the size the model was trained at')


def _agreement(logits: List[torch.Tensor], other: List[torch.Tensor]) -> float:
    """Top-1 agreement over the batches both lists have (`other` may cover only the first ones)."""
    pairs = list(zip(logits, other))
    return sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in pairs) / sum(len(a) for a, _ in pairs)


def resolve_device(device: Optional[str] = None) -> torch.device:
    """`device`, or 'auto'/None: CUDA when available, else the CPU."""
    if device in (None, 'auto'):
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise ConversionError(f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'") from e
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise ConversionError("device 'cuda' asked for, but torch sees no CUDA device: use --device cpu (or auto)")
    return device


def convert_model(
        model: nn.Module,
        norm: str = 'patchnorm',
        calibration: Optional[Iterable] = None,
        *,
        ridge: float = 1e-2,
        positions_per_batch: int = 2048,
        positions_per_unknown: Optional[float] = 32.,
        analytic_batches: Optional[int] = 1,
        device: Optional[str] = None,
        calib_memory: int = 4 << 30,
        cache_dtype: Optional[torch.dtype] = None,
        progress: bool = False,
        seed: int = 0,
        **model_kwargs,
) -> Tuple[nn.Module, ConversionReport]:
    """ Rebuild `model` (a BatchNorm/LayerNorm timm model) with `norm` ("patchnorm" or "affinediv").

    Args:
        model: the trained timm model; it is not modified (it is moved to `device` and back).
        norm: "patchnorm" (norm slots bound to their convolutions), or "affinediv" (every Conv2d/Linear
            divergence corrected, the slots only affine).
        calibration: an iterable of image batches (or (images, labels) pairs). Without it, the
            analytic map only.
        ridge: strength of the pull towards the analytic map, relative to the mean diagonal of the
            normal equations.
        positions_per_batch: output positions sampled per batch and layer for the fit, at most.
        positions_per_unknown: at most this many sampled positions per unknown of a layer's fit (its fan-in, plus
            the bias and the slot's shift), over all batches: a least-squares fit needs a multiple of its unknowns,
            and `U^T U` costs positions x unknowns^2, which would dwarf the forward passes in a wide layer (None:
            `positions_per_batch` from every batch).
        analytic_batches: the first calibration batches the analytic map's top-1 agreement with the original is
            measured on, in a forward pass of its own (None: all; 0: not measured). It is a diagnostic (how much
            the calibration does), so by default one batch: with a few large images, more would cost a large part
            of a forward pass. The calibrated model's agreement is measured on all of them, at no cost: the
            calibration walk computes its output.
        device: where the forward passes run and the normal equations are accumulated (float32 products) and
            solved (float64): 'cpu', 'cuda', or 'auto'/None (CUDA when available).
        calib_memory: bytes of activations kept between two steps of the calibration walk; beyond it
            they spill to a temporary folder.
        cache_dtype: the dtype those activations are kept in (None: as computed, exact; torch.float16
            halves the memory at float16 precision).
        progress: show a progress bar.
        **model_kwargs: passed to `timm.create_model`, over the arguments `model` was created with.

    Returns:
        The converted model (in eval mode, on the device `model` was on) and the report.
    """
    start = time.perf_counter()
    was_training = model.training
    home = next(model.parameters()).device
    device = resolve_device(device)
    converted = build_converted(model, norm, **model_kwargs).eval()
    norms = _check_norms(model, converted)
    _carry_weights(model, converted, norms)
    batches = [_images(b) for b in calibration] if calibration is not None else []
    in_chans = model_in_chans(model)
    for x in batches:
        _check_batch(x, in_chans)
    report = ConversionReport(
        architecture=_architecture(model), norm=norm, calibration_batches=len(batches),
        calibration_images=sum(x.shape[0] for x in batches), seconds=0.0)
    if batches:
        model.eval().to(device)
        converted.to(device)
        try:
            _calibrate(model, converted, [x.to(device) for x in batches], report, ridge,
                       (positions_per_batch, positions_per_unknown), _ActivationCache(calib_memory, cache_dtype),
                       progress, seed, analytic_batches)
        finally:
            model.to(home)
        converted.to(home)
    report.seconds = time.perf_counter() - start
    model.train(was_training)
    return converted, report


def _calibrate(model, converted, batches, report, ridge, sampling, cache, progress, seed, analytic_batches) -> None:
    """ Fit every corrected layer in forward order on the converted prefix's inputs (module docstring).

    Both models are traced and walked over all batches together (`_GraphWalk`): the converted model up to
    the next corrected layer, the original up to that layer's target; the layer is fitted on the cached
    values there, then both walks go on. Each model's graph thus runs once per batch, whatever its depth.
    """
    generator = torch.Generator().manual_seed(seed)
    slots = {s.binding.producer: s for s in converted.modules()
             if isinstance(s, PatchNormSlot) and s.binding is not None and s.binding.producer}
    slot_paths = {id(s): n for n, s in converted.named_modules()}
    layers = [(n, m) for n, m in converted.named_modules() if isinstance(m, (PatchNormConv2d, AffineDivLinear))]
    targets = {name: slot_paths[id(slots[name])] if name in slots else name for name, _ in layers}
    with torch.no_grad():
        analytic = [converted(x) for x in batches[:analytic_batches]]
        walk = _GraphWalk(_trace(converted), batches, cache)
        original = _GraphWalk(_trace(model, targets.values()), batches, cache)
        layers = sorted([(n, m) for n, m in layers if walk.calls(n)], key=lambda item: walk.index[walk.node(item[0])])
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(layers), desc='calibrating', unit='layer', leave=False)
        try:
            for name, layer in layers:
                _fit_layer(name, layer, slots.get(name), targets[name], walk, original, report, ridge, sampling,
                           generator)
                if bar is not None:
                    bar.update()
            walk.run_until(None)
            original.run_until(None)
        finally:
            cache.close()
            if bar is not None:
                bar.close()
    if analytic:
        report.top1_agreement_analytic = _agreement(original.outputs, analytic)
        report.analytic_images = sum(len(a) for a in analytic)
    report.top1_agreement_calibrated = _agreement(original.outputs, walk.outputs)


def positions_per_batch_for(unknowns: int, batches: int, per_batch: int, per_unknown: Optional[float]) -> int:
    """The positions drawn from each batch for a fit of `unknowns` unknowns: at most `per_batch`, and at most
    `per_unknown` per unknown over all `batches`."""
    if per_unknown is None:
        return per_batch
    return max(1, min(per_batch, math.ceil(per_unknown * unknowns / batches)))


def _fit_layer(name, layer, slot, target_path, walk, original, report, ridge, sampling, generator):
    """Fit one layer on the inputs the converted walk gives it, to the original walk's values at `target_path`."""
    node, target = walk.node(name), original.node(target_path)
    walk.run_until(node)
    original.run_until(target, inclusive=True)
    conv = isinstance(layer, PatchNormConv2d)
    channels = layer.weight.shape[0]
    unknowns = layer.weight[0].numel() + (layer.bias is not None) + (slot is not None)
    positions_per_batch = positions_per_batch_for(unknowns, len(walk.batches), *sampling)
    equations = _NormalEquations()
    for b in range(len(walk.batches)):
        out = original.value(target, b)
        positions = out.numel() // channels
        keep = None
        if positions > positions_per_batch:  # the draw, per batch in forward order, of the layer-by-layer fit
            keep = torch.randperm(positions, generator=generator)[:positions_per_batch].to(out.device)
        z = _targets(out, channels, conv, keep)
        u = _features(layer, walk.value(node.args[0], b), keep, shift=slot is not None)
        z = z.unflatten(1, (u.shape[0], -1)).transpose(0, 1)                      # (G, positions, out/G)
        equations.add(u, z)
    v, before, after = equations.fit(_layer_params(layer, slot), ridge, free_last=slot is not None)
    _set_layer_params(layer, slot, v)
    report.layers.append(LayerFit(name, target_path, equations.count, *before, *after))
    _logger.debug(f'{name}: rel. err {before[0]:.4f} -> {after[0]:.4f}')

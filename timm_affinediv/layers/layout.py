""" Following a tensor's channel axis through the traced operations that only move, select or pad its entries

A `patchnorm` slot binds to the affine maps that act on its channel vector (`binding.py`): a convolution over
dim 1 of an (N, C, H, W) map, a Linear over the last dim of (N, L, C) tokens or (N, H, W, C) maps. Between the
slot and such a map timm's models move the channel vector around: ViT takes its class token (`x[:, 0]`), Swin pads,
rolls and cuts windows (`view`, `permute`, `view`), ConvNeXt permutes to channels-last, PVT and XCiT reshape tokens
into maps. `channel_axis_after` says where the channel axis of a traced node's input lands in its output, from the
operation and the shapes recorded on fake tensors, or why it does not survive the operation.

Two kinds of operation carry the axis:
- moves (permute, transpose, reshapes that keep the channel block whole, `roll`, slicing other axes, Identity,
  Dropout(p=0)): they commute with a per-channel affine, so a producer may apply the slot's affine before them;
- spreads (padding, `cat`/`split` along other axes, Dropout, average pooling over positions, reshapes that merge
  whole channel vectors into one longer last axis, as TNT's pixels into its patch vector): the Linear after them
  still acts on vectors built from the slot's channel vectors alone, but the slot must apply its own affine first,
  so they are followed from a slot to its consumers only.
"""
import builtins
import math
import operator
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ['channel_axis_after', 'is_metadata_use', 'merged_axis', 'reshaped_axis', 'value_shape']

# reshapes timm registers as leaf functions: window_reverse keeps the channels last in (N, H, W, C) windows
_RESHAPES = {'reshape', 'view', 'flatten', 'unflatten', 'squeeze', 'unsqueeze', 'window_reverse', 'window_partition'}
_KEEPS = {'contiguous', 'clone', 'to', 'type_as', 'float', 'half', 'bfloat16', 'double'}
_SPLITS = {'split', 'chunk', 'tensor_split', 'unbind'}
_METADATA_ATTRS = {'shape', 'dtype', 'device', 'ndim', 'is_cuda'}
_METADATA_METHODS = {'size', 'dim', 'numel', 'ndimension'}

Outcome = Tuple[Optional[int], str]


def is_metadata_use(node: fx.Node) -> bool:
    """A use that reads a tensor's shape, dtype or device, not its values (`B, N, C = x.shape`)."""
    if node.op == 'call_function' and node.target is builtins.getattr:
        return node.args[1] in _METADATA_ATTRS
    return node.op == 'call_method' and node.target in _METADATA_METHODS


def _op_name(node: fx.Node, modules: Dict[str, nn.Module]) -> str:
    if node.op == 'call_module':
        return type(modules[node.target]).__name__
    if node.op == 'call_method':
        return node.target
    return getattr(node.target, '__name__', str(node.target))


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _dims(values: Any, ndim: int) -> Tuple[int, ...]:
    if isinstance(values, int):
        values = (values,)
    return tuple(d % ndim for d in values)


def value_shape(value: Any) -> Optional[Tuple[int, ...]]:
    """The shape of a traced tensor value, None for anything else."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def reshaped_axis(in_shape: Sequence[int], out_shape: Sequence[int], axis: int) -> Optional[int]:
    """ The axis of a row-major reshape's output that holds the input axis `axis` whole, or None.

    It is the output axis of the same size with the same number of entries after it: then entry `(.., c, ..)` of
    the input's channel block lands at `(.., c, ..)` of the output's, for every position.
    """
    size, inner = in_shape[axis], math.prod(in_shape[axis + 1:])
    for j, s in enumerate(out_shape):
        if s == size and math.prod(out_shape[j + 1:]) == inner:
            return j
    return None


def merged_axis(in_shape: Sequence[int], out_shape: Sequence[int], axis: int) -> Optional[int]:
    """ The last axis of a row-major reshape's output where it holds whole blocks of the input's trailing axes
    `j..` (`1 <= j <= axis`: each sample's vectors kept apart), so every output vector is made of whole channel
    vectors (TNT's `(B * N, pixels, C) -> (B, N, pixels * C)`); None otherwise.
    """
    for j in range(1, axis + 1):
        if out_shape[-1] == math.prod(in_shape[j:]) and math.prod(out_shape[:-1]) == math.prod(in_shape[:j]):
            return len(out_shape) - 1
    return None


def _indexed_axis(index: Any, ndim: int, axis: int) -> Outcome:
    """Where `x[index]` puts axis `axis` of `x` (basic indexing), if it keeps it whole."""
    entries = index if isinstance(index, tuple) else (index,)
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    in_dim = out_dim = 0
    for entry in entries:
        if entry is None:
            out_dim += 1
        elif entry is Ellipsis:
            skip = ndim - consumed
            if in_dim <= axis < in_dim + skip:
                return out_dim + axis - in_dim, ''
            in_dim, out_dim = in_dim + skip, out_dim + skip
        elif isinstance(entry, slice):
            if in_dim == axis:
                full = entry.start in (None, 0) and entry.stop is None and entry.step in (None, 1)
                return (out_dim, '') if full else (None, 'slices the channels')
            in_dim, out_dim = in_dim + 1, out_dim + 1
        elif isinstance(entry, int):
            if in_dim == axis:
                return None, 'selects one channel'
            in_dim += 1
        else:
            return None, 'indexes with a tensor'
    return out_dim + axis - in_dim, ''


def _reduced_axis(node: fx.Node, ndim: int, axis: int) -> Outcome:
    """`x.mean(dims)` over positions: the pooled channel vectors, or None where it averages the channels."""
    dims = _arg(node, 1, 'dim')
    if dims is None:
        return None, 'averages over every axis'
    dims = _dims(dims, ndim)
    if axis in dims or 0 in dims:
        return None, 'averages over the channels or the samples'
    keepdim = _arg(node, 2, 'keepdim', False)
    return (axis if keepdim else axis - sum(d < axis for d in dims)), ''


def _reshaped_or_merged(in_shape: Sequence[int], out_shape: Sequence[int], axis: int, spreads: bool) -> Optional[int]:
    moved = reshaped_axis(in_shape, out_shape, axis)
    if moved is None and spreads:
        moved = merged_axis(in_shape, out_shape, axis)
    return moved


def channel_axis_after(node: fx.Node, source: fx.Node, axis: int, values: Dict[fx.Node, Any],
                       modules: Dict[str, nn.Module], spreads: bool) -> Outcome:
    """ The axis of `node`'s output holding the channels that axis `axis` of its input `source` holds.

    `values`: the traced nodes' outputs on fake tensors (shapes); `spreads`: also follow the operations a producer
    cannot apply the slot's affine before (padding, cat, split, dropout, average pooling over positions). Returns
    `(axis, '')`, or `(None, reason)` where the operation does not keep the channel vector whole. For a node whose
    output is a tuple (`split`), the axis is that of each of its tensors.
    """
    name = _op_name(node, modules)
    source_value, out_value = values.get(source), values.get(node)
    if isinstance(source_value, (tuple, list)):  # a piece of split/chunk/unbind's output
        if node.op == 'call_function' and node.target is operator.getitem and isinstance(node.args[1], int):
            return axis, ''
        return None, f'{name} of a tuple'
    in_shape, out_shape = value_shape(source_value), value_shape(out_value)
    if in_shape is None:
        return None, 'shapes unknown (the fake-tensor forward stopped before it)'
    if node.op == 'call_module':
        module = modules[node.target]
        if isinstance(module, nn.Identity) or isinstance(module, nn.Dropout) and (spreads or module.p == 0):
            return axis, ''
        if isinstance(module, nn.Flatten) and out_shape is not None:
            moved = _reshaped_or_merged(in_shape, out_shape, axis, spreads)
            return (moved, '') if moved is not None else (None, 'flattens the channels with other axes')
        if spreads and isinstance(module, (nn.AvgPool2d, nn.AdaptiveAvgPool2d)) and axis == 1 and len(in_shape) == 4:
            return axis, ''
        return None, name
    if node.args and node.args[0] is not source and name not in ('cat', 'concat'):
        return None, f'{name} takes it as an argument other than its input'
    ndim = len(in_shape)
    if name in _KEEPS or name == 'dropout' and spreads:
        return axis, ''
    if name == 'permute':
        dims = node.args[1:] if node.op == 'call_method' else (_arg(node, 1, 'dims'),)
        dims = _dims(dims[0] if len(dims) == 1 and not isinstance(dims[0], int) else dims, ndim)
        return dims.index(axis), ''
    if name in ('transpose', 'swapaxes', 'swapdims'):
        a, b = _dims((node.args[1], node.args[2]), ndim)
        return (b if axis == a else a if axis == b else axis), ''
    if name in _RESHAPES:
        moved = _reshaped_or_merged(in_shape, out_shape, axis, spreads) if out_shape is not None else None
        return (moved, '') if moved is not None else (None, f'{name} splits or merges the channel axis')
    if name == 'roll':
        dims = _arg(node, 2, 'dims')
        if dims is None or axis in _dims(dims, ndim):
            return None, 'rolls the channels'
        return axis, ''
    if name == 'getitem':
        moved, why = _indexed_axis(node.args[1], ndim, axis)
        if moved is not None and (out_shape is None or out_shape[moved] != in_shape[axis]):
            return None, 'indexing moves the channels'
        return moved, why
    if not spreads:
        return None, name
    if name == 'pad':
        pads = _arg(node, 1, 'pad')
        padded = {ndim - 1 - i // 2 for i, p in enumerate(pads) if p}
        return (None, 'pads the channels') if axis in padded else (axis, '')
    if name in _SPLITS:
        dim = _arg(node, 1, 'dim', 0) if name == 'unbind' else _arg(node, 2, 'dim', 0)
        dim = dim % ndim
        if dim == axis:
            return None, f'{name} cuts the channel vector'
        return (axis - 1 if name == 'unbind' and dim < axis else axis), ''
    if name in ('cat', 'concat'):
        dim = _arg(node, 1, 'dim', 0) % ndim
        return (None, 'concatenates channels') if dim == axis else (axis, '')
    if name == 'mean':
        return _reduced_axis(node, ndim, axis)
    return None, name

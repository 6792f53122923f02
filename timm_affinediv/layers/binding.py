""" Binding `patchnorm` slots to the affine maps beside them, from the traced data flow

`bind_patchnorm(model)` traces the model with `torch.fx`, with each node's value at the model's
input size on fake tensors (`tracing.py`), and for every `patchnorm` slot follows the data flow, through layout-only
operations (permute, reshape, flatten, contiguous, Identity, Dropout), to

- its producer: the `nn.Conv2d`/`nn.Linear` whose output reaches only this slot. It becomes
  `PatchNormConv2d`/`AffineDivLinear`, with a zero-initialised pre-division bias where it had
  none, so its divergence factor is exactly `c`, and it applies the slot's per-channel affine
  in the same pass as its division (the slot then passes its input through); a `patchnorm_ws` slot's producer
  applies its weight standardised (`standardise_weight`);
- its consumers: the `nn.Conv2d`/`nn.Linear` that the slot's output reaches alone (ConvNeXt's
  `norm -> conv` downsample, `norm -> fc1`, `norm -> head.fc`, a ViT's `norm -> qkv`), and the `nn.LSTM`s
  (Sequencer's), made divergence corrected too (`AffineDivLSTM` corrects an LSTM's input map). A slot that
  reaches Linears only through an elementwise activation (CrossViT's `norm -> GELU -> Linear`) binds to them
  and keeps normalising the activation's input.

Modules are replaced in place at the same attribute, so parameter names stay those of the
original model (`layer1.0.conv1.weight`) and a checkpoint's weights load 1:1. A slot with
neither neighbour stays standalone (see `timm_affinediv.slot`). With `affinediv` slots, every
other `nn.Conv2d`/`nn.Linear` the forward calls is made divergence corrected as well, and the
slots keep only their affine: the paper's network without a normaliser. Binding is idempotent and
can be repeated after changing a model (e.g. `reset_classifier`). `timm.create_model` binds
automatically once `timm_affinediv` is imported.
"""
import functools
import inspect
import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn

from .._timm_compat import get_model_input_config
from .._torch_compat import FakeTensor, FakeTensorMode
from ..errors import BindingError, SlotLayoutError, UnsupportedTypeError
from .affine_div import AffineDivLinear, PatchNormConv2d
from .kernels import kernel_path
from .layout import channel_axis_after, is_metadata_use, value_shape
from .norm import L2NormLinear
from .recurrent import AffineDivLSTM
from .slot import PatchNormSlot, SlotBinding
from .tracing import eval_mode, module_state, trace_values

__all__ = ['bind_patchnorm', 'describe_kernel_paths', 'describe_slots', 'divergence_corrected', 'fake_eval',
           'layer_kernel_paths', 'SlotLayoutError']

_logger = logging.getLogger(__name__)

_AFFINE_TYPES = (nn.Conv2d, nn.Linear)
_CONSUMER_TYPES = (nn.LSTM,)  # corrected where a slot feeds them, never producers (their output is a tuple)
_CORRECTED_TYPES = (PatchNormConv2d, AffineDivLinear, AffineDivLSTM)
_ELEMENTWISE_ACTIVATIONS = (nn.GELU, nn.ReLU, nn.ReLU6, nn.SiLU, nn.Hardswish, nn.Mish, nn.LeakyReLU, nn.ELU,
                            nn.Tanh, nn.Sigmoid, nn.Hardsigmoid)


def _default_forward_args(model: nn.Module) -> Dict[str, Any]:
    """The forward's arguments after the input, traced at their plain defaults (None, a bool, a number): the
    plain forward, not its masked variant (Hiera's `mask`), which the trace would take, as a proxy is never None."""
    params = list(inspect.signature(model.forward).parameters.values())[1:]
    return {p.name: p.default for p in params
            if p.kind is p.POSITIONAL_OR_KEYWORD and isinstance(p.default, (type(None), bool, int, float, str))}


def divergence_corrected(module: nn.Module, scale: str = 'rms', add_bias: bool = False) -> nn.Module:
    """ The divergence-corrected form of an `nn.Conv2d`/`nn.Linear`/`nn.LSTM`, sharing its parameters.

    `add_bias` gives a convolution without a bias a zero pre-division one. Layers already corrected
    are returned as they are.
    """
    if isinstance(module, _CORRECTED_TYPES):
        return module
    if type(module) is nn.Conv2d:
        return PatchNormConv2d.from_conv(module, scale=scale, bias=add_bias or None)
    if type(module) is nn.Linear:
        return AffineDivLinear.from_linear(module, scale=scale)
    if type(module) is nn.LSTM:
        return AffineDivLSTM.from_lstm(module, scale=scale)
    raise UnsupportedTypeError(f"no divergence-corrected form of {type(module).__name__}; "
                               "only nn.Conv2d, nn.Linear and nn.LSTM (exact types) can be converted")


def _is_replaceable_affine(node: fx.Node, modules: Dict[str, nn.Module], calls: Dict[str, int],
                           consumer: bool = False) -> bool:
    """A Conv2d/Linear called once (as a consumer, an LSTM too: its first layer's input map), or its corrected form."""
    if node.op != 'call_module' or calls[node.target] != 1:
        return False
    module = modules[node.target]
    types = _AFFINE_TYPES + _CONSUMER_TYPES if consumer else _AFFINE_TYPES
    corrected = _CORRECTED_TYPES if consumer else (PatchNormConv2d, AffineDivLinear)
    return type(module) in types or isinstance(module, corrected)


def _data_users(node: fx.Node) -> List[fx.Node]:
    return [user for user in node.users if not is_metadata_use(user)]


def _acts_on_channels(module: nn.Module, axis: int, ndim: int) -> bool:
    """A Linear (an LSTM) maps the last axis; a convolution dim 1 of (N, C, H, W)."""
    return axis == 1 and ndim == 4 if isinstance(module, nn.Conv2d) else axis == ndim - 1


def _ndim(value: Any) -> int:
    return value.dim() if isinstance(value, torch.Tensor) else -1


class _SlotGraph:
    """The traced model, its modules and call counts, and every node's output on fake tensors (its shape)."""

    def __init__(self, graph: fx.Graph, modules: Dict[str, nn.Module], values: Dict[fx.Node, Any], stopped: str):
        self.graph, self.modules, self.values, self.stopped = graph, modules, values, stopped
        self.calls: Dict[str, int] = {}
        for node in graph.nodes:
            if node.op == 'call_module':
                self.calls[node.target] = self.calls.get(node.target, 0) + 1

    @functools.cached_property
    def upstream_axes(self) -> Dict[fx.Node, int]:
        """ For each node, the axis holding the output channels of the last Conv2d/Linear before it: followed
        through the moves and spreads, and kept by operations that keep the shape (activations, residual sums)."""
        axes: Dict[fx.Node, int] = {}
        for node in self.graph.nodes:
            value = self.values.get(node)
            if node.op == 'call_module' and isinstance(self.modules[node.target], _AFFINE_TYPES):
                if isinstance(value, torch.Tensor):
                    axes[node] = 1 if isinstance(self.modules[node.target], nn.Conv2d) else value.dim() - 1
                continue
            source = next((n for n in node.all_input_nodes if n in axes), None)
            if source is None:
                continue
            moved, _ = channel_axis_after(node, source, axes[source], self.values, self.modules, spreads=True)
            if moved is None and isinstance(value, torch.Tensor) and value_shape(self.values[source]) == value.shape:
                moved = axes[source]
            if moved is not None:
                axes[node] = moved
        return axes

    def producer(self, slot_node: fx.Node, axis: int) -> Tuple[Optional[str], str]:
        """ The Conv2d/Linear whose output reaches only this slot, through moves that keep the channel vector
        whole and land its output channels on the slot's `axis` (so the producer can apply the slot's affine)."""
        chain, node = [], slot_node.args[0]
        while isinstance(node, fx.Node):
            users = _data_users(node)
            if len(users) > 1:
                return None, f'its input {node.name} also feeds {len(users) - 1} other node(s)'
            if _is_replaceable_affine(node, self.modules, self.calls):
                break
            if node.op not in ('call_module', 'call_method', 'call_function') or not node.args:
                return None, 'no producer'
            chain.append(node)
            node = node.args[0]
        else:
            return None, 'no producer'
        conv = isinstance(self.modules[node.target], nn.Conv2d)
        source, moved = node, 1 if conv else _ndim(self.values.get(node)) - 1
        for step in reversed(chain):
            moved, why = channel_axis_after(step, source, moved, self.values, self.modules, spreads=False)
            if moved is None:
                return None, f'fed by {node.target} through {step.name} ({why})'
            source = step
        if moved != axis:
            return None, f'fed by {node.target}, whose output channels reach its axis {moved}, not {axis}'
        return node.target, ''

    def consumers(self, slot_node: fx.Node, axis: int,
                  through_activations: bool = False) -> Tuple[Tuple[str, ...], str]:
        """ The Conv2d/Linear maps every use of the slot's output reaches, each acting on the slot's channel
        vectors, through the operations that move, select or pad them (and, with `through_activations`, elementwise
        activation modules); none where any use ends elsewhere."""
        found: List[str] = []
        seen = {slot_node: axis}
        frontier = [(slot_node, axis)]
        while frontier:
            node, node_axis = frontier.pop()
            for user in _data_users(node):
                if _is_replaceable_affine(user, self.modules, self.calls, consumer=True) and user.args[0] is node:
                    module = self.modules[user.target]
                    if not _acts_on_channels(module, node_axis, _ndim(self.values.get(node))):
                        return (), f'feeds {user.target} ({type(module).__name__} over an axis other than its channels)'
                    found.append(user.target)
                    continue
                if through_activations and user.op == 'call_module' and \
                        isinstance(self.modules[user.target], _ELEMENTWISE_ACTIVATIONS):
                    moved, why = node_axis, ''
                else:
                    moved, why = channel_axis_after(user, node, node_axis, self.values, self.modules, spreads=True)
                if moved is None:
                    return (), f'feeds {user.name} ({why})'
                if user not in seen:
                    seen[user] = moved
                    frontier.append((user, moved))
                elif seen[user] != moved:
                    return (), f'reaches {user.name} with its channels on two axes'
        if not found:
            return (), 'its output is unused'
        return tuple(dict.fromkeys(found)), ''


@contextmanager
def _keeping_module_state(model: nn.Module) -> Iterator[None]:
    """ Restores any attribute or buffer a module cached as a fake tensor or an `fx.Proxy` while the model was
    traced or run on fake tensors (ConViT's relative indices, masks built on first use): left there, it would fail
    the module's next real forward."""
    cached = module_state(model)
    try:
        yield
    finally:
        for m, (attributes, buffers) in cached.items():
            for table, before in ((vars(m), attributes), (m._buffers, buffers)):
                for name in [n for n, v in table.items() if isinstance(v, (FakeTensor, fx.Proxy))]:
                    if name in before:
                        table[name] = before[name]
                    else:
                        del table[name]


@contextmanager
def fake_eval(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode, computing on fake tensors (shapes only: no arithmetic, nothing stored); the modes of its
    modules, and any tensor they cache in that forward, are restored after."""
    with _keeping_module_state(model), eval_mode(model), FakeTensorMode(allow_non_fake_inputs=True), \
            torch.no_grad():
        yield model


def _channel_axes(name: str, slot: PatchNormSlot, shape: Optional[Tuple[int, ...]], model: nn.Module) -> List[int]:
    """The axes of the slot's input that can hold its channels: dim 1, the last dim, or (shape unknown) its own."""
    if shape is None:
        return []
    axes = [a for a in dict.fromkeys((1, len(shape) - 1)) if len(shape) >= 2 and shape[a] == slot.num_features]
    if not axes:
        raise SlotLayoutError(
            f"norm_layer='patchnorm' does not fit {type(model).__name__}: its norm {name} takes tensors of shape "
            f"{shape}, with its {slot.num_features} channels neither in dim 1 nor in the last dim. A patchnorm "
            "slot normalises (N, C, ...) maps or (..., C) tokens; use another norm_layer for this model.")
    return axes


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition('.')
    setattr(model.get_submodule(parent_path), name, new)


def fuses_qkv_bias(module: nn.Module) -> bool:
    """EVA-style attention that adds its q/v biases through `F.linear` on `qkv.weight`, never calling `qkv`."""
    return getattr(module, 'qkv_bias_separate', None) is False and isinstance(getattr(module, 'qkv', None), nn.Linear)


def separate_qkv_biases(model: nn.Module) -> None:
    """ EVA-style attention adds its q/v biases after a module call, not through `F.linear` on the qkv weight,
    so the traced data flow reaches `attn.qkv` as a module the slot can bind to (same function)."""
    for module in model.modules():
        if fuses_qkv_bias(module):
            module.qkv_bias_separate = True


def _bind_slot(name: str, node: fx.Node, slot: PatchNormSlot, flow: _SlotGraph, model: nn.Module) -> SlotBinding:
    """ The slot's binding, and its channel dim set to where its input holds the channels.

    Where both dim 1 and the last dim have the slot's size (L == C tokens), the data flow decides: the axis that
    holds the channels of the last affine map before the slot, else the layout in which it binds to more maps.
    """
    if flow.calls[name] != 1:
        return SlotBinding(name, note=f'called {flow.calls[name]} times in forward')
    shape = value_shape(flow.values.get(node.args[0]))
    axes = _channel_axes(name, slot, shape, model)
    if not axes:
        return SlotBinding(name, note=f'its input has no shape: the fake-tensor forward stopped {flow.stopped}')
    options = []
    for axis in axes:
        producer, producer_note = flow.producer(node, axis)
        consumers, consumer_note = flow.consumers(node, axis)
        normalises = False
        if producer is None and not consumers:  # its consumers may follow an activation: it normalises for that
            consumers, _ = flow.consumers(node, axis, through_activations=True)
            normalises = bool(consumers)
        note = '' if producer or consumers else f'{producer_note}; {consumer_note}'
        if normalises:
            note = 'normalises (RMS): its consumers follow an activation'
        upstream = len(axes) > 1 and flow.upstream_axes.get(node.args[0]) == axis
        rank = (upstream, (producer is not None) + len(consumers), axis == slot.channel_dim % len(shape))
        options.append((rank, axis, SlotBinding(name, producer, consumers, note, normalises)))
    _, axis, binding = max(options, key=lambda option: option[0])
    if len(shape) > 2:
        slot.channel_dim = 1 if axis == 1 else -1
    return binding


def bind_patchnorm(model: nn.Module) -> List[SlotBinding]:
    """ Bind every `patchnorm` slot of `model` to its neighbours (in place) and return the bindings.

    A no-op for models without slots. Raises `BindingError` (a `RuntimeError`) if the model cannot be traced,
    `SlotLayoutError` if a slot's input holds its channels neither in dim 1 nor in the last dim (checked on fake
    tensors).
    """
    slots = {name: m for name, m in model.named_modules() if isinstance(m, PatchNormSlot)}
    if not slots:
        return []
    separate_qkv_biases(model)
    input_size = tuple(get_model_input_config(model)['input_size'])
    try:
        with _keeping_module_state(model):
            traced = trace_values(model, (2, *input_size), concrete_args=_default_forward_args(model))
    except Exception as e:
        raise BindingError(
            f"cannot bind the patchnorm slots of {type(model).__name__}: torch.fx could not trace it "
            f"({type(e).__name__}: {e}). Use a traceable model, or a norm layer other than 'patchnorm'."
        ) from e
    if traced.stopped:
        _logger.debug(f'shape pass of the patchnorm slots stopped at input size {input_size}: {traced.stopped}')
    graph, modules = traced.graph, dict(model.named_modules())
    flow = _SlotGraph(graph, modules, traced.values, f'at input size {input_size}: {traced.stopped}')
    bindings = {
        node.target: _bind_slot(node.target, node, slots[node.target], flow, model)
        for node in graph.nodes if node.op == 'call_module' and node.target in slots}

    def correct(path: str, scale: str, add_bias: bool = False) -> None:
        modules[path] = divergence_corrected(modules[path], scale=scale, add_bias=add_bias)
        _replace(model, path, modules[path])

    bindings = {name: bindings.get(name, SlotBinding(name, note='not reached by forward')) for name in slots}
    for name, slot in slots.items():  # producers first: a layer that also consumes another slot keeps their bias
        if bindings[name].producer is not None:
            correct(bindings[name].producer, slot.scale, add_bias=True)
            modules[bindings[name].producer].fuse_post_affine(slot)
            modules[bindings[name].producer].standardise_weight = slot.standardises_producer
    for name, slot in slots.items():
        binding = bindings[name]
        for path in binding.consumers:
            correct(path, slot.scale)
        slot.bind(binding, fused=binding.producer is not None)
        if not slot.bound:
            _logger.info(f'patchnorm slot {name} is standalone (RMS normaliser + affine): {binding.note}')

    all_affine = [slot for slot in slots.values() if slot.corrects_all_affine]
    if all_affine:
        for path in flow.calls:
            if type(modules[path]) in _AFFINE_TYPES:
                correct(path, all_affine[0].scale)
    return [slots[name].binding for name in slots]


def describe_slots(model: nn.Module) -> List[SlotBinding]:
    """ Every `patchnorm` slot of `model` and what it is bound to (or why it is standalone).

    Module paths are those of the model as it was bound; an unbound slot has `binding=None`
    and is reported with the note 'not bound'.
    """
    return [
        m.binding if m.binding is not None else SlotBinding(name, note='not bound')
        for name, m in model.named_modules() if isinstance(m, PatchNormSlot)
    ]


def layer_kernel_paths(model: nn.Module) -> Dict[str, str]:
    """ 'triton' or 'torch' for every divergence-corrected layer (and L2NormLinear) of `model`: the path its forward
    takes on its parameters' device and dtype (`kernels.dispatch`; export paths always take torch's).
    """
    return {
        name: kernel_path(m.weight.device, m.weight.dtype) for name, m in model.named_modules()
        if isinstance(m, (PatchNormConv2d, AffineDivLinear, L2NormLinear))
    }


def describe_kernel_paths(model: nn.Module) -> str:
    """ One line for reports: how many divergence-corrected layers take each path where the model is, and the path
    they would take on a CUDA GPU, e.g. "kernels: 53 layers on the torch path (cpu); on a CUDA GPU: triton".
    """
    paths = layer_kernel_paths(model)
    if not paths:
        return 'kernels: no divergence-corrected layers'
    counts = {path: sum(p == path for p in paths.values()) for path in sorted(set(paths.values()))}
    device = next(model.parameters()).device
    where = ', '.join(f'{n} layers on the {path} path' for path, n in counts.items())
    return f'kernels: {where} ({device.type}); on a CUDA GPU: {kernel_path("cuda")}'

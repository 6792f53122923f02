""" Binding `patchnorm` slots to the affine maps beside them, from the traced data flow

`bind_patchnorm(model)` traces the model with `torch.fx` (timm's leaf modules and wrapped
functions respected), and for every `patchnorm` slot follows the data flow, through layout-only
operations (permute, reshape, flatten, contiguous, Identity, Dropout), to

- its producer: the `nn.Conv2d`/`nn.Linear` whose output reaches only this slot. It becomes
  `PatchNormConv2d`/`AffineDivLinear`, with a zero-initialised pre-division bias where it had
  none, so its divergence factor is exactly `c`, and it applies the slot's per-channel affine
  in the same pass as its division (the slot then passes its input through);
- its consumers: the `nn.Conv2d`/`nn.Linear` that the slot's output reaches alone (ConvNeXt's
  `norm -> conv` downsample, `norm -> fc1`, `norm -> head.fc`), made divergence corrected too.

Modules are replaced in place at the same attribute, so parameter names stay those of the
original model (`layer1.0.conv1.weight`) and a checkpoint's weights load 1:1. A slot with
neither neighbour stays standalone (see `timm_affinediv.slot`). With `affinediv` slots, every
other `nn.Conv2d`/`nn.Linear` the forward calls is made divergence corrected as well, and the
slots keep only their affine: the paper's network without a normaliser. Binding is idempotent and
can be repeated after changing a model (e.g. `reset_classifier`). `timm.create_model` binds
automatically once `timm_affinediv` is imported.
"""
import logging
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from timm.layers import get_notrace_functions, get_notrace_modules
from torch._subclasses.fake_tensor import FakeTensorMode

from .._timm_compat import get_model_input_config
from ..errors import SlotLayoutError
from .affine_div import AffineDivLinear, PatchNormConv2d
from .kernels import kernel_path
from .norm import L2NormLinear
from .slot import PatchNormSlot, SlotBinding

__all__ = ['bind_patchnorm', 'describe_kernel_paths', 'describe_slots', 'divergence_corrected', 'fake_eval',
           'layer_kernel_paths', 'SlotLayoutError']

_logger = logging.getLogger(__name__)

_AFFINE_TYPES = (nn.Conv2d, nn.Linear)
_LAYOUT_MODULES = (nn.Identity, nn.Dropout, nn.Flatten)
_LAYOUT_METHODS = {'permute', 'reshape', 'view', 'flatten', 'contiguous'}
_LAYOUT_FUNCTIONS = {'permute', 'reshape', 'flatten', 'dropout'}


class _BindingTracer(fx.Tracer):
    """Traces down to affine layers and slots; timm's own no-trace modules stay leaves too."""

    def __init__(self):
        super().__init__(autowrap_functions=tuple(get_notrace_functions()))
        self._leaf_types = tuple(get_notrace_modules()) + _AFFINE_TYPES + (PatchNormSlot,)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self._leaf_types) or super().is_leaf_module(m, module_qualified_name)


def divergence_corrected(module: nn.Module, scale: str = 'rms', add_bias: bool = False) -> nn.Module:
    """ The divergence-corrected form of an `nn.Conv2d`/`nn.Linear`, sharing its parameters.

    `add_bias` gives a convolution without a bias a zero pre-division one. Layers already corrected
    are returned as they are.
    """
    if isinstance(module, (PatchNormConv2d, AffineDivLinear)):
        return module
    if type(module) is nn.Conv2d:
        return PatchNormConv2d.from_conv(module, scale=scale, bias=add_bias or None)
    if type(module) is nn.Linear:
        return AffineDivLinear.from_linear(module, scale=scale)
    raise TypeError(f"no divergence-corrected form of {type(module).__name__}; "
                    "only nn.Conv2d and nn.Linear (exact types) can be converted")


def _is_layout_op(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    if node.op == 'call_module':
        return type(modules[node.target]) in _LAYOUT_MODULES
    if node.op == 'call_method':
        return node.target in _LAYOUT_METHODS
    if node.op == 'call_function':
        return getattr(node.target, '__name__', '') in _LAYOUT_FUNCTIONS
    return False


def _is_replaceable_affine(node: fx.Node, modules: Dict[str, nn.Module], calls: Dict[str, int]) -> bool:
    if node.op != 'call_module' or calls[node.target] != 1:
        return False
    module = modules[node.target]
    return type(module) in _AFFINE_TYPES or isinstance(module, (PatchNormConv2d, AffineDivLinear))


def _find_producer(slot_node: fx.Node, modules, calls) -> Tuple[Optional[str], str]:
    node = slot_node.args[0]
    while isinstance(node, fx.Node) and len(node.users) == 1:
        if _is_replaceable_affine(node, modules, calls):
            return node.target, ''
        if not _is_layout_op(node, modules):
            return None, f'fed by {node.format_node().split("=", 1)[-1].strip()[:60]}'
        node = node.args[0]
    if isinstance(node, fx.Node) and len(node.users) > 1:
        return None, f'its input {node.name} also feeds {len(node.users) - 1} other node(s)'
    return None, 'no producer'


def _find_consumers(slot_node: fx.Node, modules, calls) -> Tuple[Tuple[str, ...], str]:
    node = slot_node
    while len(node.users) == 1:
        (node,) = node.users
        if _is_replaceable_affine(node, modules, calls) and node.args[0] is not None:
            return (node.target,), ''
        if not _is_layout_op(node, modules):
            return (), f'feeds {node.name}'
    return (), f'its output feeds {len(node.users)} nodes' if node.users else 'its output is unused'


@contextmanager
def fake_eval(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode, computing on fake tensors (shapes only: no arithmetic, nothing stored); the modes of its
    modules are restored after."""
    modes = {m: m.training for m in model.modules()}
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            yield model.eval()
    finally:
        for m, training in modes.items():
            m.training = training


def _slot_input_shapes(model: nn.Module, slots: Dict[str, PatchNormSlot]) -> Dict[str, Tuple[int, ...]]:
    """ The input shape of each slot in a forward of a batch of 2 at the model's input size, on fake tensors (shapes
    only, no arithmetic, nothing stored). Models that do not run on fake tensors give what was seen before they stop.
    """
    shapes: Dict[str, Tuple[int, ...]] = {}

    def record(name):
        def hook(module, args):
            shapes.setdefault(name, tuple(args[0].shape))
        return hook

    handles = [slot.register_forward_pre_hook(record(name)) for name, slot in slots.items()]
    try:
        with fake_eval(model):
            model(torch.empty(2, *get_model_input_config(model)['input_size']))
    except Exception as e:  # a mislaid slot raises here; so may an input size or an op fake tensors do not support
        _logger.debug(f'shape check of the patchnorm slots stopped: {type(e).__name__}: {e}')
    finally:
        for handle in handles:
            handle.remove()
    return shapes


def _check_slot_layouts(model: nn.Module, slots: Dict[str, PatchNormSlot]) -> None:
    """Raise `SlotLayoutError` if a slot's input does not hold its channels in its channel dim (ViT's (N, L, C)
    tokens in a (N, C, H, W) slot): such a model would build, then fail or normalise the wrong axis."""
    for name, shape in _slot_input_shapes(model, slots).items():
        slot = slots[name]
        if len(shape) < 2 or shape[slot.channel_dim] != slot.num_features:
            raise SlotLayoutError(
                f"norm_layer='patchnorm' does not fit {type(model).__name__}: its norm {name} takes tensors of shape "
                f"{shape}, whose dim {slot.channel_dim} is not its {slot.num_features} channels ({type(slot).__name__} "
                f"binds to convolutions over (N, C, H, W) maps). Use patchnorm in convolutional models (ResNet, "
                "ConvNeXt, ...); for token models (ViT) use a normaliser over the last dim, e.g. norm_layer='rmsnorm'.")


def _needs_layout_check(binding: SlotBinding, modules: Dict[str, nn.Module]) -> bool:
    """A slot bound only to convolutions sees their (N, C, H, W) output or input; any other might not."""
    neighbours = [binding.producer] if binding.producer else []
    neighbours += binding.consumers
    return not neighbours or not all(isinstance(modules[path], nn.Conv2d) for path in neighbours)


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition('.')
    setattr(model.get_submodule(parent_path), name, new)


def bind_patchnorm(model: nn.Module) -> List[SlotBinding]:
    """ Bind every `patchnorm` slot of `model` to its neighbours (in place) and return the bindings.

    A no-op for models without slots. Raises `RuntimeError` if the model cannot be traced, `SlotLayoutError` if a
    slot does not see its channels where it normalises them (e.g. ViT tokens, checked on fake tensors).
    """
    slots = {name: m for name, m in model.named_modules() if isinstance(m, PatchNormSlot)}
    if not slots:
        return []
    try:
        graph = _BindingTracer().trace(model)
    except Exception as e:
        raise RuntimeError(
            f"cannot bind the patchnorm slots of {type(model).__name__}: torch.fx could not trace it "
            f"({type(e).__name__}: {e}). Use a traceable model, or a norm layer other than 'patchnorm'."
        ) from e
    modules = dict(model.named_modules())
    calls: Dict[str, int] = {}
    for node in graph.nodes:
        if node.op == 'call_module':
            calls[node.target] = calls.get(node.target, 0) + 1

    bindings: Dict[str, SlotBinding] = {}
    for node in graph.nodes:
        if node.op != 'call_module' or node.target not in slots:
            continue
        if calls[node.target] != 1:
            bindings[node.target] = SlotBinding(node.target, note=f'called {calls[node.target]} times in forward')
            continue
        producer, producer_note = _find_producer(node, modules, calls)
        consumers, consumer_note = _find_consumers(node, modules, calls)
        note = '' if producer or consumers else f'{producer_note}; {consumer_note}'
        bindings[node.target] = SlotBinding(node.target, producer, consumers, note)
    if any(_needs_layout_check(b, modules) for b in bindings.values()):
        _check_slot_layouts(model, slots)

    def correct(path: str, scale: str, add_bias: bool = False) -> None:
        modules[path] = divergence_corrected(modules[path], scale=scale, add_bias=add_bias)
        _replace(model, path, modules[path])

    for name, slot in slots.items():
        binding = bindings.get(name, SlotBinding(name, note='not reached by forward'))
        if binding.producer is not None:
            correct(binding.producer, slot.scale, add_bias=True)
            modules[binding.producer].fuse_post_affine(slot)
        for path in binding.consumers:
            correct(path, slot.scale)
        slot.bind(binding, fused=binding.producer is not None)
        if not slot.bound:
            _logger.info(f'patchnorm slot {name} is standalone (RMS normaliser + affine): {binding.note}')

    all_affine = [slot for slot in slots.values() if slot.corrects_all_affine]
    if all_affine:
        for path in calls:
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

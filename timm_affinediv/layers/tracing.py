""" Tracing a model's data flow for the patchnorm binding, with every node's value at one input size

`trace_values(model, input_shape)` traces `model` with `torch.fx` and computes, as it goes, each node's output
for an input of that shape on fake tensors (shapes, dtypes, no arithmetic). The values answer the control flow
that plain symbolic tracing cannot answer: a shape compared, unpacked, used as a length or turned into an int
(`B, N, C = x.shape`, `if pad_r > 0`, `int(N ** .5)`). The graph is that of a forward at that input size, which is
all the binding needs: it reads the data flow, and never runs the graph.

The affine maps (`nn.Conv2d`/`nn.Linear`) and the patchnorm slots stay leaves, as do timm's registered no-trace
modules, except those holding affine maps (twins' `LocallyGroupedAttn`, ConViT's `GPSA`, ...): their forward is
traced through where its control flow depends on shapes only, so the binding sees the q/k/v maps inside them, and
kept as a leaf where it does not.
"""
import operator
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from timm.layers import get_notrace_functions, get_notrace_modules

from .._torch_compat import FakeTensorMode
from .affine_div import AffineDivLinear, PatchNormConv2d
from .norm import L2NormLinear
from .recurrent import AffineDivLSTM
from .slot import PatchNormSlot

__all__ = ['trace_values', 'TracedModel']

_AFFINE_TYPES = (nn.Conv2d, nn.Linear)
_OWN_LEAVES = (PatchNormSlot, AffineDivLinear, PatchNormConv2d, L2NormLinear, AffineDivLSTM)
_UNKNOWN = object()


class TracedModel:
    """The traced graph, each node's value (fake tensors; absent from the first that could not be computed on), and
    why that one failed ('' where none did)."""

    def __init__(self, graph: fx.Graph, values: Dict[fx.Node, Any], stopped: str):
        self.graph, self.values, self.stopped = graph, values, stopped


def _value(arg: Any) -> Any:
    """The value an argument of a traced call stands for: a proxy's recorded value, `_UNKNOWN` where it has none."""
    if isinstance(arg, fx.proxy.ParameterProxy):
        return arg.param
    if isinstance(arg, fx.proxy.Attribute):
        root = _value(arg.root)
        if root is _UNKNOWN:
            return _UNKNOWN
        try:
            return getattr(root, arg.attr)
        except Exception:
            return _UNKNOWN
    if isinstance(arg, fx.Proxy):
        return vars(arg).get('traced_value', _UNKNOWN)
    return arg


def _values(args: Any) -> Any:
    """`args` with each proxy replaced by its value; `_UNKNOWN` where any proxy has none."""
    unknown = []

    def unwrap(a: Any) -> Any:
        value = _value(a)
        if value is _UNKNOWN:
            unknown.append(a)
        return value

    values = fx.node.map_aggregate(args, unwrap)
    return _UNKNOWN if unknown else values


def _known_scalar(proxy: fx.Proxy) -> Any:
    value = _value(proxy)
    if value is _UNKNOWN or isinstance(value, torch.Tensor):
        raise fx.proxy.TraceError(f'{proxy} has no known value to use as a Python number')
    return value


class _ValueProxy(fx.Proxy):
    """A proxy whose recorded value answers `len`, `int`, indexing and (through the tracer) `bool` and iteration."""

    def __getattr__(self, k: str) -> '_ValueAttribute':
        return _ValueAttribute(self, k)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy('call_function', operator.setitem, (self, key, value), {})

    def __len__(self) -> int:
        value = _value(self)
        if value is _UNKNOWN:
            return super().__len__()
        return len(value)

    def __int__(self) -> int:
        return int(_known_scalar(self))

    def __index__(self) -> int:
        return int(_known_scalar(self))

    def __float__(self) -> float:
        return float(_known_scalar(self))


class _ValueAttribute(fx.proxy.Attribute, _ValueProxy):
    pass


class _ValueTracer(fx.Tracer):
    """ Records each node's value on fake tensors as it traces; see the module's docstring for the leaves."""

    def __init__(self, input_shape: Tuple[int, ...]):
        super().__init__(autowrap_functions=tuple(get_notrace_functions()))
        self._notrace_types = tuple(get_notrace_modules())
        self._opaque: set = set()  # no-trace modules whose forward could not be traced through
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with self.fake_mode:
            self.example = torch.empty(input_shape)
        self.values: Dict[fx.Node, Any] = {}
        self.stopped = ''
        self._computing = False  # while a value is computed, module calls and attributes are not traced

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, _AFFINE_TYPES + _OWN_LEAVES) or m in self._opaque:
            return True
        if isinstance(m, self._notrace_types):
            return not self._holds_affine(m)
        return super().is_leaf_module(m, module_qualified_name)

    @staticmethod
    def _holds_affine(m: nn.Module) -> bool:
        return any(isinstance(c, _AFFINE_TYPES) for c in m.modules())

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: Tuple[Any, ...],
                    kwargs: Dict[str, Any]) -> Any:
        if self._computing:
            return forward(*args, **kwargs)
        if not isinstance(m, self._notrace_types) or self.is_leaf_module(m, ''):
            return super().call_module(m, forward, args, kwargs)
        last, stack, state, stopped = self.graph._root.prev, dict(self.module_stack), module_state(m), self.stopped
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:  # control flow on values, or an op the trace cannot take: the module stays a leaf
            while self.graph._root.prev is not last:
                node = self.graph._root.prev
                self.values.pop(node, None)
                self.graph.erase_node(node)
            self.module_stack.clear()
            self.module_stack.update(stack)
            _restore_module_state(state)
            self.stopped = stopped
            self._opaque.add(m)
            return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: Dict[str, Any]) -> Any:
        return attr_val if self._computing else super().getattr(attr, attr_val, parameter_proxy_cache)

    def to_bool(self, obj: fx.Proxy) -> bool:
        value = _value(obj)
        if value is _UNKNOWN or isinstance(value, torch.Tensor):
            return super().to_bool(obj)
        return bool(value)

    def iter(self, obj: fx.Proxy) -> Iterator:
        value = _value(obj)
        if value is _UNKNOWN or isinstance(value, torch.Tensor):
            return super().iter(obj)
        return iter([obj[i] for i in range(len(value))])

    def create_proxy(self, kind: str, target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                     name: Optional[str] = None, type_expr: Optional[Any] = None,
                     proxy_factory_fn: Optional[Callable[[fx.Node], fx.Proxy]] = None) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        value = self._compute(kind, target, args, kwargs)
        if value is not _UNKNOWN:
            self.values[proxy.node] = value
            if not isinstance(proxy, fx.proxy.ParameterProxy):
                vars(proxy)['traced_value'] = value
        return proxy

    def _compute(self, kind: str, target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if self.stopped:  # values after a failed one might rest on a check it skipped: none are computed
            return _UNKNOWN
        self._computing = True
        try:
            return self._evaluate(kind, target, args, kwargs)
        except Exception as e:  # an op fake tensors do not support, or a failed check: later nodes have no value
            self.stopped = f'{type(e).__name__}: {str(e).strip()[:120]}'
            return _UNKNOWN
        finally:
            self._computing = False

    def _evaluate(self, kind: str, target: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        if kind == 'placeholder':
            return self.example if not self.values else _UNKNOWN
        if kind == 'get_attr':
            return operator.attrgetter(target)(self.root)
        arg_values, kwarg_values = _values(args), _values(kwargs)
        if arg_values is _UNKNOWN or kwarg_values is _UNKNOWN:
            return _UNKNOWN
        with self.fake_mode, torch.no_grad():
            if kind == 'call_function':
                return target(*arg_values, **kwarg_values)
            if kind == 'call_method':
                return getattr(arg_values[0], target)(*arg_values[1:], **kwarg_values)
            module = self.root.get_submodule(target)
            if isinstance(module, PatchNormSlot):  # its layout is what the binding finds out: pass through
                return arg_values[0]
            with eval_mode(module):
                return module(*arg_values, **kwarg_values)


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module` in eval mode for the duration (no running-statistics updates, dropout off), its modules' modes
    restored after."""
    modes = {m: m.training for m in module.modules()}
    try:
        yield module.eval()
    finally:
        for m, training in modes.items():
            m.training = training


def module_state(module: nn.Module) -> Dict[nn.Module, Tuple[dict, dict]]:
    """A copy of the attribute and buffer tables of `module` and its submodules."""
    return {m: (dict(vars(m)), dict(m._buffers)) for m in module.modules()}


def _restore_module_state(state: Dict[nn.Module, Tuple[dict, dict]]) -> None:
    for m, (attributes, buffers) in state.items():
        vars(m).clear()
        vars(m).update(attributes)
        m._buffers.clear()
        m._buffers.update(buffers)


def trace_values(model: nn.Module, input_shape: Tuple[int, ...],
                 concrete_args: Optional[Dict[str, Any]] = None) -> TracedModel:
    """ `model`'s traced graph and each node's value for a float32 input of `input_shape` (module docstring).

    Raises what `torch.fx` raises where the model cannot be traced at all.
    """
    tracer = _ValueTracer(input_shape)
    graph = tracer.trace(model, concrete_args=concrete_args)
    return TracedModel(graph, tracer.values, tracer.stopped)

""" Walking a traced model over the calibration batches one stretch of its graph at a time

Both models are traced (torch.fx) and walked over all calibration batches together, node by node in graph order,
pausing at each corrected layer to fit it on the values cached there. The values a later node still needs (a
residual block's input, read by its shortcut) stay cached (`ActivationCache`), within a byte budget, and spill to a
temporary folder beyond it. Each node thus runs once per batch, however often the walk pauses.
"""
import functools
import os
import tempfile
from typing import Any, Dict, Hashable, Iterable, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
from timm.layers import get_notrace_functions, get_notrace_modules

from ..errors import ConversionError
from ..layers.affine_div import AffineDivLinear, PatchNormConv2d
from ..layers.slot import PatchNormSlot
from .rebuild import architecture

__all__ = ['ActivationCache', 'trace', 'GraphWalk']


class ActivationCache:
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


def trace(model: nn.Module, leaves: Iterable[str] = ()) -> fx.GraphModule:
    try:
        return fx.GraphModule(model, _LeafTracer(leaves).trace(model))
    except Exception as e:  # torch.fx raises many kinds of errors on untraceable Python
        raise ConversionError(
            f'{architecture(model)} cannot be traced by torch.fx ({type(e).__name__}: {e}); calibration walks '
            'the traced graph. Convert without calibration data, or register the offending module with '
            'timm.layers.register_notrace_module.') from e


class GraphWalk:
    """ A traced model run over every calibration batch one stretch of its graph at a time.

    Each node runs once per batch; a value still needed by a later node is kept in the shared cache between
    stretches. So walking the whole graph costs one forward pass, however often it is paused (to fit a layer
    on the inputs reaching it). Residual connections need nothing special: the block input a shortcut reads
    later stays in the cache until its last user has run.
    """

    def __init__(self, traced: fx.GraphModule, batches: List[torch.Tensor], cache: ActivationCache):
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

    def replay(self, start: int, stop: int, batch: int, result: Optional[fx.Node] = None) -> Any:
        """ Run `nodes[start:stop]` again on `batch`, in whatever autograd mode is on, reading the values of earlier
        nodes from the cache; returns `result`'s value (None: the graph's output, which `stop` must then pass). The
        walk does not move and the cache is untouched: a stretch re-run to train its parameters on cached inputs."""
        local: Dict[fx.Node, Any] = {}

        def load(n: fx.Node) -> Any:
            return local[n] if n in local else self.value(n, batch)
        for n in self.nodes[start:stop]:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), load)
            if n.op == 'output':
                return args[0]
            local[n] = self._run(n, self.batches[batch], args, kwargs, batch)
        return local[result]

    def _run(self, n: fx.Node, x: torch.Tensor, args: Tuple, kwargs: Dict, batch: int) -> Any:
        if n.op == 'placeholder':  # the images; forward's other arguments (ViT's attn_mask) take their defaults
            return x if self.index[n] == 0 else (n.args[0] if n.args else None)
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

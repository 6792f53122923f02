""" Every private torch name timm-affinediv and its scripts use, in one place

torch keeps fake tensors, dispatch modes, its pytree helpers, the dispatcher's keys, a custom op's parts and a few
tensor methods private (a leading underscore): any release may move them. The package and `scripts/` reach them
only through this module, which lists them (`PRIVATE_IMPORTS`, `PRIVATE_ATTRIBUTES`). A torch that moved one of its
names fails on import (or, for inductor's, on first use) with one `TorchVersionError` line naming it;
tests/test_torch_compat.py resolves every listed name on the installed torch.
"""
import contextlib
import importlib
from typing import Any, Callable, Iterator, List, Sequence

import torch

from .errors import TorchVersionError

__all__ = [
    'PRIVATE_IMPORTS', 'PRIVATE_ATTRIBUTES', 'private_name', 'FakeTensor', 'FakeTensorMode', 'TorchDispatchMode',
    'tree_flatten', 'lookup_device_info', 'ops_with_kernel', 'has_kernel', 'dispatch_key_excluded', 'is_view',
    'tensor_version', 'destroy_library', 'op_schema', 'custom_op_overload', 'custom_op_body', 'fakes_run_bodies']

#: torch's private modules' names this module takes, by module
PRIVATE_IMPORTS = {
    'torch._subclasses.fake_tensor': ('FakeTensor', 'FakeTensorMode'),
    'torch.utils._python_dispatch': ('TorchDispatchMode',),
    'torch.utils._pytree': ('tree_flatten',),
    'torch._inductor.analysis.device_info': ('lookup_device_info',),
    'torch._C': ('_dispatch_get_all_op_names', '_dispatch_has_kernel_for_dispatch_key', '_ExcludeDispatchKeyGuard',
                 'DispatchKeySet', 'DispatchKey'),
}

#: private attributes of torch's objects this module reads, by the class whose instances have them
PRIVATE_ATTRIBUTES = {
    'torch.Tensor': ('_is_view', '_version'),
    'torch.library.Library': ('_destroy',),
    'torch._ops.OpOverload': ('_schema',),
    'torch._library.custom_ops.CustomOpDef': ('_init_fn', '_abstract_fn', '_opoverload'),
}


def private_name(module: str, name: str) -> Any:
    """`module.name` of torch's, one of `PRIVATE_IMPORTS`; a `TorchVersionError` where this torch moved it."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise TorchVersionError(f'torch {torch.__version__} has no {module}.{name}, which timm_affinediv reaches: '
                                'install the torch it is tested with, or update timm_affinediv/_torch_compat.py '
                                'to where this torch keeps it') from error


FakeTensorMode: type = private_name('torch._subclasses.fake_tensor', 'FakeTensorMode')
FakeTensor: type = private_name('torch._subclasses.fake_tensor', 'FakeTensor')
TorchDispatchMode: type = private_name('torch.utils._python_dispatch', 'TorchDispatchMode')
tree_flatten: Callable = private_name('torch.utils._pytree', 'tree_flatten')
_all_op_names: Callable = private_name('torch._C', '_dispatch_get_all_op_names')
_has_kernel: Callable = private_name('torch._C', '_dispatch_has_kernel_for_dispatch_key')
_ExcludeDispatchKeyGuard: type = private_name('torch._C', '_ExcludeDispatchKeyGuard')
_DispatchKeySet: type = private_name('torch._C', 'DispatchKeySet')
_DispatchKey: type = private_name('torch._C', 'DispatchKey')


def lookup_device_info(name: str) -> Any:
    """torch's datasheet row of a GPU (inductor's `device_info`), imported on use: inductor is slow to import and
    only the GPU time model reads it."""
    return private_name('torch._inductor.analysis.device_info', 'lookup_device_info')(name)


def ops_with_kernel(key: str) -> List[str]:
    """The dispatcher's operator names (`aten::add.Tensor`) that have a kernel for the dispatch key `key`."""
    return [name for name in _all_op_names() if _has_kernel(name, key)]


def has_kernel(op_name: str, key: str) -> bool:
    """Whether the operator `op_name` (`aten::add.Tensor`) has a kernel for the dispatch key `key` in this build."""
    return _has_kernel(op_name, key)


def dispatch_key_excluded(key: str) -> contextlib.AbstractContextManager:
    """A guard under which the dispatcher skips the key `key` (`AutocastCPU`): how a kernel registered for that key
    calls the operator it implements."""
    return _ExcludeDispatchKeyGuard(_DispatchKeySet(getattr(_DispatchKey, key)))


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` shares another tensor's storage as a view of it."""
    return t._is_view()


def tensor_version(t: torch.Tensor) -> int:
    """`t`'s version counter: it changes with every in-place write to `t` or a view of it."""
    return t._version


def destroy_library(library: torch.library.Library) -> None:
    """Remove the kernels a `torch.library.Library` registered (torch has no public way before the process ends)."""
    library._destroy()


def op_schema(op: Any) -> torch.FunctionSchema:
    """An operator overload's schema: its name, its arguments and which of them it writes."""
    return op._schema


def custom_op_overload(op: Any) -> Any:
    """The operator overload (`torch.ops.NAMESPACE.NAME.default`) of a `torch.library.custom_op`."""
    return op._opoverload


def custom_op_body(op: Any) -> Callable:
    """The Python function a `torch.library.custom_op` decorated: what it runs on real tensors."""
    return op._init_fn


@contextlib.contextmanager
def fakes_run_bodies(ops: Sequence[Any]) -> Iterator[None]:
    """Under `FakeTensorMode` the custom ops `ops` run their bodies instead of their fake (shape) functions, so what
    the bodies do on fake tensors is seen."""
    fakes = [op._abstract_fn for op in ops]
    for op in ops:
        op._abstract_fn = custom_op_body(op)
    try:
        yield
    finally:
        for op, fake in zip(ops, fakes):
            op._abstract_fn = fake

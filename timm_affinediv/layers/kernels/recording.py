""" The Triton path traced on the CPU, its launches recorded instead of run: what a step launches, without a GPU

Inside `recorded_launches(record)` the layers take the Triton path on every device (the custom ops, as on a GPU);
each of `_triton`'s launchers runs its own Python, which hands every launch to `record(kernel, args, constexprs)`
instead of a GPU, and the values come from its torch twin (`_torch`), run inside `twins()` (where a caller keeps
those operations out of what it counts). Under `FakeTensorMode` a step at its real sizes costs what its Python
costs. scripts/launch_count.py counts the launches, kernel_registers.py compiles their specialisations and
gpu_model.py prices them.
"""
import contextlib
from typing import Any, Callable, ContextManager, Iterator, List

from . import _torch, ops
from .dispatch import kernels_mode, launchers_replaced, set_kernels

__all__ = ['TwinLaunchers', 'custom_ops', 'recorded_launches']


class TwinLaunchers:
    """ `_triton`'s launchers, recording their launches, with their torch twins' values (computed inside
    `twins()`). Pass it where launchers are taken (`selfcheck.run_cases`)."""

    def __init__(self, twins: Callable[[], ContextManager]):
        self._twins = twins

    def __getattr__(self, launcher: str) -> Callable:
        from . import _triton

        def run(*args, **kwargs):
            getattr(_triton, launcher)(*args, **kwargs)
            with self._twins():
                return getattr(_torch, launcher)(*args, **kwargs)
        return run


def custom_ops() -> List[Any]:
    """The fused path's custom ops, forward and backward (`torch.library.custom_op` objects)."""
    return [getattr(ops, name) for name in ops.__all__] + [getattr(ops, f'{name}_backward') for name in ops.__all__]


@contextlib.contextmanager
def recorded_launches(record: Callable[[Any, tuple, dict], None],
                      twins: Callable[[], ContextManager] = contextlib.nullcontext) -> Iterator[TwinLaunchers]:
    """The Triton path on every device, launches recorded (see the module's docstring); yields the launchers."""
    from . import _triton  # defines the kernels on first use, after TRITON_INTERPRET is set
    launchers, mode = TwinLaunchers(twins), kernels_mode()
    set_kernels('triton')
    try:
        with launchers_replaced(launchers), _triton.launches_recorded(record):
            yield launchers
    finally:
        set_kernels(mode)

""" Which code path the divergence-corrected layers take: fused Triton kernels or torch's operations

Read in one place, like timm's `set_fast_norm`/`is_fast_norm`: the environment variable
`TIMM_AFFINEDIV_KERNELS` (`auto`, `triton` or `torch`) at import, `set_kernels()` after.

- `auto` (default): Triton kernels for CUDA tensors where Triton imports, torch's operations elsewhere;
- `triton`: Triton kernels for CUDA tensors, and for CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`,
  how the kernels are tested without a GPU); other tensors keep torch's operations;
- `torch`: torch's operations everywhere.

Float64 tensors and the export paths (`portable_ops()`: TorchScript, torch.export, ONNX) always take torch's
operations.

A kernel that fails to build or launch (a GPU, driver or Triton the kernels were not tested on), or returns values
that differ from its torch twin's in the self-check it runs before its first use on a device, dtype and layout
(`selfcheck`), raises under `triton`; under `auto` it warns once and the process continues on torch's operations
(`kernel_failed`): the custom ops, the failed one included, compute on torch twins of the kernels (`_torch`), so
training goes on with the same numbers and every layer keeps the path it took (a fused slot's activation is applied
once).
"""
import contextlib
import importlib.util
import os
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from ...errors import KernelError, OptionError

__all__ = ['KERNEL_MODES', 'set_kernels', 'kernels_mode', 'triton_available', 'use_triton', 'kernel_path',
           'launchers_replaced', 'stand_in_launchers', 'kernel_failed', 'fell_back']

KERNEL_MODES = ('auto', 'triton', 'torch')
_ENV = 'TIMM_AFFINEDIV_KERNELS'
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _checked(mode: str, source: str) -> str:
    if mode not in KERNEL_MODES:
        raise OptionError(f"{source} must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    return mode


_MODE = _checked(os.environ.get(_ENV, 'auto').strip().lower() or 'auto', _ENV)


def set_kernels(mode: str = 'auto') -> None:
    """Choose the code path: 'auto', 'triton' (raises if Triton is not installed) or 'torch'."""
    global _MODE
    if _checked(mode, 'set_kernels(mode)') == 'triton' and not triton_available():
        raise KernelError("set_kernels('triton'): Triton is not installed; install torch's CUDA build (it ships "
                          "Triton) or `pip install triton`, or use 'auto'/'torch'")
    _MODE = mode
    _fall_back(None)
    for key in [key for key, failure in SELF_CHECKS.items() if failure is not None]:
        del SELF_CHECKS[key]  # a failed self-check runs again; passed ones hold


def kernels_mode() -> str:
    """The mode set by `TIMM_AFFINEDIV_KERNELS` or `set_kernels`."""
    return _MODE


_TRITON = importlib.util.find_spec('triton') is not None


def triton_available() -> bool:
    return _TRITON


def _interpreting() -> bool:
    return os.environ.get('TRITON_INTERPRET', '0') == '1'


def kernel_path(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """'triton' or 'torch': the path the layers take for tensors of `device` and `dtype` (outside export)."""
    if _MODE == 'torch' or dtype not in _KERNEL_DTYPES or not triton_available():
        return 'torch'
    return 'triton' if _runs_kernels(torch.device(device)) else 'torch'


def _runs_kernels(device: torch.device) -> bool:
    """CUDA devices, the CPU under Triton's interpreter where the kernels are asked for (`triton`), and every device
    while stand-in launchers are set."""
    return (_STAND_IN is not None or device.type == 'cuda'
            or (_MODE == 'triton' and device.type == 'cpu' and _interpreting()))


_STAND_IN = None  # the launchers `launchers_replaced` set


@contextlib.contextmanager
def launchers_replaced(launchers: Any) -> Iterator[None]:
    """ For the context's time every device takes the Triton path, and the ops call `launchers` (an object with
    `_triton`'s launcher functions) instead of the self-checked kernels: how `recording` traces a GPU step's
    launches on a CPU. """
    global _STAND_IN
    saved, _STAND_IN = _STAND_IN, launchers
    try:
        yield
    finally:
        _STAND_IN = saved


def stand_in_launchers() -> Optional[Any]:
    """The launchers `launchers_replaced` set, or None."""
    return _STAND_IN


def use_triton(x: torch.Tensor) -> bool:
    """Whether the layers compute on `x` with the Triton kernels (the caller has ruled out the export paths)."""
    return kernel_path(x.device, x.dtype) == 'triton'


_FAILURE = None  # the KernelError that sent `auto` to torch's operations for this process

#: the kernels' self-checks in this process (`selfcheck.verify`): (device, dtype, layout) -> None where they passed,
#: else the KernelError that says how they failed
SELF_CHECKS: Dict[Tuple[str, torch.dtype, str], Optional[KernelError]] = {}


def _fall_back(failure) -> None:
    global _FAILURE
    _FAILURE = failure


def fell_back() -> bool:
    """Whether a kernel failed under `auto` and this process computes on torch's operations."""
    return _FAILURE is not None and _MODE == 'auto'


def kernel_failed(layer: str, failure: KernelError) -> None:
    """ A kernel failed in `layer`: raise under `triton`; under `auto` warn (once) and take torch's operations from
    here on, for the caller's operation too."""
    if _MODE != 'auto':
        raise KernelError(f'{layer}: {failure}; TIMM_AFFINEDIV_KERNELS=torch (or auto, which then falls back to '
                          f'them) takes torch\'s operations') from failure
    if _FAILURE is None:
        warnings.warn(f'{layer}: {failure}; this process continues on torch\'s operations (the same results, '
                      f'slower): set TIMM_AFFINEDIV_KERNELS=torch to take them from the start', RuntimeWarning,
                      stacklevel=3)
    _fall_back(failure)

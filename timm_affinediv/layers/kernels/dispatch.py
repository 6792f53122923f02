""" Which code path the divergence-corrected layers take: fused Triton kernels or torch's operations

Read in one place, like timm's `set_fast_norm`/`is_fast_norm`: the environment variable
`TIMM_AFFINEDIV_KERNELS` (`auto`, `triton` or `torch`) at import, `set_kernels()` after.

- `auto` (default): Triton kernels for CUDA tensors where Triton imports, torch's operations elsewhere;
- `triton`: Triton kernels for CUDA tensors, and for CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`,
  how the kernels are tested without a GPU); other tensors keep torch's operations;
- `torch`: torch's operations everywhere.

Float64 tensors and the export paths (`portable_ops()`: TorchScript, torch.export, ONNX) always take torch's
operations.
"""
import importlib.util
import os

import torch

__all__ = ['KERNEL_MODES', 'set_kernels', 'kernels_mode', 'triton_available', 'use_triton', 'kernel_path']

KERNEL_MODES = ('auto', 'triton', 'torch')
_ENV = 'TIMM_AFFINEDIV_KERNELS'
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _checked(mode: str, source: str) -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(f"{source} must be one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    return mode


_MODE = _checked(os.environ.get(_ENV, 'auto').strip().lower() or 'auto', _ENV)


def set_kernels(mode: str = 'auto') -> None:
    """Choose the code path: 'auto', 'triton' (raises if Triton is not installed) or 'torch'."""
    global _MODE
    if _checked(mode, 'set_kernels(mode)') == 'triton' and not triton_available():
        raise RuntimeError("set_kernels('triton'): Triton is not installed; install torch's CUDA build (it ships "
                           "Triton) or `pip install triton`, or use 'auto'/'torch'")
    _MODE = mode


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
    device = torch.device(device)
    if device.type == 'cuda' or (_MODE == 'triton' and device.type == 'cpu' and _interpreting()):
        return 'triton'
    return 'torch'


def use_triton(x: torch.Tensor) -> bool:
    """Whether the layers compute on `x` with the Triton kernels (the caller has ruled out the export paths)."""
    return kernel_path(x.device, x.dtype) == 'triton'

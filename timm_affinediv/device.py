""" The device a command or a conversion runs on """
from typing import Optional

import torch

from .errors import DeviceError

__all__ = ['resolve_device']


def resolve_device(device: Optional[str] = None) -> torch.device:
    """`device`, or 'auto'/None: CUDA when available, else the CPU."""
    if device in (None, 'auto'):
        return torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise DeviceError(f"unknown device {device!r}: use 'cpu', 'cuda', 'cuda:N' or 'auto'") from e
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise DeviceError("device 'cuda' asked for, but torch sees no CUDA device: use --device cpu (or auto)")
    return device

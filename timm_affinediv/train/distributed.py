""" Distributed set-up: the device, rank and world size of this process, joining the process group under torchrun """
import os
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from timm.utils.distributed import init_distributed_device_so

__all__ = ['init_distributed']


def init_distributed(device: Optional[str] = None) -> Tuple[torch.device, int, int, bool]:
    """Device, rank, world size and whether there are several processes; joins the process group under torchrun
    (once per process). `device`: 'cpu' or 'cuda' (default: cuda if available)."""
    device = device or ('cuda' if torch.cuda.is_available() else 'cpu')
    if dist.is_available() and dist.is_initialized():  # a second Trainer in the same process
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get('LOCAL_RANK', 0))
        info = dict(device=f'cuda:{local_rank}' if device == 'cuda' else device, global_rank=rank,
                    world_size=world_size, distributed=world_size > 1)
    else:
        info = init_distributed_device_so(device=device)
    return torch.device(info['device']), info['global_rank'], info['world_size'], info['distributed']

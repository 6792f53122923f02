""" Knowledge distillation: the blended loss and the teacher """
import logging
from typing import Any, Optional, Union

import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import load_weights, read_weights

__all__ = ['DistillationLoss', 'create_teacher']

_logger = logging.getLogger(__name__)


class DistillationLoss(nn.Module):
    """Hard-label loss blended with knowledge distillation from a teacher's logits.

    loss = (1 - weight) * base_loss(student, target) + weight * T^2 * KL(softmax(teacher / T) || softmax(student / T))
    (Hinton et al. 2015; the T^2 factor keeps the soft gradients' scale independent of the temperature T).
    """

    def __init__(self, base_loss: nn.Module, weight: float = 0.5, temperature: float = 4.0):
        super().__init__()
        self.base_loss = base_loss
        self.weight = weight
        self.temperature = temperature

    def forward(self, logits: torch.Tensor, teacher_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        hard = self.base_loss(logits, target)
        t = self.temperature
        soft = F.kl_div(
            F.log_softmax(logits.float() / t, dim=-1), F.log_softmax(teacher_logits.float() / t, dim=-1),
            reduction='batchmean', log_target=True) * (t * t)
        return (1. - self.weight) * hard + self.weight * soft


def create_teacher(
        teacher: Union[str, nn.Module],
        checkpoint: Optional[str] = None,
        **kwargs: Any,
) -> nn.Module:
    """A teacher in eval mode (run under `torch.no_grad`): a ready module, or a timm model name (+ `kwargs`)
    with its checkpoint."""
    if isinstance(teacher, str):
        model = timm.create_model(teacher, **kwargs)
        if checkpoint:
            load_weights(model, read_weights(checkpoint, 'teacher checkpoint'), checkpoint, 'teacher checkpoint')
        else:
            _logger.warning(f"teacher '{teacher}' has no checkpoint: distilling from random weights.")
        teacher = model
    return teacher.eval()

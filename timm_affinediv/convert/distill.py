""" Logit distillation after the fit: the whole converted model trained towards the original's outputs

The least-squares fit is the best each layer can do alone, on its own target. Where the layers' function differs from
the normalised map they replace more than a refit can make up for (a depthwise PatchNorm divides each window of one
channel by its own norm; a norm after a ReLU sees patches of very different norms), the errors compound with depth,
and the model's predictions drift. Distillation then trains every parameter of the converted model at once so that
its class distribution matches the original's on the calibration images, no labels:

    L = KL(softmax(z_original) || softmax(z_converted)),   averaged over a batch,

Adam, its learning rate rising linearly over the first fifth of the steps and then decaying to 0 by a cosine (the
first steps of Adam move every parameter by about the learning rate, which a bias divided by a small patch norm
amplifies), one batch a step, the batches in a new random order each epoch. The original's logits are those the
fit's calibration walk already computed: no pass of the original. Each epoch costs a forward and a backward pass of
the converted model over the calibration batches, about three to four forward passes of the original, and one
forward pass after the last measures the result. The converted model stays in eval mode (no dropout or drop-path;
PatchNorm keeps no batch statistics). Where the result is further from the original than the fit was (too few
calibration images for the steps to recover from the first ones), the fit is kept.
"""
import math
from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .reconstruct import restore_parameters

__all__ = ['DistillationOptions', 'DistillationFit', 'distill_logits', 'logit_kl']


@dataclass
class DistillationOptions:
    """ How long and how fast the converted model is distilled (module docstring).

    Args:
        epochs: passes over the calibration batches (0: none).
        lr: Adam's peak learning rate.
        warmup: the fraction of the steps over which the learning rate rises to `lr`; a cosine then takes it to 0.
        seed: seed of the batch order.
    """
    epochs: int = 6
    lr: float = 1e-4
    warmup: float = 0.2
    seed: int = 0

    def schedule(self, steps: int) -> Callable[[int], float]:
        """The learning rate's factor at each step (`torch.optim.lr_scheduler.LambdaLR`)."""
        rise = max(1, round(self.warmup * steps))
        return lambda step: (step + 1) / rise if step < rise else 0.5 * (1 + math.cos(math.pi * (step - rise) /
                                                                                        max(1, steps - rise)))


@dataclass
class DistillationFit:
    """How far the converted model's class distribution was from the original's before and after (mean KL over the
    calibration images), and the epochs and Adam steps it took."""
    epochs: int
    steps: int
    kl_before: float
    kl_after: float


def logit_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """`KL(softmax(target) || softmax(logits))`, averaged over the batch (float32 or wider)."""
    log_p = F.log_softmax(target_logits.float(), -1)
    return F.kl_div(F.log_softmax(logits.float(), -1), log_p, log_target=True, reduction='batchmean')


def _mean_kl(outputs: List[torch.Tensor], targets: List[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(logit_kl(z, t).item() * len(z) for z, t in zip(outputs, targets)) / sum(map(len, outputs))


def distill_logits(converted: nn.Module, batches: List[torch.Tensor], targets: List[torch.Tensor],
                   outputs: List[torch.Tensor], options: DistillationOptions
                   ) -> Tuple[DistillationFit, List[torch.Tensor]]:
    """ Train every parameter of `converted` (in eval mode, in place) towards the original's logits `targets` on
    `batches`, from its logits `outputs` there after the fit (module docstring). Returns what it did and the model's
    logits on the batches after it; where distillation left the mean KL higher than the fit did, the fit's
    parameters are restored (and `outputs` returned)."""
    params = [p for p in converted.parameters() if p.requires_grad]
    before = _mean_kl(outputs, targets)
    steps = options.epochs * len(batches)
    if not steps or not params:
        return DistillationFit(0, 0, before, before), outputs
    fitted = [p.detach().clone() for p in params]
    generator = torch.Generator().manual_seed(options.seed)
    optimizer = torch.optim.Adam(params, lr=options.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, options.schedule(steps))
    with torch.enable_grad():
        for _ in range(options.epochs):
            for i in torch.randperm(len(batches), generator=generator).tolist():
                loss = logit_kl(converted(batches[i]), targets[i])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                schedule.step()
    with torch.no_grad():
        distilled = [converted(x) for x in batches]
    after = _mean_kl(distilled, targets)
    if after >= before:
        restore_parameters(params, fitted)
        return DistillationFit(options.epochs, steps, before, before), outputs
    return DistillationFit(options.epochs, steps, before, after), distilled

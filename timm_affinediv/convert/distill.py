""" Logit distillation after the fit: the whole converted model trained towards the original's outputs

The least-squares fit is the best each layer can do alone. Where a layer's function differs from the normalised map
it replaces more than a refit can make up for (a depthwise PatchNorm divides each window of one channel by its own
norm; a norm after a ReLU sees patches of very different norms), the errors compound with depth. Distillation then
trains every parameter of the converted model at once, without labels, on

    L = KL(softmax(z_original) || softmax(z_converted))  +  w mean_l |a_l - t_l|^2 / |t_l|^2,   over a batch,

`a_l` the output of corrected layer `l`, `t_l` the original's value where the fit aimed it (a norm's output before
its activation, or the layer's own output), `w` = `DistillOptions.features`: the fit's targets, trained together.

The images stream from the caller's data (with train-time augmentation where they come from a dataset), the
original's logits computed on each batch as it comes: nothing is held but the batch. Each pass runs Adam with a
linear warm-up over its first fifth and a cosine to 0 (Adam's first steps move every parameter by about the rate,
which a bias divided by a small patch norm amplifies), so every pass ends as a finished model. Both models stay in
eval mode (no dropout or drop-path; PatchNorm keeps no batch statistics).

After each pass, the top-1 agreement with the original and the mean KL are measured on the check images (held-out
ones, neither fitted nor distilled on, where the caller gives them). The pass of lowest KL is kept, and the fit
where no pass beat it; with held-out images the distillation stops after `patience` passes in a row that do not
lower it. The KL judges because it is the objective, and it moves smoothly where the agreement on a thousand images
moves by a few of them. A pass costs a forward pass of the original and a forward and backward pass of the converted
model over the distillation images, and a forward pass of the converted model over the check images.
"""
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..errors import ConversionError
from .options import DistillOptions
from .reconstruct import restore_parameters

__all__ = ['DistillationFit', 'Agreement', 'distill_logits', 'logit_kl', 'batch_images', 'compare_logits',
           'measure_agreement', 'distillation_batches']


@dataclass
class Agreement:
    """The converted model's top-1 agreement with the original and the mean KL between their class distributions
    (`logit_kl`) over some images."""
    top1: float
    kl: float


@dataclass
class DistillationFit:
    """What the distillation did: the images a pass read, the passes run (and the one kept: 0 is the fit), the Adam
    steps, and the agreement with the original on the check images after each pass (`passes`)."""
    images: int
    epochs: int
    kept_epoch: int
    steps: int
    stopped_early: bool
    passes: List[Agreement] = field(default_factory=list)


def schedule(options: DistillOptions, steps: int) -> Callable[[int], float]:
    """The learning rate's factor at each step (`torch.optim.lr_scheduler.LambdaLR`), in cycles of `steps` (a pass):
    linear warm-up over `options.warmup` of a cycle's steps, then a cosine to 0."""
    rise = max(1, round(options.warmup * steps))

    def factor(step: int) -> float:
        step %= steps
        if step < rise:
            return (step + 1) / rise
        return 0.5 * (1 + math.cos(math.pi * (step - rise) / max(1, steps - rise)))
    return factor


def logit_kl(logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """`KL(softmax(target) || softmax(logits))`, averaged over the batch (float32 or wider)."""
    log_p = F.log_softmax(target_logits.float(), -1)
    return F.kl_div(F.log_softmax(logits.float(), -1), log_p, log_target=True, reduction='batchmean')


def batch_images(batch) -> torch.Tensor:
    """The images of a batch given as images or as an (images, labels) pair."""
    return batch[0] if isinstance(batch, (tuple, list)) else batch


def compare_logits(logits: Iterable[torch.Tensor], targets: List[torch.Tensor]) -> Agreement:
    """The top-1 agreement of the batches of `logits` with those of `targets`, and their mean KL."""
    same, kl, count = 0, 0., 0
    with torch.no_grad():
        for z, t in zip(logits, targets):
            same += (z.argmax(-1) == t.argmax(-1)).sum().item()
            kl += logit_kl(z, t).item() * len(z)
            count += len(z)
    return Agreement(same / count, kl / count)


def measure_agreement(converted: nn.Module, batches: List[torch.Tensor], targets: List[torch.Tensor]) -> Agreement:
    """`converted`'s top-1 agreement with the logits `targets` on `batches`, and their mean KL."""
    with torch.no_grad():
        return compare_logits((converted(x) for x in batches), targets)


class _Shuffled:
    """A list of batches, read in a new random order each pass."""

    def __init__(self, batches: list, seed: int):
        self.batches = batches
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return (self.batches[i] for i in torch.randperm(len(self.batches), generator=self.generator).tolist())


def distillation_batches(data, batch_size: int, seed: int) -> Iterable:
    """ The distillation images as a re-iterable source of batches: a map-style `Dataset` (of images or (image,
    label) pairs) read by a shuffling `DataLoader` of `batch_size`, a list of batches in a new order each pass, any
    other iterable of batches (a `DataLoader`) as it comes. It must have a length (the learning rate's schedule is
    laid out over the steps)."""
    if isinstance(data, Dataset) and not isinstance(data, torch.utils.data.IterableDataset):
        data = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=False,
                          generator=torch.Generator().manual_seed(seed))
    elif isinstance(data, (list, tuple)):
        data = _Shuffled(list(data), seed)
    try:
        len(data)
    except TypeError:
        raise ConversionError(
            f'distillation images must have a length, for the learning rate\'s schedule: give a Dataset, a list or a '
            f'DataLoader of batches, not a {type(data).__name__}') from None
    if iter(data) is data:
        raise ConversionError(f'distillation images are read once a pass: give a Dataset, a list or a DataLoader of '
                              f'batches, not a one-shot {type(data).__name__}')
    return data


class _MatchedOutputs:
    """ Forward hooks recording, for each `(layer, target)` pair, the converted model's layer output and the
    original's value at the module the layer was fitted to; `loss()` is their mean relative squared error."""

    def __init__(self, converted: nn.Module, original: nn.Module, targets: Sequence[Tuple[str, str]]):
        self.count = len(targets)
        self.values: Dict[Tuple[str, int], torch.Tensor] = {}
        self.handles = []
        for i, (layer, target) in enumerate(targets):
            self.handles += [converted.get_submodule(layer).register_forward_hook(self._record('converted', i)),
                             original.get_submodule(target).register_forward_hook(self._record('original', i))]

    def _record(self, model: str, i: int) -> Callable:
        def hook(module, args, output):
            self.values[model, i] = output
        return hook

    def loss(self) -> torch.Tensor:
        """`mean_l |a_l - t_l|^2 / |t_l|^2` over the pairs both forward passes reached with the same shape."""
        terms = []
        for i in range(self.count):
            a, t = self.values.get(('converted', i)), self.values.get(('original', i))
            if isinstance(a, torch.Tensor) and isinstance(t, torch.Tensor) and a.shape == t.shape:
                t = t.float()
                terms.append((a.float() - t).square().sum() / t.square().sum().clamp_min(1e-12))
        self.values.clear()
        return torch.stack(terms).mean() if terms else torch.zeros(())

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def distill_logits(converted: nn.Module, original: nn.Module, data: Iterable, check: List[torch.Tensor],
                   check_targets: List[torch.Tensor], fitted: Agreement, options: DistillOptions, *,
                   early_stop: bool, device: torch.device, targets: Sequence[Tuple[str, str]] = ()
                   ) -> Tuple[DistillationFit, Agreement]:
    """ Train every parameter of `converted` (in eval mode, in place) towards `original`'s logits, and each layer of
    `targets` (`(layer of converted, module of original)` pairs: the fit's) towards the original's values there, on
    the batches of `data` (`distillation_batches`), measuring the agreement on `check` (whose original logits are
    `check_targets`) after each pass (module docstring); `fitted` is the agreement there before. Returns what it did
    and the agreement of the model it leaves (the best pass's, or the fit's)."""
    params = [p for p in converted.parameters() if p.requires_grad]
    steps = options.epochs * len(data)
    result = DistillationFit(images=0, epochs=0, kept_epoch=0, steps=0, stopped_early=False)
    if not steps or not params:
        return result, fitted
    best, best_params = fitted, [p.detach().clone() for p in params]
    optimizer = torch.optim.Adam(params, lr=options.lr)
    lr_schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(options, len(data)))
    for epoch in range(1, options.epochs + 1):
        images = 0
        matched = _MatchedOutputs(converted, original, targets) if options.features and targets else None
        try:
            for batch in data:
                x = batch_images(batch).to(device)
                with torch.no_grad():
                    target = original(x)
                with torch.enable_grad():
                    loss = logit_kl(converted(x), target)
                    if matched is not None:
                        loss = loss + options.features * matched.loss()
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                optimizer.step()
                lr_schedule.step()
                images += len(x)
                result.steps += 1
        finally:
            if matched is not None:
                matched.close()
        result.images, result.epochs = images, epoch
        now = measure_agreement(converted, check, check_targets)
        result.passes.append(now)
        if now.kl < best.kl:
            best, result.kept_epoch = now, epoch
            best_params = [p.detach().clone() for p in params]
        elif early_stop and options.patience is not None and epoch - result.kept_epoch >= options.patience \
                and epoch < options.epochs:
            result.stopped_early = True
            break
    if result.kept_epoch != result.epochs:
        restore_parameters(params, best_params)
    return result, best

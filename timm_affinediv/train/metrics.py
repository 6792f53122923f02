""" Metrics of a run: evaluation (loss, top-1, top-5, images/s) and the per-epoch logs (CSV, JSON, PNG) """
import csv
import io
import json
import math
import os
import time
from contextlib import nullcontext
from typing import Callable, ContextManager, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from timm.utils import accuracy
from tqdm import tqdm

from ..files import atomic_write
from .config import ConfigError

__all__ = ['evaluate', 'final_top1', 'plot_history', 'write_metrics']


def final_top1(metrics: Dict[str, float], k: int = 1) -> float:
    """Top-k (%) of a run's metrics (`TrainResult.metrics`, or one entry of its history): of the EMA weights where
    there are some, as those are the final weights."""
    return metrics.get(f'ema_val_top{k}', metrics[f'val_top{k}'])


def plot_history(history: Sequence[Dict[str, float]], path: str) -> None:
    """Plot the learning curves (loss, top-1 / top-5, learning rate per epoch) to a PNG file, atomically."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    epochs = [h['epoch'] for h in history]
    fig = Figure(figsize=(12, 3.6), layout='constrained')
    ax_loss, ax_acc, ax_lr = fig.subplots(1, 3)
    for key, label in (('train_loss', 'train'), ('val_loss', 'val'), ('ema_val_loss', 'val (EMA)')):
        if key in history[0]:
            ax_loss.plot(epochs, [h[key] for h in history], marker='o', label=label)
    for key, label in (('val_top1', 'top-1'), ('val_top5', 'top-5'), ('ema_val_top1', 'top-1 (EMA)')):
        if key in history[0]:
            ax_acc.plot(epochs, [h[key] for h in history], marker='o', label=label)
    ax_lr.plot(epochs, [h['lr'] for h in history], marker='o')
    for ax, title in ((ax_loss, 'loss'), (ax_acc, 'accuracy (%)'), (ax_lr, 'learning rate (end of epoch)')):
        ax.set_title(title)
        ax.set_xlabel('epoch')
        ax.grid(alpha=0.3)
    ax_loss.legend()
    ax_acc.legend()
    buffer = io.BytesIO()
    fig.savefig(buffer, format='png', dpi=100)
    atomic_write(path, buffer.getvalue())


@torch.no_grad()
def evaluate(
        model: nn.Module,
        loader: Iterable[Tuple[torch.Tensor, torch.Tensor]],
        device: Optional[torch.device] = None,
        autocast: Callable[[], ContextManager] = nullcontext,
        distributed: bool = False,
        progress: bool = False,
        memory_format: torch.memory_format = torch.contiguous_format,
) -> Dict[str, float]:
    """ Cross-entropy loss, top-1 and top-5 accuracy (%) and images/s of `model` on `loader`, in eval mode, with the
    standard error of each mean over the images (`loss_se`: the per-image losses' standard deviation over sqrt(n);
    `top1_se`, `top5_se`: the binomial sqrt(p (1 - p) / n), in points): the noise of the figure as an estimate of the
    model's on more images like these.

    `device`: where the batches go (default: the model's). `distributed`: sum over all ranks (every rank must call
    it). `memory_format`: that of the batches (`torch.channels_last` for a channels-last model). The model's
    train/eval mode is restored afterwards.
    """
    device = device if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # loss, correct@1, correct@5, samples, squared loss
    start = time.perf_counter()
    for x, target in tqdm(loader, desc='eval', unit='batch', leave=False, dynamic_ncols=True, disable=not progress):
        x = x.to(device, non_blocking=True, memory_format=memory_format)
        target = target.to(device, non_blocking=True)
        with autocast():
            output = model(x)
        output = output.float()
        acc1, acc5 = accuracy(output, target, topk=(1, min(5, output.shape[-1])))
        n = target.shape[0]
        losses = F.cross_entropy(output, target, reduction='none').double()
        sums += torch.stack([losses.sum(), acc1.double() * n / 100, acc5.double() * n / 100,
                             torch.tensor(n, dtype=torch.float64, device=device), losses.square().sum()])
    if distributed:
        dist.all_reduce(sums)
    elapsed = time.perf_counter() - start
    model.train(was_training)
    loss, correct1, correct5, samples, squared = sums.tolist()
    if samples == 0:
        raise ConfigError('the evaluation set is empty; check --val-split / --val-subset.')
    mean, top1, top5 = loss / samples, correct1 / samples, correct5 / samples
    loss_var = max(squared / samples - mean ** 2, 0.) * samples / max(samples - 1, 1)
    return dict(loss=mean, top1=100 * top1, top5=100 * top5, img_s=samples / elapsed,
                loss_se=math.sqrt(loss_var / samples), top1_se=100 * math.sqrt(top1 * (1 - top1) / samples),
                top5_se=100 * math.sqrt(top5 * (1 - top5) / samples))


def write_metrics(history: List[Dict[str, float]], out: str) -> None:
    """Rewrite `metrics.csv`, `metrics.json` and `metrics.png` in the folder `out` from the history."""
    keys = list(dict.fromkeys(k for h in history for k in h))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=keys)
    writer.writeheader()
    writer.writerows(history)
    atomic_write(os.path.join(out, 'metrics.csv'), buffer.getvalue())
    atomic_write(os.path.join(out, 'metrics.json'), json.dumps(history, indent=2))
    plot_history(history, os.path.join(out, 'metrics.png'))

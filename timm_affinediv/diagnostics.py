""" Measuring the affine divergence: how far one SGD step actually moves an activation

For a loss whose gradient `g` is non-zero at one output vector only (one sample, one
position), the ideal steepest-descent step in activation space is `-lr * g`. After one SGD
step on a set of parameters, the output vector moves by `delta`; the ratio `delta / (-lr * g)`,
per channel, is the effective-update factor: `|x|^2 + 1` (`|P_p|^2 + 1`) for a plain
linear (convolution), the constant `c` for the divergence-corrected layers.

`divergence_report` measures that factor for every affine layer of a model, at many samples and
positions of a batch, and cross-checks each measurement against the closed form.
"""
import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import OptionError, ShapeError
from .layers.affine_div import AffineDivLinear, PatchNormConv2d

__all__ = ['LayerFactorStats', 'divergence_report', 'format_report', 'plot_report', 'update_factor']

_AFFINE_TYPES = (nn.Linear, nn.Conv2d)


def update_factor(
        forward: Callable[[], torch.Tensor],
        params: Sequence[nn.Parameter],
        index: Tuple,
        lr: float = 1e-3,
) -> torch.Tensor:
    """ The effective-update factor at `output[index]` for one SGD step on `params`.

    `forward` recomputes the output; `index` selects one vector of it (e.g. `(n, slice(None), i, j)`).
    The gradient is `g = 1 + u`, `u ~ U(0, 1)` at `index`, zero elsewhere. Parameters are restored
    afterwards. Returns `delta / (-lr * g)` at `index`, per element.
    """
    params = [p for p in params if p is not None]
    out = forward()
    grad_out = torch.zeros_like(out)
    grad_out[index] = 1 + torch.rand_like(grad_out[index])
    grads = torch.autograd.grad(out, params, grad_out)
    saved = [p.detach().clone() for p in params]
    try:
        with torch.no_grad():
            for p, g in zip(params, grads):
                p.sub_(lr * g)
            moved = forward()
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
    return (moved[index] - out.detach()[index]) / (-lr * grad_out[index])


@dataclass(frozen=True)
class LayerFactorStats:
    """ The effective-update factors of one affine layer, one per measured (sample, position, group).

    `factors` are measured (one SGD step, float64). `closed_form_error` is the largest relative
    deviation, over every measured channel, from the closed form: `|x|^2 (+1 with bias)` /
    `|P_p|^2 (+1)` for a plain layer, `c` for a corrected one.
    """
    name: str
    layer_type: str
    corrected: bool
    factors: torch.Tensor
    closed_form_error: float

    @property
    def min(self) -> float:
        return self.factors.min().item()

    @property
    def median(self) -> float:
        return self.factors.median().item()

    @property
    def max(self) -> float:
        return self.factors.max().item()

    @property
    def spread(self) -> float:
        """`max / min` of the factor: 1 when every sample and position gets the same step (inf if min is 0)."""
        return self.max / self.min if self.min > 0 else math.inf

    def as_dict(self) -> Dict[str, object]:
        return dict(
            layer=self.name, type=self.layer_type, corrected=self.corrected, count=self.factors.numel(),
            min=self.min, median=self.median, max=self.max, spread=self.spread,
            closed_form_error=self.closed_form_error)


def _capture_inputs(model: nn.Module, batch: torch.Tensor, batch_stats: bool) -> Dict[str, torch.Tensor]:
    """ The input of every affine layer at its first call in `model(batch)`.

    Runs a copy of the model, in train mode if `batch_stats` (BatchNorm uses the batch's statistics)
    and in eval mode otherwise, so that `model` itself (running statistics included) is not changed.
    """
    model = copy.deepcopy(model).train(batch_stats)
    inputs = {}
    for name, module in model.named_modules():
        if isinstance(module, _AFFINE_TYPES):
            def hook(_, args, name=name):
                inputs.setdefault(name, args[0].detach().clone())
            module.register_forward_pre_hook(hook)
    with torch.no_grad():
        model(batch)
    return inputs


def _pad_input(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """`x` padded as `conv` pads it (zeros or its padding mode), so the unpadded convolution reads the same patches."""
    mode = 'constant' if conv.padding_mode == 'zeros' else conv.padding_mode
    return F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)


def _without_padding(conv: nn.Conv2d) -> nn.Conv2d:
    """`conv` (a copy's own instance) switched to no padding, for inputs already padded by `_pad_input`."""
    conv.padding, conv.padding_mode = (0, 0), 'zeros'
    conv._reversed_padding_repeated_twice = [0, 0, 0, 0]
    return conv


def _patch_sq_norms(conv: nn.Conv2d, x_padded: torch.Tensor) -> torch.Tensor:
    """ `|P_p|^2` per group from an explicit im2col (`F.unfold`), `(N, groups, H_out * W_out)`.

    Independent of `patch_sq_norm`: the padded input is unfolded with the convolution's geometry.
    """
    cols = F.unfold(x_padded, conv.kernel_size, dilation=conv.dilation, stride=conv.stride)
    return cols.unflatten(1, (conv.groups, -1)).square().sum(2)


def _layer_factors(
        layer: nn.Module,
        x: torch.Tensor,
        positions_per_sample: Optional[int],
        lr: float,
        generator: torch.Generator,
) -> Tuple[torch.Tensor, float]:
    """ Factors of one layer at random output positions of each sample of `x`.

    Each measurement runs a float64 copy of the layer on the input window that one output vector
    reads (a convolution's patch, padding applied first, through the convolution set to no
    padding; a linear's input vector), which gives exactly that vector. Returns one factor per
    (sample, position, group) and the largest relative deviation of any measured channel from
    the closed form.
    """
    layer = copy.deepcopy(layer).double()
    x = x.double()
    corrected = isinstance(layer, (AffineDivLinear, PatchNormConv2d))
    if corrected:  # the layer's own factor: without a bound slot's gain that it applies in the same pass
        layer.fuse_post_affine(None)
    has_bias = float(layer.bias is not None)
    if isinstance(layer, nn.Conv2d):
        x = _pad_input(layer, x)
        layer = _without_padding(layer)
        sq_norms = _patch_sq_norms(layer, x)  # (N, groups, H_out * W_out)
        (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.stride, layer.dilation
        out_w = (x.shape[-1] - dw * (kw - 1) - 1) // sw + 1

        def window(n: int, pos: int) -> torch.Tensor:
            i, j = divmod(pos, out_w)
            return x[n:n + 1, :, i * sh:i * sh + dh * (kh - 1) + 1, j * sw:j * sw + dw * (kw - 1) + 1]
        index = (0, slice(None), 0, 0)
    else:
        x = x.reshape(x.shape[0], -1, x.shape[-1])  # (N, positions, features)
        sq_norms = x.square().sum(-1).unsqueeze(1)  # (N, 1, positions)

        def window(n: int, pos: int) -> torch.Tensor:
            return x[n, pos:pos + 1]
        index = (0, slice(None))
    groups, num_positions = sq_norms.shape[1:]
    measured, errors = [], []
    for n in range(x.shape[0]):
        if positions_per_sample is None or positions_per_sample >= num_positions:
            positions = torch.arange(num_positions)
        else:
            positions = torch.randperm(num_positions, generator=generator)[:positions_per_sample]
        for pos in positions.tolist():
            xp = window(n, pos)
            factor = update_factor(lambda: layer(xp), [layer.weight, layer.bias], index, lr=lr).view(groups, -1)
            if corrected:
                closed = torch.full((groups, 1), float(layer.divergence_constant), dtype=torch.float64)
            else:
                closed = (sq_norms[n, :, pos] + has_bias).unsqueeze(1)
            errors.append(((factor - closed).abs() / closed.clamp_min(1e-12)).max().item())
            # the channels of a group share the factor
            measured.append(factor.mean(1))
    return torch.cat(measured), max(errors)


def divergence_report(
        model: nn.Module,
        batch: torch.Tensor,
        samples: int = 8,
        positions_per_sample: Optional[int] = 8,
        lr: float = 1e-3,
        seed: int = 0,
        batch_stats: bool = False,
) -> List[LayerFactorStats]:
    """ The effective-update factor of every affine layer of `model` on `batch`, measured.

    Every `nn.Linear`/`nn.Conv2d` (plain or divergence corrected) gets, for each of the first
    `samples` samples and `positions_per_sample` random output positions (all if None), one SGD
    step (learning rate `lr`) on its own weight and bias, with the gradient at that output vector
    only, on a float64 copy of the layer fed the input it saw in `model(batch)` (the window of it
    that the output vector reads, which gives exactly that vector). The factor is
    `delta / (-lr * g)` at the layer's own output (for a layer bound to a `patchnorm` slot, before
    the slot's per-channel gain): `|x|^2 + 1` (`|P_p|^2 + 1`, or without the `+1` when the layer
    has no bias) for a plain layer, the constant `c` for a corrected one.
    The forward runs in eval mode (running statistics), or with the batch's statistics if
    `batch_stats` (for an untrained model, whose running statistics mean nothing yet). Layers are
    listed in forward order; the model is not changed.
    """
    if batch.dim() < 2:
        raise ShapeError(f"batch must have a batch dimension, got shape {tuple(batch.shape)}")
    if samples < 1 or (positions_per_sample is not None and positions_per_sample < 1):
        raise OptionError(f"samples and positions_per_sample must be >= 1, got {samples}, {positions_per_sample}")
    inputs = _capture_inputs(model, batch, batch_stats)
    if not inputs:
        raise OptionError(f"{type(model).__name__} has no nn.Linear/nn.Conv2d layer reached by its forward")
    modules = dict(model.named_modules())
    generator = torch.Generator().manual_seed(seed)
    report = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, x in inputs.items():
            layer = modules[name]
            factors, error = _layer_factors(layer, x[:samples], positions_per_sample, lr, generator)
            report.append(LayerFactorStats(
                name, type(layer).__name__, isinstance(layer, (AffineDivLinear, PatchNormConv2d)), factors, error))
    return report


def format_report(report: Sequence[LayerFactorStats]) -> str:
    """A markdown table of the report: one row per layer."""
    lines = [
        '| layer | type | corrected | n | min | median | max | spread (max/min) | closed-form error |',
        '|---|---|---|---:|---:|---:|---:|---:|---:|',
    ]
    for s in report:
        lines.append(
            f'| {s.name} | {s.layer_type} | {"yes" if s.corrected else "no"} | {s.factors.numel()} | '
            f'{s.min:.4g} | {s.median:.4g} | {s.max:.4g} | {s.spread:.4g} | {s.closed_form_error:.1e} |')
    return '\n'.join(lines)


def plot_report(report: Sequence[LayerFactorStats], output_dir: str, title: str = '') -> List[Path]:
    """ One small PNG per layer (histogram of its factors, log scale) and `summary.png`.

    The summary shows min, median and max of every layer in forward order. Needs matplotlib.
    Returns the files written.
    """
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    files = []
    for i, s in enumerate(report):
        fig, ax = plt.subplots(figsize=(4, 2.6), dpi=80)
        values = s.factors.clamp_min(1e-6).numpy()
        lo, hi = values.min(), values.max()
        color = 'tab:green' if s.corrected else 'tab:red'
        if hi <= lo * (1 + 1e-6):  # one factor: a single bar, labelled with its value
            ax.hist(values, bins=[lo * 0.99, hi * 1.01], color=color)
            ax.set_xticks([s.median], [f'{s.median:.4g}'])
        else:
            ax.hist(values, bins=torch.logspace(math.log10(lo), math.log10(hi), 30).numpy(), color=color)
            ax.set_xscale('log')
        ax.set_xlabel('effective-update factor')
        ax.set_ylabel('count')
        ax.set_title(f'{s.name} ({s.layer_type})\nspread {s.spread:.3g}', fontsize=8)
        fig.tight_layout()
        files.append(output / f'{i:02d}_{s.name.replace(".", "_")}.png')
        fig.savefig(files[-1])
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * len(report)), 3.2), dpi=80)
    xs = list(range(len(report)))
    colors = ['tab:green' if s.corrected else 'tab:red' for s in report]
    ax.vlines(xs, [max(s.min, 1e-6) for s in report], [s.max for s in report], colors=colors)
    ax.scatter(xs, [s.median for s in report], c=colors, s=10, zorder=3)
    ax.set_yscale('log')
    ax.set_xticks(xs)
    ax.set_xticklabels([s.name for s in report], rotation=90, fontsize=6)
    ax.set_ylabel('factor (min / median / max)')
    ax.set_title(title or 'effective-update factor per layer', fontsize=9)
    fig.tight_layout()
    files.append(output / 'summary.png')
    fig.savefig(files[-1])
    plt.close(fig)
    return files

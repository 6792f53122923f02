""" Experiments on Fashion-MNIST that test the affine divergence paper's claims

1. `mlp`: fully connected ablation, the same MLP with plain `Linear`, `Linear + BatchNorm1d`,
   `Linear + LayerNorm`, `Linear + L2Norm` (RMS scaling) and `AffineDivLinear` everywhere.
2. `conv`: a narrow timm `resnet10t` with BatchNorm, GroupNorm, LayerNorm2d, no normalisation
   and `patchnorm`.
3. `batch`: batch-size sweep at a fixed number of epochs: divergence-corrected MLPs (`affinediv`,
   `l2norm`) against BatchNorm and plain.

Protocol, the same for every variant: SGD with momentum 0.9, cosine learning-rate decay per step,
no weight decay or augmentation, a fixed budget of epochs. The learning rate is tuned on a
validation split (held out from Fashion-MNIST's training set) with the first seed; the best one
is then run with every seed and reported as test accuracy (mean and standard deviation over
seeds), with wall and CPU time per run. Images are held in memory as tensors; everything is
determined by the seed.
"""
import functools
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import GroupNorm

from .layers.affine_div import AffineDivLinear
from .layers.norm import L2Norm

__all__ = [
    'EXPERIMENTS', 'Config', 'RunResult', 'Splits', 'conv_model', 'load_fashion_mnist', 'mlp_model',
    'run_experiment', 'train_run',
]

MLP_VARIANTS = ('linear', 'batchnorm', 'layernorm', 'l2norm', 'affinediv')
CONV_VARIANTS = ('batchnorm', 'groupnorm', 'layernorm2d', 'identity', 'patchnorm')
BATCH_VARIANTS = ('linear', 'batchnorm', 'l2norm', 'affinediv')


@dataclass(frozen=True)
class Config:
    """ The budget of one experiment: data sizes, epochs, the learning-rate grid, seeds, batch sizes."""
    n_train: int
    n_val: int
    n_test: int
    epochs: int
    lrs: Tuple[float, ...]
    seeds: int
    batch_sizes: Tuple[int, ...] = (128,)


FULL = dict(
    mlp=Config(10000, 2000, 10000, epochs=8, lrs=(0.003, 0.01, 0.03, 0.1, 0.3), seeds=3),
    conv=Config(10000, 2000, 10000, epochs=5, lrs=(0.01, 0.03, 0.1, 0.3), seeds=3),
    batch=Config(10000, 2000, 10000, epochs=5, lrs=(0.003, 0.01, 0.03, 0.1, 0.3), seeds=3,
                 batch_sizes=(16, 32, 64, 128, 256, 512)),
)
QUICK = dict(
    mlp=Config(512, 256, 256, epochs=1, lrs=(0.03, 0.1), seeds=2),
    conv=Config(256, 128, 128, epochs=1, lrs=(0.1,), seeds=2),
    batch=Config(512, 256, 256, epochs=1, lrs=(0.1,), seeds=2, batch_sizes=(32, 128)),
)


@dataclass
class Splits:
    """In-memory train / validation / test tensors: images `(N, 1, H, W)` normalised, int64 labels."""
    train: Tuple[torch.Tensor, torch.Tensor]
    val: Tuple[torch.Tensor, torch.Tensor]
    test: Tuple[torch.Tensor, torch.Tensor]


def load_fashion_mnist(
        n_train: int, n_val: int, n_test: int, size: int = 28, root: Optional[str] = None, split_seed: int = 0,
) -> Splits:
    """ Fashion-MNIST subsets as normalised tensors, zero-padded (in pixel space) to `size`.

    Train and validation are disjoint random subsets of the 60k training images (fixed by
    `split_seed`), test is the first `n_test` of the 10k test images.
    """
    from .data import FASHION_MNIST_DIR, FASHION_MNIST_MEAN, FASHION_MNIST_STD, FashionMNIST

    def to_tensors(ds, index):
        images = torch.from_numpy(ds.images[index]).float().div_(255).unsqueeze(1)
        pad = (size - images.shape[-1]) // 2
        if pad < 0 or size - images.shape[-1] != 2 * pad:
            raise ValueError(f"size must be 28 plus an even padding, got {size}")
        images = F.pad(images, (pad, pad, pad, pad))
        images = (images - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0]
        return images, torch.from_numpy(ds.targets[index])

    root = root or FASHION_MNIST_DIR
    train = FashionMNIST(root=root, split='train')
    test = FashionMNIST(root=root, split='test')
    if n_train + n_val > len(train) or n_test > len(test):
        raise ValueError(f"asked for {n_train}+{n_val} training and {n_test} test images; "
                         f"Fashion-MNIST has {len(train)} and {len(test)}")
    order = np.random.default_rng(split_seed).permutation(len(train))
    return Splits(
        to_tensors(train, order[:n_train]), to_tensors(train, order[n_train:n_train + n_val]),
        to_tensors(test, np.arange(n_test)))


def mlp_model(variant: str, in_features: int = 784, hidden: int = 256, depth: int = 3,
              num_classes: int = 10) -> nn.Module:
    """ The ablation MLP: `depth` hidden blocks `affine -> norm -> ReLU`, then an affine head.

    `linear`: `nn.Linear`, no norm; `batchnorm` / `layernorm` / `l2norm`: `nn.Linear` followed by
    `BatchNorm1d` / `LayerNorm` / `L2Norm(scale="rms")`; `affinediv`: every affine map (head
    included) is `AffineDivLinear`, no norm.
    """
    norms: Dict[str, Callable[[int], nn.Module]] = dict(
        linear=nn.Identity, batchnorm=nn.BatchNorm1d, layernorm=nn.LayerNorm,
        l2norm=functools.partial(L2Norm, scale='rms'), affinediv=nn.Identity)
    if variant not in norms:
        raise ValueError(f"unknown MLP variant {variant!r}; choose from {MLP_VARIANTS}")
    affine = AffineDivLinear if variant == 'affinediv' else nn.Linear
    layers: List[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [affine(width, hidden), norms[variant](hidden), nn.ReLU()]
        width = hidden
    layers.append(affine(width, num_classes))
    return nn.Sequential(*layers)


def conv_model(variant: str, num_classes: int = 10) -> nn.Module:
    """ A narrow timm `resnet10t` (channels 16-128, stem 16, 1 input channel) with the given norm.

    `identity` has no normalisation (and `zero_init_last=False`, as there is no norm weight to
    zero); `groupnorm` has 4 groups.
    """
    norms = dict(
        batchnorm='batchnorm', groupnorm=functools.partial(GroupNorm, num_groups=4),
        layernorm2d='layernorm2d', identity=nn.Identity, patchnorm='patchnorm')
    if variant not in norms:
        raise ValueError(f"unknown conv variant {variant!r}; choose from {CONV_VARIANTS}")
    extra = dict(zero_init_last=False) if variant == 'identity' else {}
    return timm.create_model(
        'resnet10t', in_chans=1, num_classes=num_classes, channels=(16, 32, 64, 128), stem_width=16,
        norm_layer=norms[variant], **extra)


@dataclass
class RunResult:
    """One training run: final validation and test accuracy (%), last-epoch train loss, time."""
    experiment: str
    variant: str
    batch_size: int
    lr: float
    seed: int
    val_acc: float
    test_acc: float
    train_loss: float
    diverged: bool
    wall_s: float
    cpu_s: float


@torch.no_grad()
def _accuracy(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, batch_size: int = 1000) -> float:
    model.eval()
    correct = sum(
        (model(images[i:i + batch_size]).argmax(-1) == targets[i:i + batch_size]).sum().item()
        for i in range(0, len(targets), batch_size))
    return 100.0 * correct / len(targets)


def train_run(
        experiment: str, variant: str, build: Callable[[str], nn.Module], data: Splits,
        lr: float, batch_size: int, epochs: int, seed: int,
) -> RunResult:
    """ Train `build(variant)` from seed `seed` and evaluate it.

    SGD (momentum 0.9), learning rate `lr` decayed by a cosine over all steps, cross-entropy,
    batches drawn from a seeded permutation each epoch (the last partial batch dropped). A
    non-finite loss stops the run, which is marked `diverged`.
    """
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    model = build(variant)
    images, targets = data.train
    steps_per_epoch = len(targets) // batch_size
    if steps_per_epoch == 0:
        raise ValueError(f"batch size {batch_size} exceeds the {len(targets)} training images")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs * steps_per_epoch)
    generator = torch.Generator().manual_seed(seed)
    diverged, epoch_loss = False, math.nan
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(targets), generator=generator)
        total = 0.0
        for step in range(steps_per_epoch):
            index = order[step * batch_size:(step + 1) * batch_size]
            loss = F.cross_entropy(model(images[index]), targets[index])
            if not torch.isfinite(loss):
                diverged = True
                break
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total += loss.item()
        if diverged:
            epoch_loss = math.nan
            break
        epoch_loss = total / steps_per_epoch
    return RunResult(
        experiment, variant, batch_size, lr, seed,
        val_acc=_accuracy(model, *data.val), test_acc=_accuracy(model, *data.test),
        train_loss=epoch_loss, diverged=diverged,
        wall_s=time.perf_counter() - start_wall, cpu_s=time.process_time() - start_cpu)


def _tune_and_repeat(
        experiment: str, variant: str, build: Callable[[str], nn.Module], data: Splits, config: Config,
        batch_size: int, seed: int, log: Callable[[str], None],
) -> Tuple[List[RunResult], List[RunResult]]:
    """The learning-rate sweep (first seed) and the runs of every seed at the best learning rate."""
    def run(lr, s):
        result = train_run(experiment, variant, build, data, lr, batch_size, config.epochs, s)
        log(f'{experiment} {variant} bs={batch_size} lr={lr:g} seed={s}: val {result.val_acc:.2f} '
            f'test {result.test_acc:.2f} loss {result.train_loss:.4f} ({result.wall_s:.1f} s)')
        return result

    sweep = [run(lr, seed) for lr in config.lrs]
    best = max(sweep, key=lambda r: (not r.diverged, r.val_acc))
    final = [best] + [run(best.lr, seed + i) for i in range(1, config.seeds)]
    return sweep, final


def _summarise(final: Sequence[RunResult], sweep: Sequence[RunResult]) -> Dict[str, object]:
    test = np.array([r.test_acc for r in final])
    return dict(
        variant=final[0].variant, batch_size=final[0].batch_size, lr=final[0].lr, seeds=len(final),
        test_mean=float(test.mean()), test_std=float(test.std(ddof=1)) if len(test) > 1 else 0.0,
        val_mean=float(np.mean([r.val_acc for r in final])),
        wall_s_per_run=float(np.mean([r.wall_s for r in final])),
        cpu_s_per_run=float(np.mean([r.cpu_s for r in final])),
        sweep_val={f'{r.lr:g}': r.val_acc for r in sweep},
        diverged_lrs=[r.lr for r in sweep if r.diverged])


def _markdown(experiment: str, rows: Sequence[Dict[str, object]], config: Config) -> str:
    head = (f'**{experiment}**: {config.n_train} train / {config.n_val} val / {config.n_test} test images, '
            f'{config.epochs} epochs, lr grid {list(config.lrs)}, {config.seeds} seeds\n\n')
    lines = ['| variant | batch | lr | test acc % (mean ± std) | val acc by lr | wall s / run | CPU s / run |',
             '|---|---:|---:|---:|---|---:|---:|']
    for r in rows:
        sweep = ', '.join(f'{lr}: {acc:.1f}' for lr, acc in r['sweep_val'].items())
        lines.append(
            f"| {r['variant']} | {r['batch_size']} | {r['lr']:g} | {r['test_mean']:.2f} ± {r['test_std']:.2f} | "
            f"{sweep} | {r['wall_s_per_run']:.1f} | {r['cpu_s_per_run']:.1f} |")
    return head + '\n'.join(lines) + '\n'


def _plot(experiment: str, rows: Sequence[Dict[str, object]], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=80)
    if experiment == 'batch':
        for variant in dict.fromkeys(r['variant'] for r in rows):
            own = [r for r in rows if r['variant'] == variant]
            ax.errorbar([r['batch_size'] for r in own], [r['test_mean'] for r in own],
                        yerr=[r['test_std'] for r in own], marker='o', capsize=2, label=variant)
        ax.set_xscale('log', base=2)
        ax.set_xlabel('batch size (fixed epochs, tuned lr)')
        ax.legend(fontsize=7)
    else:
        xs = range(len(rows))
        ax.bar(xs, [r['test_mean'] for r in rows], yerr=[r['test_std'] for r in rows], capsize=3,
               color=['tab:green' if r['variant'] in ('affinediv', 'patchnorm') else 'tab:blue' for r in rows])
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r['variant'] for r in rows], fontsize=8)
        low = min(r['test_mean'] - r['test_std'] for r in rows)
        ax.set_ylim(max(0.0, low - 5), 100)
    ax.set_ylabel('test accuracy %')
    ax.set_title(f'Fashion-MNIST: {experiment}', fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _variants(experiment: str) -> Tuple[Tuple[str, ...], Callable[[str], nn.Module], int]:
    """The variants of an experiment, their model builder and the image size they take."""
    if experiment == 'conv':
        return CONV_VARIANTS, conv_model, 32
    return (MLP_VARIANTS if experiment == 'mlp' else BATCH_VARIANTS), mlp_model, 28


EXPERIMENTS = tuple(FULL)


def run_experiment(
        experiment: str, output: str, seed: int = 0, quick: bool = False,
        config: Optional[Config] = None, log: Callable[[str], None] = print, data_root: Optional[str] = None,
) -> List[Dict[str, object]]:
    """ Run one experiment and write `<output>/<experiment>.{json,md,png}`.

    `config` overrides the full (or `quick`) budget. Seeds are `seed, seed + 1, ...`; the learning
    rate is tuned with `seed`. Returns one summary row per (variant, batch size).
    """
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}; choose from {EXPERIMENTS}")
    config = config or (QUICK if quick else FULL)[experiment]
    variants, build, size = _variants(experiment)
    data = load_fashion_mnist(config.n_train, config.n_val, config.n_test, size=size, root=data_root)
    start = time.perf_counter()
    rows, runs = [], []
    for variant in variants:
        for batch_size in config.batch_sizes:
            sweep, final = _tune_and_repeat(experiment, variant, build, data, config, batch_size, seed, log)
            rows.append(_summarise(final, sweep))
            runs += sweep + final[1:]
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    record = dict(experiment=experiment, seed=seed, quick=quick, config=asdict(config),
                  wall_s=time.perf_counter() - start, torch_threads=torch.get_num_threads(),
                  rows=rows, runs=[asdict(r) for r in runs])
    (out / f'{experiment}.json').write_text(json.dumps(record, indent=1))
    (out / f'{experiment}.md').write_text(_markdown(experiment, rows, config))
    _plot(experiment, rows, out / f'{experiment}.png')
    return rows

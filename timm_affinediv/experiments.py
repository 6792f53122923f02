""" Experiments on Fashion-MNIST that test the affine divergence paper's claims, with its protocol

1. `mlp`: the fully connected ablation. Parameterless variants (no learnable affine in any norm) of
   one MLP, on a grid of widths x depths x activations (Tanh, Leaky-ReLU):
   `linear` (no norm), `batchnorm` / `layernorm` / `rmsnorm` (`Linear -> norm -> act`, the norm
   without weight or bias), `l2normlinear` (the paper's norm-like layer: every affine map, the head
   included, is `L2NormLinear`, its input L2-normalised) and `affinediv` (the affine-like layer:
   every affine map is `AffineDivLinear`). The paper's claim is a ranking, affine-like >= norm-like >
   the others, with the gap growing with width and depth.
2. `batch`: batch-size sweeps of four of those MLPs, at a fixed number of epochs (a larger batch
   takes fewer updates) and at a fixed number of updates (a larger batch sees more data); the paper
   predicts that larger batches hurt the divergence-correcting layers, not BatchNorm or plain layers.
   Each variant's slope of test accuracy against log2(batch size) is taken per seed and reported
   with a 95% t-interval over seeds.
3. `conv`: a narrow timm `resnet10t` with BatchNorm, GroupNorm, LayerNorm2d, no norm and `patchnorm`,
   and a narrow timm `convnext_atto` with its native LayerNorm, RMSNorm and `patchnorm`.

Protocol, the same for every variant: SGD with momentum 0.9, cosine learning-rate decay per step,
no weight decay or augmentation. For every setting (cell, variant, batch size) the learning rate is
tuned on a validation split held out from Fashion-MNIST's training set, with the first seed; the
best one is then run with every seed and reported as test accuracy. Every run is determined by its
seed and writes its own JSON record, so an interrupted grid resumes where it stopped; runs go to a
pool of worker processes with one torch thread each.
"""
import functools
import json
import math
import multiprocessing
import os
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
from .layers.norm import L2NormLinear

__all__ = [
    'EXPERIMENTS', 'Config', 'RunResult', 'Setting', 'Splits', 'conv_model', 'load_fashion_mnist', 'mlp_model',
    'run_experiment', 'settings', 'slope_interval', 'train_run',
]

MLP_VARIANTS = ('linear', 'batchnorm', 'layernorm', 'rmsnorm', 'l2normlinear', 'affinediv')
BATCH_VARIANTS = ('linear', 'batchnorm', 'l2normlinear', 'affinediv')
RESNET_VARIANTS = ('batchnorm', 'groupnorm', 'layernorm2d', 'identity', 'patchnorm')
CONVNEXT_VARIANTS = ('layernorm', 'rmsnorm', 'patchnorm')
CONV_MODELS = dict(resnet10t=RESNET_VARIANTS, convnext_atto=CONVNEXT_VARIANTS)
ACTIVATIONS: Dict[str, Callable[[], nn.Module]] = dict(tanh=nn.Tanh, leaky_relu=nn.LeakyReLU)
LABELS = dict(linear='plain Linear', batchnorm='BatchNorm', layernorm='LayerNorm', rmsnorm='RMSNorm',
              l2normlinear='norm-like (L2NormLinear)', affinediv='affine-like (AffineDivLinear)',
              groupnorm='GroupNorm', layernorm2d='LayerNorm2d', identity='none', patchnorm='patchnorm')


@dataclass(frozen=True)
class Config:
    """ The budget of one experiment.

    Data sizes, the learning-rate grid, seeds, batch sizes; `epochs` per run, or `steps` (updates)
    per run for the fixed-update sweep; the MLP grid (`widths` x `depths` x `activations`).
    """
    n_train: int
    n_val: int
    n_test: int
    epochs: int
    lrs: Tuple[float, ...]
    seeds: int
    batch_sizes: Tuple[int, ...] = (128,)
    steps: int = 0
    widths: Tuple[int, ...] = (256,)
    depths: Tuple[int, ...] = (2,)
    activations: Tuple[str, ...] = ('leaky_relu',)


# the norm-like layer's update factor is 2 where a plain layer's is about its fan-in: it takes larger rates
FULL = dict(
    mlp=Config(5000, 2000, 5000, epochs=5, lrs=(0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0), seeds=3,
               widths=(16, 64, 256), depths=(2, 4), activations=('tanh', 'leaky_relu')),
    batch=Config(5000, 2000, 5000, epochs=5, lrs=(0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0), seeds=5,
                 batch_sizes=(16, 32, 64, 128, 256, 512), steps=300, widths=(128,)),
    conv=Config(4000, 1000, 5000, epochs=3, lrs=(0.01, 0.03, 0.1, 0.3), seeds=3),
)
QUICK = dict(
    mlp=Config(512, 256, 256, epochs=1, lrs=(0.03, 0.3), seeds=2, widths=(16, 32), depths=(1, 2),
               activations=('tanh',)),
    batch=Config(512, 256, 256, epochs=1, lrs=(0.1,), seeds=2, batch_sizes=(32, 64, 128), steps=8),
    conv=Config(256, 128, 128, epochs=1, lrs=(0.1,), seeds=2),
)
EXPERIMENTS = tuple(FULL)


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


def mlp_model(variant: str, width: int = 256, depth: int = 2, act: str = 'leaky_relu', in_features: int = 784,
              num_classes: int = 10) -> nn.Module:
    """ The ablation MLP: `depth` hidden blocks of `width` units, then a head; no norm has parameters.

    `linear`: `Linear -> act`; `batchnorm` / `layernorm` / `rmsnorm`: `Linear -> norm -> act` with
    `BatchNorm1d(affine=False)` / `LayerNorm(elementwise_affine=False)` / `RMSNorm(elementwise_affine=False)`
    and a plain head; `l2normlinear` / `affinediv`: every affine map, the head included, is
    `L2NormLinear` (scale "l2": `W x / |x| + b`) / `AffineDivLinear` (scale "rms"), and no norm.
    """
    norms: Dict[str, Callable[[int], nn.Module]] = dict(
        linear=nn.Identity, batchnorm=functools.partial(nn.BatchNorm1d, affine=False),
        layernorm=functools.partial(nn.LayerNorm, elementwise_affine=False),
        rmsnorm=functools.partial(nn.RMSNorm, elementwise_affine=False),
        l2normlinear=nn.Identity, affinediv=nn.Identity)
    if variant not in norms:
        raise ValueError(f"unknown MLP variant {variant!r}; choose from {MLP_VARIANTS}")
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act!r}; choose from {tuple(ACTIVATIONS)}")
    affine = dict(l2normlinear=L2NormLinear, affinediv=AffineDivLinear).get(variant, nn.Linear)
    layers: List[nn.Module] = [nn.Flatten()]
    features = in_features
    for _ in range(depth):
        layers += [affine(features, width), norms[variant](width), ACTIVATIONS[act]()]
        features = width
    layers.append(affine(features, num_classes))
    return nn.Sequential(*layers)


def conv_model(variant: str, model: str = 'resnet10t', num_classes: int = 10) -> nn.Module:
    """ A narrow timm `resnet10t` or `convnext_atto` (1 input channel) with the given norm.

    resnet10t: channels 16-128, stem 16; `identity` has no norm (and `zero_init_last=False`, as there is
    no norm weight to zero), `groupnorm` 4 groups. convnext_atto: its depths, dims 16-128; `layernorm`
    (native), `rmsnorm` (timm's RmsNorm2d) or `patchnorm`, through ConvNeXt's own norm map.
    """
    if model == 'convnext_atto':
        if variant not in CONVNEXT_VARIANTS:
            raise ValueError(f"unknown convnext variant {variant!r}; choose from {CONVNEXT_VARIANTS}")
        return timm.create_model('convnext_atto', in_chans=1, num_classes=num_classes, dims=(16, 32, 64, 128),
                                 norm_layer=variant)
    if model != 'resnet10t':
        raise ValueError(f"unknown conv model {model!r}; choose from {tuple(CONV_MODELS)}")
    norms = dict(
        batchnorm='batchnorm', groupnorm=functools.partial(GroupNorm, num_groups=4),
        layernorm2d='layernorm2d', identity=nn.Identity, patchnorm='patchnorm')
    if variant not in norms:
        raise ValueError(f"unknown resnet variant {variant!r}; choose from {RESNET_VARIANTS}")
    extra = dict(zero_init_last=False) if variant == 'identity' else {}
    return timm.create_model(
        'resnet10t', in_chans=1, num_classes=num_classes, channels=(16, 32, 64, 128), stem_width=16,
        norm_layer=norms[variant], **extra)


@dataclass(frozen=True)
class Setting:
    """ One cell of an experiment's grid: the model, its variant and the training schedule.

    `steps > 0` fixes the number of updates, else `epochs` fixes the passes over the data.
    """
    experiment: str
    model: str
    variant: str
    batch_size: int
    epochs: int = 0
    steps: int = 0
    width: int = 0
    depth: int = 0
    act: str = ''

    @property
    def name(self) -> str:
        """A file name that identifies the setting."""
        parts = [self.model, self.variant]
        if self.model == 'mlp':
            parts += [f'w{self.width}', f'd{self.depth}', self.act]
        parts += [f'bs{self.batch_size}', f'steps{self.steps}' if self.steps else f'ep{self.epochs}']
        return '-'.join(parts)

    def build(self) -> nn.Module:
        if self.model == 'mlp':
            return mlp_model(self.variant, self.width, self.depth, self.act)
        return conv_model(self.variant, self.model)


def settings(experiment: str, config: Config) -> List[Setting]:
    """Every setting of an experiment, in the order of its tables."""
    if experiment == 'mlp':
        return [Setting('mlp', 'mlp', v, config.batch_sizes[0], config.epochs, width=w, depth=d, act=a)
                for a in config.activations for d in config.depths for w in config.widths for v in MLP_VARIANTS]
    if experiment == 'batch':
        width, depth, act = config.widths[0], config.depths[0], config.activations[0]
        return [Setting('batch', 'mlp', v, b, epochs, steps, width, depth, act)
                for epochs, steps in ((config.epochs, 0), (0, config.steps))
                for v in BATCH_VARIANTS for b in config.batch_sizes]
    if experiment == 'conv':
        return [Setting('conv', m, v, config.batch_sizes[0], config.epochs)
                for m, variants in CONV_MODELS.items() for v in variants]
    raise ValueError(f"unknown experiment {experiment!r}; choose from {EXPERIMENTS}")


@dataclass
class RunResult:
    """One training run: final validation and test accuracy (%), mean train loss of the last epoch, time."""
    setting: str
    lr: float
    seed: int
    steps: int
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
        build: Callable[[], nn.Module], data: Splits, lr: float, batch_size: int, seed: int,
        epochs: int = 0, steps: int = 0, name: str = '',
) -> RunResult:
    """ Train `build()` from seed `seed` for `steps` updates (or `epochs` passes) and evaluate it.

    SGD (momentum 0.9), learning rate `lr` decayed by a cosine over all steps, cross-entropy,
    batches drawn from a fresh seeded permutation each pass (its last partial batch dropped). A
    non-finite loss stops the run, which is marked `diverged`. `train_loss` is the mean loss over
    the last `steps_per_epoch` updates.
    """
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    torch.manual_seed(seed)
    model = build()
    images, targets = data.train
    per_pass = len(targets) // batch_size
    if per_pass == 0:
        raise ValueError(f"batch size {batch_size} exceeds the {len(targets)} training images")
    total_steps = steps or epochs * per_pass
    if total_steps <= 0:
        raise ValueError(f"give a positive number of epochs or steps, got epochs={epochs}, steps={steps}")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    losses: List[float] = []
    diverged = False
    for step in range(total_steps):
        if step % per_pass == 0:
            order = torch.randperm(len(targets), generator=generator)
        index = order[(step % per_pass) * batch_size:(step % per_pass + 1) * batch_size]
        loss = F.cross_entropy(model(images[index]), targets[index])
        if not torch.isfinite(loss):
            diverged = True
            break
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return RunResult(
        name, lr, seed, total_steps,
        val_acc=_accuracy(model, *data.val), test_acc=_accuracy(model, *data.test),
        train_loss=math.nan if diverged else float(np.mean(losses[-per_pass:])), diverged=diverged,
        wall_s=time.perf_counter() - start_wall, cpu_s=time.process_time() - start_cpu)


# ---- the runner: one JSON per run, skipped when it exists, runs spread over worker processes

_DATA: Dict[Tuple, Splits] = {}


def _data(config: Config, size: int, root: Optional[str]) -> Splits:
    """The splits, loaded once per process."""
    key = (config.n_train, config.n_val, config.n_test, size, root)
    if key not in _DATA:
        _DATA[key] = load_fashion_mnist(*key[:4], root=root)
    return _DATA[key]


_DATA_FIELDS = ('n_train', 'n_val', 'n_test')


def _run_path(runs_dir: Path, setting: Setting, lr: float, seed: int) -> Path:
    return runs_dir / f'{setting.name}-lr{lr:g}-seed{seed}.json'


def _load_run(path: Path, config: Config) -> Optional[RunResult]:
    """ A run's record, if it was written.

    The file name fixes the setting, rate and seed; a record trained on other data sizes is refused
    rather than mixed in (another rate grid or seed count reuses the records).
    """
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    data = {k: record['config'][k] for k in _DATA_FIELDS}
    if data != {k: getattr(config, k) for k in _DATA_FIELDS}:
        raise ValueError(
            f"{path} was trained on other data sizes ({data}); use another --output folder "
            "or delete its runs/ folder to start over")
    return RunResult(**record['run'])


def _train_and_record(task: Tuple[Setting, float, int, Config, str, Optional[str]]) -> RunResult:
    """Worker: train one run and write its JSON (to a temporary name, then renamed)."""
    setting, lr, seed, config, runs_dir, data_root = task
    data = _data(config, 28 if setting.model == 'mlp' else 32, data_root)
    result = train_run(setting.build, data, lr, setting.batch_size, seed, setting.epochs, setting.steps,
                       name=setting.name)
    path = _run_path(Path(runs_dir), setting, lr, seed)
    tmp = path.with_suffix('.tmp')
    tmp.write_text(json.dumps(dict(config=asdict(config), setting=asdict(setting), run=asdict(result)), indent=1))
    os.replace(tmp, path)
    return result


def _one_thread() -> None:
    torch.set_num_threads(1)


def _run_all(tasks: List[Tuple], config: Config, workers: int, log: Callable[[str], None]) -> None:
    """Train every task whose record is missing, on `workers` processes (1: in this process)."""
    todo = [t for t in tasks if _load_run(_run_path(Path(t[4]), t[0], t[1], t[2]), config) is None]
    if len(todo) < len(tasks):
        log(f'{len(tasks) - len(todo)} of {len(tasks)} runs already recorded, skipped')
    if not todo:
        return

    def report(result: RunResult) -> None:
        log(f'{result.setting} lr={result.lr:g} seed={result.seed}: val {result.val_acc:.2f} '
            f'test {result.test_acc:.2f} loss {result.train_loss:.4f} ({result.cpu_s:.1f} CPU s)')

    if workers <= 1:
        for task in todo:
            report(_train_and_record(task))
        return
    with multiprocessing.get_context('spawn').Pool(workers, initializer=_one_thread) as pool:
        for result in pool.imap_unordered(_train_and_record, todo):
            report(result)


def _tune_and_repeat(
        settings_: Sequence[Setting], config: Config, seed: int, runs_dir: Path, workers: int,
        data_root: Optional[str], log: Callable[[str], None],
) -> List[Tuple[Setting, List[RunResult], List[RunResult]]]:
    """Per setting: the learning-rate sweep (first seed) and the runs of every seed at the best rate."""
    def task(s, lr, sd):
        return s, lr, sd, config, str(runs_dir), data_root

    def load(s, lr, sd):
        return _load_run(_run_path(runs_dir, s, lr, sd), config)

    _run_all([task(s, lr, seed) for s in settings_ for lr in config.lrs], config, workers, log)
    sweeps = {s: [load(s, lr, seed) for lr in config.lrs] for s in settings_}
    best = {s: max(sweep, key=lambda r: (not r.diverged, r.val_acc)).lr for s, sweep in sweeps.items()}
    seeds = range(seed, seed + config.seeds)
    _run_all([task(s, best[s], sd) for s in settings_ for sd in seeds[1:]], config, workers, log)
    return [(s, sweeps[s], [load(s, best[s], sd) for sd in seeds]) for s in settings_]


# ---- summaries

# two-sided 95% quantiles of Student's t, by degrees of freedom
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def slope_interval(per_seed: Sequence[float]) -> Tuple[float, float]:
    """Mean and the half-width of its 95% t-interval, over per-seed values (2 to 11 of them)."""
    values = np.asarray(per_seed, dtype=float)
    if not 2 <= len(values) <= len(_T975) + 1:
        raise ValueError(f"a t-interval here takes 2 to {len(_T975) + 1} seeds, got {len(values)}")
    return float(values.mean()), float(_T975[len(values) - 1] * values.std(ddof=1) / math.sqrt(len(values)))


def _row(setting: Setting, sweep: Sequence[RunResult], final: Sequence[RunResult]) -> Dict[str, object]:
    test = np.array([r.test_acc for r in final])
    return dict(
        asdict(setting), lr=final[0].lr, seeds=len(final), updates=final[0].steps,
        test_mean=float(test.mean()), test_std=float(test.std(ddof=1)) if len(test) > 1 else 0.0,
        test_by_seed=[r.test_acc for r in final], val_mean=float(np.mean([r.val_acc for r in final])),
        cpu_s_per_run=float(np.mean([r.cpu_s for r in final])),
        sweep_val={f'{r.lr:g}': r.val_acc for r in sweep}, diverged_lrs=[r.lr for r in sweep if r.diverged],
        lr_at_grid_edge=final[0].lr in (min(r.lr for r in sweep), max(r.lr for r in sweep)))


def _acc(r: Dict[str, object]) -> str:
    return f"{r['test_mean']:.2f} ± {r['test_std']:.2f}"


def _mlp_analysis(rows: Sequence[Dict[str, object]]) -> Tuple[Dict[str, object], str]:
    """Ranking per cell and overall; whether affine-like >= norm-like > the rest; the gap by width and depth."""
    cells: Dict[Tuple, Dict[str, Dict[str, object]]] = {}
    for r in rows:
        cells.setdefault((r['act'], r['depth'], r['width']), {})[r['variant']] = r
    others = [v for v in MLP_VARIANTS if v not in ('l2normlinear', 'affinediv')]
    head = ['| act | depth | width | ' + ' | '.join(LABELS[v] for v in MLP_VARIANTS) +
            ' | A >= N | N > rest | gap |', '|---|---:|---:|' + '---:|' * len(MLP_VARIANTS) + ':-:|:-:|---:|']
    ranks = {v: [] for v in MLP_VARIANTS}
    analysis_cells = []
    for (act, depth, width), by in cells.items():
        means = {v: by[v]['test_mean'] for v in MLP_VARIANTS}
        order = sorted(MLP_VARIANTS, key=lambda v: -means[v])
        for v in MLP_VARIANTS:
            ranks[v].append(order.index(v) + 1)
        best_other = max(means[v] for v in others)
        a_ge_n = means['affinediv'] >= means['l2normlinear']
        n_gt_rest = means['l2normlinear'] > best_other
        gap = max(means['affinediv'], means['l2normlinear']) - best_other
        analysis_cells.append(dict(act=act, depth=depth, width=width, ranking=order, a_ge_n=a_ge_n,
                                   n_gt_rest=n_gt_rest, corrected_gap=gap))
        head.append(f'| {act} | {depth} | {width} | ' + ' | '.join(
            f"{_acc(by[v])} ({order.index(v) + 1})" for v in MLP_VARIANTS) +
            f" | {'yes' if a_ge_n else 'no'} | {'yes' if n_gt_rest else 'no'} | {gap:+.2f} |")
    mean_rank = {v: float(np.mean(ranks[v])) for v in MLP_VARIANTS}
    head.append('| **mean rank** | | | ' + ' | '.join(f'**{mean_rank[v]:.2f}**' for v in MLP_VARIANTS) +
                f" | {sum(c['a_ge_n'] for c in analysis_cells)}/{len(analysis_cells)}"
                f" | {sum(c['n_gt_rest'] for c in analysis_cells)}/{len(analysis_cells)} | |")
    # does the gap grow with width (at each act, depth) and with depth (at each act, width)?
    gap = {(c['act'], c['depth'], c['width']): c['corrected_gap'] for c in analysis_cells}
    acts, depths, widths = (sorted({k[i] for k in gap}) for i in range(3))
    by_width = [(a, d, [gap[a, d, w] for w in widths]) for a in acts for d in depths]
    by_depth = [(a, w, [gap[a, d, w] for d in depths]) for a in acts for w in widths]
    lines = ['', f'gap = best of (affine-like, norm-like) minus the best of the others, test points; '
             f'widths {widths}, depths {depths}', '']
    lines += [f"- {a}, depth {d}: gap by width {', '.join(f'{g:+.2f}' for g in gs)}" for a, d, gs in by_width]
    lines += [f"- {a}, width {w}: gap by depth {', '.join(f'{g:+.2f}' for g in gs)}" for a, w, gs in by_depth]
    analysis = dict(
        cells=analysis_cells, mean_rank=mean_rank,
        a_ge_n_cells=sum(c['a_ge_n'] for c in analysis_cells),
        n_gt_rest_cells=sum(c['n_gt_rest'] for c in analysis_cells), n_cells=len(analysis_cells),
        gap_grows_with_width=sum(gs[-1] > gs[0] for _, _, gs in by_width), width_series=len(by_width),
        gap_grows_with_depth=sum(gs[-1] > gs[0] for _, _, gs in by_depth), depth_series=len(by_depth))
    analysis['affinediv_vs'] = {}
    lines.append('')
    for v in MLP_VARIANTS[:-1]:
        diffs = [by['affinediv']['test_mean'] - by[v]['test_mean'] for by in cells.values()]
        analysis['affinediv_vs'][v] = dict(cells_won=sum(d > 0 for d in diffs), mean_diff=float(np.mean(diffs)))
        lines.append(f'- affine-like minus {LABELS[v]}: ahead in {sum(d > 0 for d in diffs)}/{len(diffs)} cells, '
                     f'mean {np.mean(diffs):+.2f}, range {min(diffs):+.2f} to {max(diffs):+.2f} points')
    lines.append(f"\ngap larger at the largest than at the smallest width in {analysis['gap_grows_with_width']}"
                 f"/{len(by_width)} series, at the largest depth than the smallest in "
                 f"{analysis['gap_grows_with_depth']}/{len(by_depth)}")
    return analysis, '\n'.join(head + lines) + '\n'


def _batch_analysis(rows: Sequence[Dict[str, object]]) -> Tuple[Dict[str, object], str]:
    """Per schedule and variant: accuracy by batch size, and the slope against log2(batch) over seeds."""
    def schedule_of(r):
        return 'updates' if r['epochs'] == 0 else 'epochs'

    lines, slopes = [], {}
    for schedule in dict.fromkeys(map(schedule_of, rows)):
        own = [r for r in rows if schedule_of(r) == schedule]
        sizes = sorted({r['batch_size'] for r in own})
        budget = (f"{own[0]['updates']} updates at every batch size" if schedule == 'updates'
                  else f"{own[0]['epochs']} epochs (updates = epochs x train / batch)")
        lines += [f'\n**fixed {schedule}**: {budget}; test acc %, mean ± std over seeds (tuned lr)\n',
                  '| variant | ' + ' | '.join(str(b) for b in sizes) + ' | slope per doubling [95% CI] |',
                  '|---|' + '---:|' * len(sizes) + '---:|']
        per_variant = {}
        for variant in dict.fromkeys(r['variant'] for r in own):
            by_size = {r['batch_size']: r for r in own if r['variant'] == variant}
            x = np.log2(sizes)
            accs = np.array([by_size[b]['test_by_seed'] for b in sizes])  # (sizes, seeds)
            per_seed = [float(np.polyfit(x, accs[:, i], 1)[0]) for i in range(accs.shape[1])]
            mean, half = slope_interval(per_seed)
            per_variant[variant] = dict(per_seed=per_seed, mean=mean, ci95=half,
                                        lrs={b: by_size[b]['lr'] for b in sizes})
            lines.append(f'| {LABELS[variant]} | ' + ' | '.join(_acc(by_size[b]) for b in sizes) +
                         f' | {mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}] |')
        # the paper's comparison: corrected minus baseline, paired by seed
        lines.append('')
        for corrected in ('l2normlinear', 'affinediv'):
            for baseline in ('batchnorm', 'linear'):
                if corrected in per_variant and baseline in per_variant:
                    diff = np.subtract(per_variant[corrected]['per_seed'], per_variant[baseline]['per_seed'])
                    mean, half = slope_interval(diff)
                    per_variant[f'{corrected}-{baseline}'] = dict(per_seed=diff.tolist(), mean=mean, ci95=half)
                    lines.append(f'- slope of {LABELS[corrected]} minus {LABELS[baseline]}: {mean:+.2f} '
                                 f'[{mean - half:+.2f}, {mean + half:+.2f}] points per doubling')
        slopes[schedule] = per_variant
    return dict(slopes=slopes), '\n'.join(lines) + '\n'


def _conv_table(rows: Sequence[Dict[str, object]]) -> Tuple[Dict[str, object], str]:
    lines = ['| model | norm | lr | test acc % | val acc by lr | CPU s / run |', '|---|---|---:|---:|---|---:|']
    for r in rows:
        sweep = ', '.join(f'{lr}: {acc:.1f}' for lr, acc in r['sweep_val'].items())
        lines.append(f"| {r['model']} | {LABELS[r['variant']]} | {r['lr']:g} | {_acc(r)} | {sweep} | "
                     f"{r['cpu_s_per_run']:.1f} |")
    return {}, '\n'.join(lines) + '\n'


def _plot(experiment: str, rows: Sequence[Dict[str, object]], path: Path) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    def lines(ax, own, x_key, title, log2=False):
        for variant in dict.fromkeys(r['variant'] for r in own):
            mine = [r for r in own if r['variant'] == variant]
            ax.errorbar([r[x_key] for r in mine], [r['test_mean'] for r in mine], yerr=[r['test_std'] for r in mine],
                        marker='o', ms=3, capsize=2, label=LABELS[variant],
                        lw=2 if variant in ('affinediv', 'l2normlinear') else 1)
        ax.set_xscale('log', base=2)
        ax.set_title(title, fontsize=8)
        ax.tick_params(labelsize=7)

    if experiment == 'mlp':
        panels = list(dict.fromkeys((r['act'], r['depth']) for r in rows))
        fig, axes = plt.subplots(1, len(panels), figsize=(3 * len(panels), 3), dpi=80, sharey=True, squeeze=False)
        for ax, (act, depth) in zip(axes[0], panels):
            lines(ax, [r for r in rows if (r['act'], r['depth']) == (act, depth)], 'width', f'{act}, depth {depth}')
            ax.set_xlabel('width', fontsize=7)
    elif experiment == 'batch':
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), dpi=80, squeeze=False)
        for ax, fixed in zip(axes[0], ('epochs', 'updates')):
            lines(ax, [r for r in rows if (r['epochs'] == 0) == (fixed == 'updates')], 'batch_size',
                  f'fixed {fixed}, tuned lr')
            ax.set_xlabel('batch size', fontsize=7)
    else:
        fig, axes = plt.subplots(1, len(CONV_MODELS), figsize=(8, 3.2), dpi=80, squeeze=False)
        for ax, model in zip(axes[0], CONV_MODELS):
            own = [r for r in rows if r['model'] == model]
            ax.bar(range(len(own)), [r['test_mean'] for r in own], yerr=[r['test_std'] for r in own], capsize=3,
                   color=['tab:green' if r['variant'] == 'patchnorm' else 'tab:blue' for r in own])
            ax.set_xticks(range(len(own)))
            ax.set_xticklabels([LABELS[r['variant']] for r in own], fontsize=7, rotation=20)
            ax.set_ylim(max(0.0, min(r['test_mean'] - r['test_std'] for r in own) - 5), 100)
            ax.set_title(model, fontsize=8)
    axes[0][0].set_ylabel('test accuracy %', fontsize=7)
    if experiment != 'conv':
        axes[0][-1].legend(fontsize=6)
    fig.suptitle(f'Fashion-MNIST: {experiment}', fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


ANALYSES = dict(mlp=_mlp_analysis, batch=_batch_analysis, conv=_conv_table)


def run_experiment(
        experiment: str, output: str, seed: int = 0, quick: bool = False, config: Optional[Config] = None,
        log: Callable[[str], None] = print, data_root: Optional[str] = None, workers: int = 1,
) -> List[Dict[str, object]]:
    """ Run one experiment and write `<output>/<experiment>.{json,md,png}` and `<output>/runs/<experiment>/`.

    `config` overrides the full (or `quick`) budget. Seeds are `seed, seed + 1, ...`; the learning
    rate is tuned with `seed`. Runs already recorded under `runs/` are read back, not rerun.
    Returns one summary row per setting.
    """
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}; choose from {EXPERIMENTS}")
    config = config or (QUICK if quick else FULL)[experiment]
    out = Path(output)
    runs_dir = out / 'runs' / experiment
    runs_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = _tune_and_repeat(settings(experiment, config), config, seed, runs_dir, workers, data_root, log)
    rows = [_row(*r) for r in results]
    analysis, table = ANALYSES[experiment](rows)
    runs = [r for _, sweep, final in results for r in sweep + final[1:]]
    head = (f'**{experiment}**: {config.n_train} train / {config.n_val} val / {config.n_test} test images, '
            f'lr grid {list(config.lrs)} (tuned per setting on val, seed {seed}), {config.seeds} seeds; '
            f'{len(runs)} runs, {sum(r.cpu_s for r in runs) / 60:.1f} CPU-minutes\n\n')
    record = dict(experiment=experiment, seed=seed, quick=quick, config=asdict(config), workers=workers,
                  wall_s=time.perf_counter() - start, cpu_s=sum(r.cpu_s for r in runs), rows=rows,
                  analysis=analysis, runs=[asdict(r) for r in runs])
    for name, text in ((f'{experiment}.json', json.dumps(record, indent=1)), (f'{experiment}.md', head + table)):
        tmp = out / (name + '.tmp')
        tmp.write_text(text)
        os.replace(tmp, out / name)
    _plot(experiment, rows, out / f'{experiment}.png')
    return rows

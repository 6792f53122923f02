""" The runs of an experiment: its budget, its grid of settings, one SGD training run, and the pool that trains
the runs not yet recorded (each run's JSON record written atomically, so an interrupted grid resumes)
"""
import json
import math
import multiprocessing
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler

from timm_affinediv.files import atomic_write

from .data import Splits, load_fashion_mnist
from .models import (
    BATCH_VARIANTS,
    CONV_MODELS,
    FAMILIES,
    FAMILY_RECIPES,
    MLP_VARIANTS,
    conv_model,
    family_model,
    family_variants,
    mlp_model,
)

__all__ = ['Config', 'FULL', 'QUICK', 'EXPERIMENTS', 'Recipe', 'RECIPES', 'Setting', 'settings', 'RunResult',
           'train_run', 'recipe_optimizer', 'RunTask', 'run_path', 'tune_and_repeat', 'longer_budget']


@dataclass(frozen=True)
class Config:
    """ The budget of one experiment.

    Data sizes, the learning-rate grid, seeds, batch sizes; `epochs` per run, or `steps` (updates)
    per run for the fixed-update sweep; the MLP grid (`widths` x `depths` x `activations`).

    The `families` experiment: `lrs` are multiples of each family's recipe rate (`RECIPES`); where the best
    rate is at the grid's edge the grid grows past it, a step at a time, at most `edge_steps` times; the families
    (all of `FAMILIES` when `models` is empty) whose norms differ by more than `long_gap` points on the validation
    split are trained again `long_factor` times as long at the rates chosen, and so are the families of
    `long_seeds`, whatever their gap, with the number of seeds given there.
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
    models: Tuple[str, ...] = ()
    edge_steps: int = 0
    long_factor: int = 0
    long_gap: float = 2.0
    long_seeds: Tuple[Tuple[str, int], ...] = ()


# the norm-like layer's update factor is 2 where a plain layer's is about its fan-in: it takes larger rates
FULL = dict(
    mlp=Config(5000, 2000, 5000, epochs=5, lrs=(0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0), seeds=3,
               widths=(16, 64, 256), depths=(2, 4), activations=('tanh', 'leaky_relu')),
    batch=Config(5000, 2000, 5000, epochs=5, lrs=(0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0), seeds=5,
                 batch_sizes=(16, 32, 64, 128, 256, 512), steps=300, widths=(128,)),
    conv=Config(4000, 1000, 5000, epochs=3, lrs=(0.01, 0.03, 0.1, 0.3), seeds=3),
    families=Config(5000, 1000, 10000, epochs=3, lrs=(0.25, 0.5, 1.0, 2.0), seeds=3, batch_sizes=(64,),
                    edge_steps=2, long_factor=4, long_gap=2.0,
                    # the depthwise families' differences are about a point: 5 seeds resolve them
                    long_seeds=(('mobilenetv3_small_050', 5), ('tinynet_e', 5))),
)
QUICK = dict(
    mlp=Config(512, 256, 256, epochs=1, lrs=(0.03, 0.3), seeds=2, widths=(16, 32), depths=(1, 2),
               activations=('tanh',)),
    batch=Config(512, 256, 256, epochs=1, lrs=(0.1,), seeds=2, batch_sizes=(32, 64, 128), steps=8),
    conv=Config(256, 128, 128, epochs=1, lrs=(0.1,), seeds=2),
    # a two-rate grid always has its best at an edge, and a negative gap sends every family to the longer budget:
    # each step of the protocol runs (on a family with depthwise and dense convolutions)
    families=Config(256, 128, 128, epochs=1, lrs=(0.5, 1.0), seeds=2, batch_sizes=(32,),
                    models=('mobilenetv3_small_050',), edge_steps=1, long_factor=2,
                    long_gap=-1.0, long_seeds=(('mobilenetv3_small_050', 3),)),
)
EXPERIMENTS = tuple(FULL)


@dataclass(frozen=True)
class Recipe:
    """ A `families` training recipe: timm's optimiser `opt` (`timm.optim.create_optimizer_v2`, no weight decay
    on biases and norms), its base rate and weight decay, a linear warm-up over `warmup` of the steps, then a
    cosine to 0 (`timm.scheduler.CosineLRScheduler`, stepped every update). """
    opt: str
    lr: float
    weight_decay: float
    warmup: float = 0.05


RECIPES = dict(sgd=Recipe('sgd', 0.1, 5e-4), adamw=Recipe('adamw', 4e-3, 0.05))


@dataclass(frozen=True)
class Setting:
    """ One cell of an experiment's grid: the model, its variant and the training schedule.

    `steps > 0` fixes the number of updates, else `epochs` fixes the passes over the data. `recipe` names the
    optimiser of `RECIPES`; empty, the paper protocol's SGD.
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
    recipe: str = ''

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
        if self.experiment == 'families':
            return family_model(self.variant, self.model)
        return conv_model(self.variant, self.model)

    def lr_grid(self, config: Config) -> Tuple[float, ...]:
        """The learning rates swept: the config's, or its multiples of the recipe's rate."""
        if not self.recipe:
            return config.lrs
        return tuple(RECIPES[self.recipe].lr * m for m in config.lrs)


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
    if experiment == 'families':
        return [Setting('families', m, v, config.batch_sizes[0], config.epochs, recipe=FAMILY_RECIPES[m])
                for m in config.models or FAMILIES for v in family_variants(m)]
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


def recipe_optimizer(model: nn.Module, recipe: str, lr: float, total_steps: int):
    """The optimiser and the per-step schedule call of a run (the paper protocol's without `recipe`)."""
    if not recipe:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
        return optimizer, lambda step: scheduler.step()
    r = RECIPES[recipe]
    optimizer = create_optimizer_v2(model, opt=r.opt, lr=lr, weight_decay=r.weight_decay, momentum=0.9)
    warmup = max(1, round(r.warmup * total_steps))
    scheduler = CosineLRScheduler(optimizer, t_initial=total_steps, warmup_t=warmup, warmup_lr_init=lr / warmup,
                                  warmup_prefix=True, t_in_epochs=False)
    return optimizer, lambda step: scheduler.step_update(step + 1)


def train_run(
        build: Callable[[], nn.Module], data: Splits, lr: float, batch_size: int, seed: int,
        epochs: int = 0, steps: int = 0, name: str = '', recipe: str = '',
        keep: Optional[Callable[[nn.Module], None]] = None,
) -> RunResult:
    """ Train `build()` from seed `seed` for `steps` updates (or `epochs` passes) and evaluate it.

    SGD (momentum 0.9), learning rate `lr` decayed by a cosine over all steps, or the optimiser and
    schedule of `RECIPES[recipe]`; cross-entropy, batches drawn from a fresh seeded permutation each
    pass (its last partial batch dropped). A non-finite loss stops the run, which is marked
    `diverged`. `train_loss` is the mean loss over the last `steps_per_epoch` updates. `keep` is
    handed the trained model.
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
    optimizer, schedule = recipe_optimizer(model, recipe, lr, total_steps)
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
        schedule(step)
        losses.append(loss.item())
    if keep is not None:
        keep(model)
    return RunResult(
        name, lr, seed, total_steps,
        val_acc=_accuracy(model, *data.val), test_acc=_accuracy(model, *data.test),
        train_loss=math.nan if diverged else float(np.mean(losses[-per_pass:])), diverged=diverged,
        wall_s=time.perf_counter() - start_wall, cpu_s=time.process_time() - start_cpu)


# ---- the runner: one JSON per run, skipped when it exists, runs spread over worker processes

_DATA: Dict[Tuple, Splits] = {}


def cached_splits(config: Config, size: int, root: Optional[str]) -> Splits:
    """The splits, loaded once per process."""
    key = (config.n_train, config.n_val, config.n_test, size, root)
    if key not in _DATA:
        _DATA[key] = load_fashion_mnist(*key[:4], root=root)
    return _DATA[key]


_DATA_FIELDS = ('n_train', 'n_val', 'n_test')


def run_path(runs_dir: Path, setting: Setting, lr: float, seed: int) -> Path:
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


@dataclass(frozen=True)
class RunTask:
    """One run to train: a setting at a learning rate and seed, under an experiment's budget."""
    setting: Setting
    lr: float
    seed: int
    config: Config
    runs_dir: str
    data_root: Optional[str] = None

    @property
    def path(self) -> Path:
        return run_path(Path(self.runs_dir), self.setting, self.lr, self.seed)


def _train_and_record(task: RunTask) -> RunResult:
    """Worker: train one run and write its JSON record atomically."""
    setting = task.setting
    data = cached_splits(task.config, 28 if setting.model == 'mlp' else 32, task.data_root)
    result = train_run(setting.build, data, task.lr, setting.batch_size, task.seed, setting.epochs, setting.steps,
                       name=setting.name, recipe=setting.recipe)
    record = dict(config=asdict(task.config), setting=asdict(setting), run=asdict(result))
    atomic_write(task.path, json.dumps(record, indent=1))
    return result


def _one_thread() -> None:
    torch.set_num_threads(1)


def _run_all(tasks: List[RunTask], config: Config, workers: int, log: Callable[[str], None]) -> None:
    """Train every task whose record is missing, on `workers` processes (1: in this process; 0: none)."""
    todo = [t for t in tasks if _load_run(t.path, config) is None]
    if len(todo) < len(tasks):
        log(f'{len(tasks) - len(todo)} of {len(tasks)} runs already recorded, skipped')
    if not todo:
        return
    if workers == 0:
        log(f'{len(todo)} runs not recorded: their settings are left out')
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


def _best(sweep: Sequence[RunResult]) -> RunResult:
    return max(sweep, key=lambda r: (not r.diverged, r.val_acc))


def _recorded(runs: Sequence[Optional[RunResult]]) -> Optional[List[RunResult]]:
    """The runs, or None where one is not recorded (`workers=0` trains none)."""
    return None if any(r is None for r in runs) else list(runs)


def _grown(grid: List[float], best: float) -> Optional[float]:
    """The rate one step past the grid's edge where `best` is, or None where it is inside (a grid of one rate grows
    up)."""
    ratio = grid[1] / grid[0] if len(grid) > 1 else 2.0
    if best == grid[-1]:
        return grid[-1] * ratio
    if best == grid[0]:
        return grid[0] / ratio
    return None


def tune_and_repeat(
        settings_: Sequence[Setting], config: Config, seed: int, runs_dir: Path, workers: int,
        data_root: Optional[str], log: Callable[[str], None],
) -> List[Tuple[Setting, List[RunResult], List[RunResult]]]:
    """ Per setting: the learning-rate sweep (first seed) and the runs of every seed at the best rate. The sweep
    grows past an edge holding the best rate up to `config.edge_steps` times (the rates a setting adds are run
    before any setting's next growth, so the workers stay busy). With `workers=0` nothing is trained, and the
    settings whose runs are not all recorded are left out. """
    def task(s, lr, sd):
        return RunTask(s, lr, sd, config, str(runs_dir), data_root)

    def load(s, lr, sd):
        return _load_run(run_path(runs_dir, s, lr, sd), config)

    grids = {s: sorted(s.lr_grid(config)) for s in settings_}
    _run_all([task(s, lr, seed) for s in settings_ for lr in grids[s]], config, workers, log)
    for _ in range(config.edge_steps):
        grown = {}
        for s in settings_:
            sweep = _recorded([load(s, lr, seed) for lr in grids[s]])
            rate = _grown(grids[s], _best(sweep).lr) if sweep else None
            if rate is not None:
                grown[s] = rate
        if not grown:
            break
        for s, lr in grown.items():
            grids[s] = sorted(grids[s] + [lr])
        _run_all([task(s, lr, seed) for s, lr in grown.items()], config, workers, log)
    sweeps = {s: _recorded([load(s, lr, seed) for lr in grids[s]]) for s in settings_}
    best = {s: _best(sweep).lr for s, sweep in sweeps.items() if sweep}
    seeds = range(seed, seed + config.seeds)
    _run_all([task(s, best[s], sd) for s in best for sd in seeds[1:]], config, workers, log)
    finals = {s: _recorded([load(s, best[s], sd) for sd in seeds]) for s in best}
    return [(s, sweeps[s], finals[s]) for s in settings_ if finals.get(s)]


def longer_budget(
        results: Sequence[Tuple[Setting, List[RunResult], List[RunResult]]], config: Config, seed: int,
        runs_dir: Path, workers: int, data_root: Optional[str], log: Callable[[str], None],
) -> List[Tuple[Setting, List[RunResult], List[RunResult]]]:
    """ The models whose variants' mean validation accuracy spans more than `config.long_gap` points, trained
    `config.long_factor` times as long, every seed at the rate each variant chose at the short budget (no sweep:
    it would cost the factor again per rate); the cheapest models first, so that an interrupted experiment has
    the most of them. With `workers=0` nothing is trained and unrecorded settings are left out. """
    if not config.long_factor:
        return []
    by_model: Dict[str, List[Tuple[Setting, List[RunResult], List[RunResult]]]] = {}
    for r in results:
        by_model.setdefault(r[0].model, []).append(r)
    long_seeds = dict(config.long_seeds)
    chosen = []
    for own in sorted(by_model.values(), key=lambda own: sum(run.cpu_s for _, _, final in own for run in final)):
        val = [float(np.mean([run.val_acc for run in final])) for _, _, final in own]
        model = own[0][0].model
        if max(val) - min(val) > config.long_gap or model in long_seeds:
            seeds = range(seed, seed + long_seeds.get(model, config.seeds))
            chosen += [(replace(s, epochs=s.epochs * config.long_factor), final[0].lr, seeds) for s, _, final in own]
    _run_all([RunTask(s, lr, sd, config, str(runs_dir), data_root) for s, lr, seeds in chosen for sd in seeds],
             config, workers, log)
    finals = [(s, _recorded([_load_run(run_path(runs_dir, s, lr, sd), config) for sd in seeds]))
              for s, lr, seeds in chosen]
    return [(s, [], final) for s, final in finals if final]

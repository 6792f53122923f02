""" The runs of an experiment: its budget, its grid of settings, one SGD training run, and the pool that trains
the runs not yet recorded (each run's JSON record written atomically, so an interrupted grid resumes)
"""
import json
import math
import multiprocessing
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from timm_affinediv._io import atomic_write

from .data import Splits, load_fashion_mnist
from .models import BATCH_VARIANTS, CONV_MODELS, MLP_VARIANTS, conv_model, mlp_model

__all__ = ['Config', 'FULL', 'QUICK', 'EXPERIMENTS', 'Setting', 'settings', 'RunResult', 'train_run', 'RunTask',
           'tune_and_repeat']


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
        return _run_path(Path(self.runs_dir), self.setting, self.lr, self.seed)


def _train_and_record(task: RunTask) -> RunResult:
    """Worker: train one run and write its JSON record atomically."""
    setting = task.setting
    data = _data(task.config, 28 if setting.model == 'mlp' else 32, task.data_root)
    result = train_run(setting.build, data, task.lr, setting.batch_size, task.seed, setting.epochs, setting.steps,
                       name=setting.name)
    record = dict(config=asdict(task.config), setting=asdict(setting), run=asdict(result))
    atomic_write(task.path, json.dumps(record, indent=1))
    return result


def _one_thread() -> None:
    torch.set_num_threads(1)


def _run_all(tasks: List[RunTask], config: Config, workers: int, log: Callable[[str], None]) -> None:
    """Train every task whose record is missing, on `workers` processes (1: in this process)."""
    todo = [t for t in tasks if _load_run(t.path, config) is None]
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


def tune_and_repeat(
        settings_: Sequence[Setting], config: Config, seed: int, runs_dir: Path, workers: int,
        data_root: Optional[str], log: Callable[[str], None],
) -> List[Tuple[Setting, List[RunResult], List[RunResult]]]:
    """Per setting: the learning-rate sweep (first seed) and the runs of every seed at the best rate."""
    def task(s, lr, sd):
        return RunTask(s, lr, sd, config, str(runs_dir), data_root)

    def load(s, lr, sd):
        return _load_run(_run_path(runs_dir, s, lr, sd), config)

    _run_all([task(s, lr, seed) for s in settings_ for lr in config.lrs], config, workers, log)
    sweeps = {s: [load(s, lr, seed) for lr in config.lrs] for s in settings_}
    best = {s: max(sweep, key=lambda r: (not r.diverged, r.val_acc)).lr for s, sweep in sweeps.items()}
    seeds = range(seed, seed + config.seeds)
    _run_all([task(s, best[s], sd) for s in settings_ for sd in seeds[1:]], config, workers, log)
    return [(s, sweeps[s], [load(s, best[s], sd) for sd in seeds]) for s in settings_]

""" One paper experiment run end to end: its runs trained (or read back), its tables, record and plot written """
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Dict, List, Optional

from timm_affinediv.errors import MissingFileError
from timm_affinediv.files import atomic_write

from .analysis import ANALYSES, plot, summary_row
from .runs import EXPERIMENTS, FULL, QUICK, RECIPES, Config, longer_budget, settings, tune_and_repeat
from .spread import native_spreads, spread_table

__all__ = ['run_experiment']


def run_experiment(
        experiment: str, output: str, seed: int = 0, quick: bool = False, config: Optional[Config] = None,
        log: Callable[[str], None] = print, data_root: Optional[str] = None, workers: int = 1,
) -> List[Dict[str, object]]:
    """ Run one experiment and write `<output>/<experiment>.{json,md,png}` and `<output>/runs/<experiment>/`.

    `config` overrides the full (or `quick`) budget. Seeds are `seed, seed + 1, ...`; the learning
    rate is tuned with `seed`. Runs already recorded under `runs/` are read back, not rerun;
    `workers=0` trains none and writes the tables of the settings recorded so far.
    Returns one summary row per setting (and per longer budget, where the config asks for one).
    """
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}; choose from {EXPERIMENTS}")
    config = config or (QUICK if quick else FULL)[experiment]
    out = Path(output)
    runs_dir = out / 'runs' / experiment
    runs_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = tune_and_repeat(settings(experiment, config), config, seed, runs_dir, workers, data_root, log)
    if not results:
        raise MissingFileError(f'{runs_dir} holds no setting of {experiment} whose runs are all recorded: run it with '
                               '--workers 1 or more first')
    if experiment == 'families':  # before the longer budget, the costliest step
        spreads = native_spreads(results, config, seed, runs_dir / 'spread', data_root, log, train=workers > 0)
    results += longer_budget(results, config, seed, runs_dir, workers, data_root, log)
    rows = [summary_row(*r) for r in results]
    analysis, table = ANALYSES[experiment](rows)
    if experiment == 'families':
        analysis['spreads'] = spreads
        table += ('\nThe divergence factor\'s spread (max / min over 8 test images x 8 positions) in each layer of '
                  'the native model (first seed, chosen rate), median by kind of layer:\n\n'
                  + spread_table(spreads, analysis['cells']))
    # a tuned setting's first seed is its sweep's best run
    runs = list({(r.setting, r.lr, r.seed): r for _, sweep, final in results for r in sweep + final}.values())
    grid = f'lr grid {list(config.lrs)}'
    if experiment == 'families':
        grid += (" x each optimiser's rate (" + ', '.join(f'{k} {r.lr:g}' for k, r in RECIPES.items())
                 + f'), grown past an edge at most {config.edge_steps} times')
    head = (f'**{experiment}**: {config.n_train} train / {config.n_val} val / {config.n_test} test images, '
            f'{grid} (tuned per setting on val, seed {seed}), {config.seeds} seeds; '
            f'{len(runs)} runs, {sum(r.cpu_s for r in runs) / 60:.1f} CPU-minutes\n\n')
    record = dict(experiment=experiment, seed=seed, quick=quick, config=asdict(config), workers=workers,
                  wall_s=time.perf_counter() - start, cpu_s=sum(r.cpu_s for r in runs), rows=rows,
                  analysis=analysis, runs=[asdict(r) for r in runs])
    for name, text in ((f'{experiment}.json', json.dumps(record, indent=1)), (f'{experiment}.md', head + table)):
        atomic_write(out / name, text)
    plot(experiment, rows, out / f'{experiment}.png')
    return rows

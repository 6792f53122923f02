""" The tables, the statistics and the plots of the paper experiments' results """
import math
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Sequence, Tuple

import numpy as np

from .models import CONV_MODELS, LABELS, MLP_VARIANTS, native_norm
from .runs import RunResult, Setting

__all__ = ['t_quantile', 'slope_interval', 'difference_interval', 'summary_row', 'ANALYSES', 'plot']



def _t_central_mass(t: float, df: int) -> float:
    """ `P(|T| <= t)` for Student's t with `df` (integer) degrees of freedom, in closed form: with
    `theta = atan(t / sqrt(df))`, `sin(theta) sum_k b_k cos(theta)^2k` (`b_k = b_k-1 (2k - 1) / 2k`) for even `df`,
    `(2 / pi) (theta + sin(theta) cos(theta) sum_k a_k cos(theta)^2k)` (`a_k = a_k-1 2k / (2k + 1)`) for odd `df`.
    """
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    term, total = 1.0, 1.0
    if df % 2 == 0:
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return math.sin(theta) * total
    if df == 1:
        return 2 * theta / math.pi
    for k in range(1, (df - 1) // 2):
        term *= c2 * 2 * k / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)


def t_quantile(q: float, df: int) -> float:
    """The `q` quantile (`q` > 0.5) of Student's t with `df` degrees of freedom, by bisection on its closed-form
    distribution function (to float precision)."""
    mass = 2 * q - 1
    low, high = 0.0, 1.0
    while _t_central_mass(high, df) < mass:
        low, high = high, 2 * high
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central_mass(mid, df) < mass else (low, mid)
    return (low + high) / 2


def slope_interval(per_seed: Sequence[float]) -> Tuple[float, float]:
    """Mean and the half-width of its 95% t-interval, over per-seed values (at least 2)."""
    values = np.asarray(per_seed, dtype=float)
    if len(values) < 2:
        raise ValueError(f'a t-interval takes at least 2 seeds, got {len(values)}')
    half = t_quantile(0.975, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values))
    return float(values.mean()), float(half)


def summary_row(setting: Setting, sweep: Sequence[RunResult], final: Sequence[RunResult]) -> Dict[str, object]:
    test = np.array([r.test_acc for r in final])
    return dict(
        asdict(setting), lr=final[0].lr, seeds=len(final), updates=final[0].steps,
        test_mean=float(test.mean()), test_std=float(test.std(ddof=1)) if len(test) > 1 else 0.0,
        test_by_seed=[r.test_acc for r in final], val_mean=float(np.mean([r.val_acc for r in final])),
        cpu_s_per_run=float(np.mean([r.cpu_s for r in final])),
        sweep_val={f'{r.lr:g}': r.val_acc for r in sweep}, diverged_lrs=[r.lr for r in sweep if r.diverged],
        lr_at_grid_edge=bool(sweep) and final[0].lr in (min(r.lr for r in sweep), max(r.lr for r in sweep)),
        cpu_s=float(sum(r.cpu_s for r in {(r.lr, r.seed): r for r in list(sweep) + list(final)}.values())))


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


def difference_interval(a: Sequence[float], b: Sequence[float]) -> Tuple[float, float]:
    """ `mean(a) - mean(b)` and the half-width of its 95% Welch t-interval (degrees of freedom rounded down; 0 with
    fewer than 2 values on a side). """
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    diff = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return diff, 0.0
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    if va + vb == 0:
        return diff, 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return diff, float(t_quantile(0.975, max(1, int(df))) * math.sqrt(va + vb))


def _verdict(diff: float, half: float) -> str:
    if diff - half > 0:
        return 'held'
    if diff + half < 0:
        return 'not held'
    return 'within noise'


def _families_analysis(rows: Sequence[Dict[str, object]]) -> Tuple[Dict[str, object], str]:
    """ Per family and budget: each norm's tuned rate and test accuracy, `patchnorm` minus the native norm with its
    95% interval, and the verdict on "PatchNorm trains this family better from scratch": held (the interval above
    0), not held (below) or within noise. """
    cells: Dict[Tuple[str, int], Dict[str, Dict[str, object]]] = {}
    for r in rows:
        cells.setdefault((r['model'], r['epochs']), {})[r['variant']] = r
    lines = ['| family | native norm | optimiser | epochs | native: lr, top-1 | patchnorm: lr, top-1 | '
             "patchnorm, timm's init: lr, top-1 | GroupNorm: lr, top-1 | patchnorm_ws: lr, top-1 | "
             'patchnorm - native [95% CI] | verdict | CPU-min |',
             '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|']

    usual_seeds = max(set(r['seeds'] for r in rows), key=[r['seeds'] for r in rows].count, default=0)

    def cell(r):
        if r is None:
            return ''
        edge = ' (grid edge)' if r['lr_at_grid_edge'] else ''
        seeds = f" ({r['seeds']} seeds)" if r['seeds'] != usual_seeds else ''
        return f"{r['lr']:.3g}{edge}, {_acc(r)}{seeds}"

    verdicts = []
    for (model, epochs), by in cells.items():
        if 'native' not in by or 'patchnorm' not in by:  # a partial record (`workers=0`)
            continue
        native, patch = by['native'], by['patchnorm']
        diff, half = difference_interval(patch['test_by_seed'], native['test_by_seed'])
        verdict = _verdict(diff, half)
        verdicts.append(dict(model=model, epochs=epochs, native_norm=native_norm(model), diff=diff, ci95=half,
                             verdict=verdict, native=native['test_mean'], patchnorm=patch['test_mean'],
                             lrs={v: r['lr'] for v, r in by.items()}))
        minutes = sum(r['cpu_s'] for r in by.values()) / 60
        lines.append(f"| {model} | {native_norm(model)} | {native['recipe']} | {epochs} | {cell(native)} | "
                     f"{cell(patch)} | {cell(by.get('patchnorm_timm_init'))} | {cell(by.get('groupnorm'))} | "
                     f"{cell(by.get('patchnorm_ws'))} | "
                     f"**{diff:+.2f}** [{diff - half:+.2f}, "
                     f"{diff + half:+.2f}] | {verdict} | {minutes:.1f} |")
    counts = {v: sum(c['verdict'] == v for c in verdicts) for v in ('held', 'not held', 'within noise')}
    noise = seed_pair_noise(rows)
    lines += ['', 'verdict: PatchNorm above its native norm (held), below (not held) or neither (within noise), by '
              'the 95% Welch interval of the difference of the seeds\' means; '
              + ', '.join(f'{k} {n}' for k, n in counts.items()) + ' (rows)',
              '', f"two runs trained alike (two seeds of one row, rows above {TRAINED_TOP1:g}% top-1) differ by "
              f"{noise['median']:.2f} points of top-1 at the median (quartiles {noise['p25']:.2f}-{noise['p75']:.2f}, "
              f"{noise['pairs']} pairs)"]
    return dict(cells=verdicts, counts=counts, seed_pairs=noise), '\n'.join(lines) + '\n'


#: rows at or below this test top-1 did not train: their seeds' differences say nothing about noise
TRAINED_TOP1 = 50.0


def seed_pair_noise(rows: Sequence[Dict[str, object]]) -> Dict[str, float]:
    """How far apart two runs trained alike land: the absolute difference of test top-1 of every pair of seeds
    of one row (rows whose mean is above `TRAINED_TOP1`), its median and quartiles."""
    # DeiT's tiny model is ViT's: its rows repeat ViT's runs and are counted once
    runs = {tuple(r['test_by_seed']) for r in rows if r['test_mean'] > TRAINED_TOP1}
    pairs = [abs(a - b) for seeds in runs for i, a in enumerate(seeds) for b in seeds[i + 1:]]
    if not pairs:
        return dict(pairs=0, median=math.nan, p25=math.nan, p75=math.nan)
    p25, median, p75 = np.percentile(pairs, [25, 50, 75])
    return dict(pairs=len(pairs), median=float(median), p25=float(p25), p75=float(p75))


def plot(experiment: str, rows: Sequence[Dict[str, object]], path: Path) -> None:
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
    elif experiment == 'families':
        _plot_families(plt, rows, path)
        return
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


def _plot_families(plt, rows: Sequence[Dict[str, object]], path: Path) -> None:
    """ Left: `patchnorm` minus the native norm per family with its 95% interval, at each budget. Right: top-1
    against the budget for the families trained longer. """
    analysis, _ = _families_analysis(rows)
    cells = analysis['cells']
    short = min((c['epochs'] for c in cells), default=0)
    models = list(dict.fromkeys(c['model'] for c in cells))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=80)
    for offset, epochs in enumerate(sorted({c['epochs'] for c in cells})):
        own = {c['model']: c for c in cells if c['epochs'] == epochs}
        ys = [i + 0.2 * offset for i, m in enumerate(models) if m in own]
        left.errorbar([own[m]['diff'] for m in models if m in own], ys,
                      xerr=[own[m]['ci95'] for m in models if m in own], fmt='o', ms=3, capsize=2,
                      label=f'{epochs} epochs')
    left.axvline(0, color='grey', lw=0.8)
    left.set_yticks(range(len(models)))
    left.set_yticklabels(models, fontsize=7)
    left.invert_yaxis()
    left.set_xlabel('patchnorm - native norm, test top-1 points (95% CI)', fontsize=7)
    left.legend(fontsize=6)
    longer = [m for m in models if any(c['model'] == m and c['epochs'] > short for c in cells)]
    for i, model in enumerate(longer):
        for variant, style in (('native', '--'), ('patchnorm', '-')):
            own = sorted((r for r in rows if r['model'] == model and r['variant'] == variant),
                         key=lambda r: r['epochs'])
            right.errorbar([r['epochs'] for r in own], [r['test_mean'] for r in own],
                           yerr=[r['test_std'] for r in own], ls=style, marker='o', ms=3, capsize=2,
                           color=f'C{i}', label=f'{model} {variant}')
    right.set_xlabel('epochs (budget)', fontsize=7)
    right.set_ylabel('test top-1 %', fontsize=7)
    right.set_title('trained longer where the norms differed by more than the gap', fontsize=8)
    if longer:
        right.legend(fontsize=5)
    for ax in (left, right):
        ax.tick_params(labelsize=7)
    fig.suptitle('Fashion-MNIST 32x32, from scratch: patchnorm against each family\'s own norm', fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


ANALYSES = dict(mlp=_mlp_analysis, batch=_batch_analysis, conv=_conv_table, families=_families_analysis)

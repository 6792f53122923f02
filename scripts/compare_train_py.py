#!/usr/bin/env python3
"""`timm-affinediv finetune` against timm's own train.py: the same model, data, recipe and seeds, side by side.

    python scripts/compare_train_py.py PATH/TO/pytorch-image-models [--seeds 0 1 2] [--train-images 6000]

Both train a narrow patchnorm resnet18 (channels 16-128) on the same Fashion-MNIST image folder (a fixed subset,
written as PNGs to a temporary folder, 32x32 grayscale) with the same command-line recipe, RandAugment + mixup,
flags spelled the same for both: train.py takes them with `--device-modules timm_affinediv`. Runs alternate
(train.py, finetune, per seed) so that a change in machine load hits both. Printed per run: training images/s
(each tool's own epoch average, data loading included, mean over the epochs) and the final validation top-1;
then the mean ratio of images/s and the top-1 mean and spread of each tool over the seeds.

timm's train.py is not in timm's wheel: pass a checkout of https://github.com/huggingface/pytorch-image-models,
best at the tag of the installed timm (`git checkout v1.0.31`). train.py runs with the installed timm, not the
checkout's (`python script.py` would put the checkout first on sys.path): it is started through `runpy` from
another folder, as `python -P train.py` does on Python 3.11+. Printed first: the train.py commit, the checkout's
timm version, and the timm that train.py and finetune imported.
"""
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timm_affinediv.cli import run_main
from timm_affinediv.commands import command_parser

NARROW = ['norm_layer=patchnorm', 'channels=(16,32,64,128)', 'stem_width=16']



def recipe(epochs: int, batch_size: int, workers: int, seed: int) -> list:
    """The flags both tools take with the same meaning (timm's train.py names)."""
    return [
        '--model', 'resnet18', '--model-kwargs', *NARROW, '--num-classes', '10', '--in-chans', '1',
        '--input-size', '1', '32', '32', '--mean', '0.286', '--std', '0.353', '--interpolation', 'bilinear',
        '--crop-pct', '1.0', '--train-interpolation', 'bilinear', '--scale', '0.75', '1.0', '--color-jitter', '0',
        '--aa', 'rand-m9-mstd0.5', '--mixup', '0.2', '--smoothing', '0.1', '--opt', 'adamw', '--lr', '2e-3',
        '--weight-decay', '0.05', '--sched', 'cosine', '--warmup-epochs', '0', '--epochs', str(epochs),
        '-b', str(batch_size), '-j', str(workers), '--seed', str(seed), '--dataset', '', '--device', 'cpu']


def write_image_folder(root: Path, train_images: int, val_images: int) -> None:
    """Fashion-MNIST subsets as `<root>/{train,validation}/<class>/<index>.png` (fixed: the first images)."""
    from timm_affinediv.data import FashionMNIST
    for split, source, count in (('train', 'train', train_images), ('validation', 'test', val_images)):
        data = FashionMNIST(split=source)
        for c in range(10):
            (root / split / str(c)).mkdir(parents=True)
        for i in range(count):
            img, label = data[i]
            img.save(root / split / str(label) / f'{i:05d}.png')


# runs a script with the installed packages: `-c` puts only the working folder (not the checkout) on sys.path, and
# the timm train.py imported is reported first
_RUN_WITH_INSTALLED_TIMM = (
    "import runpy, sys, timm; print(f'[timm {timm.__version__} {timm.__file__}]', flush=True); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def describe_checkout(timm_dir: Path) -> str:
    """The checkout's commit (and tag) and the timm version it holds."""
    def git(*args: str) -> str:
        done = subprocess.run(['git', '-C', str(timm_dir), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ''

    commit = git('rev-parse', 'HEAD') or 'unknown commit (not a git checkout)'
    tag = git('describe', '--tags', '--exact-match')
    version = re.search(r"__version__\s*=\s*'([^']+)'", (timm_dir / 'timm' / 'version.py').read_text()) \
        if (timm_dir / 'timm' / 'version.py').is_file() else None
    return (f"train.py of {timm_dir} at {commit}{f' ({tag})' if tag else ''}, whose timm is "
            f"{version.group(1) if version else 'unknown'}")


def run_train_py(timm_dir: Path, data: Path, out: Path, flags: list) -> dict:
    cmd = [sys.executable, '-c', _RUN_WITH_INSTALLED_TIMM, str(timm_dir / 'train.py'), '--data-dir', str(data),
           '--device-modules', 'timm_affinediv', '--sched-on-updates', '--output', str(out), '--experiment', 'run',
           '--log-interval', '10', '--checkpoint-hist', '1', *flags]
    log = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    if log.returncode:
        raise SystemExit(f'train.py failed:\n{log.stderr[-3000:]}')
    text = log.stdout + log.stderr
    imported = re.search(r'\[timm (\S+) (\S+)\]', text)
    if imported is None or Path(imported.group(2)).resolve().is_relative_to(timm_dir.resolve()):
        raise SystemExit(f"train.py imported the checkout's timm, not the installed one: {imported and imported[0]}")
    # the last 'Train: E [i/n] ... (0.123s,  520.3/s)' line of each epoch holds that epoch's average rate
    rates = {}
    for epoch, rate in re.findall(r'Train: (\d+) \[.*?\(\s*[\d.]+s,\s*([\d.]+)/s\)', text):
        rates[int(epoch)] = float(rate)
    with open(out / 'run' / 'summary.csv') as f:
        rows = list(csv.DictReader(f))
    return dict(img_s=statistics.mean(rates.values()), top1=float(rows[-1]['eval_top1']), timm=imported.group(1))


def run_finetune(data: Path, out: Path, flags: list) -> dict:
    cmd = [sys.executable, '-m', 'timm_affinediv', 'finetune', '--data-dir', str(data), '--output', str(out),
           '--no-progress', '--log-interval', '10', *flags]
    log = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)  # the installed package, not a checkout
    if log.returncode:
        raise SystemExit(f'finetune failed:\n{log.stderr[-3000:]}')
    history = json.loads((out / 'metrics.json').read_text())
    return dict(img_s=statistics.mean(h['train_img_s'] for h in history), top1=history[-1]['val_top1'])


def main(argv=None) -> int:
    p = command_parser('compare_train_py', __doc__, prog='scripts/compare_train_py.py')
    p.add_argument('timm_dir', type=Path, help='a checkout of pytorch-image-models (holding train.py)')
    p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    p.add_argument('--train-images', type=int, default=6000)
    p.add_argument('--val-images', type=int, default=2000)
    p.add_argument('--epochs', type=int, default=3)
    p.add_argument('-b', '--batch-size', type=int, default=64)
    p.add_argument('-j', '--workers', type=int, default=2)
    args = p.parse_args(argv)
    if not (args.timm_dir / 'train.py').is_file():
        raise SystemExit(f'{args.timm_dir} holds no train.py: give a checkout of pytorch-image-models.')
    import timm
    print(f'{describe_checkout(args.timm_dir)}; run with the installed timm {timm.__version__} ({timm.__file__})',
          flush=True)
    work = Path(tempfile.mkdtemp(prefix='compare-train-py-'))
    try:
        write_image_folder(work / 'data', args.train_images, args.val_images)
        rows = []
        for seed in args.seeds:
            flags = recipe(args.epochs, args.batch_size, args.workers, seed)
            start = time.perf_counter()
            timm_run = run_train_py(args.timm_dir.resolve(), work / 'data', work / f'train_py-{seed}', flags)
            ours = run_finetune(work / 'data', work / f'finetune-{seed}', flags)
            if timm_run['timm'] != timm.__version__:
                raise SystemExit(f"train.py ran with timm {timm_run['timm']}, finetune with {timm.__version__}")
            rows.append((seed, timm_run, ours))
            print(f'seed {seed}: train.py {timm_run["img_s"]:.0f} img/s top-1 {timm_run["top1"]:.2f} | finetune '
                  f'{ours["img_s"]:.0f} img/s top-1 {ours["top1"]:.2f} ({time.perf_counter() - start:.0f} s)',
                  flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratios = [o['img_s'] / t['img_s'] for _, t, o in rows]
    print(f'\nnarrow patchnorm resnet18, Fashion-MNIST {args.train_images} train / {args.val_images} validation '
          f'images (32x32), {args.epochs} epochs, batch {args.batch_size}, {args.workers} workers, RandAugment + '
          f'mixup, CPU ({os.cpu_count()} cores)')
    print('| seed | train.py img/s | finetune img/s | ratio | train.py top-1 | finetune top-1 |')
    print('|---|---|---|---|---|---|')
    for (seed, t, o), ratio in zip(rows, ratios):
        print(f'| {seed} | {t["img_s"]:.0f} | {o["img_s"]:.0f} | {ratio:.3f} | {t["top1"]:.2f} | {o["top1"]:.2f} |')
    for name, index in (('train.py', 1), ('finetune', 2)):
        top1 = [r[index]['top1'] for r in rows]
        spread = statistics.stdev(top1) if len(top1) > 1 else 0.
        print(f'{name}: top-1 {statistics.mean(top1):.2f} +- {spread:.2f} (mean +- sd over {len(top1)} seeds)')
    print(f'images/s finetune / train.py: {statistics.mean(ratios):.3f} (mean over seeds)')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

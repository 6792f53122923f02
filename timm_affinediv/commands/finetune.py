"""Train or fine-tune a timm model (PatchNorm or any other) on Fashion-MNIST or any dataset of timm's
`create_dataset` (image folder, torch/NAME, hfds/NAME, and the streams wds/NAME, hfids/NAME, tfds/NAME).

Flags, and the defaults of timm's recipe flags, follow timm's train.py. One process:
    timm-affinediv finetune --model resnet18 --num-classes 10 --epochs 5 --output runs/r18
Fine-tune a converted model with distillation from the original:
    timm-affinediv finetune --model resnet18 --norm-layer patchnorm --initial-checkpoint converted/ \\
        --teacher resnet18 --teacher-checkpoint original/ --distill-weight 0.5 --epochs 3 --output runs/r18-pn
Several processes (DistributedDataParallel; gloo on CPU, nccl on CUDA):
    torchrun --nproc_per_node=2 -m timm_affinediv finetune --model resnet18 --num-classes 10 --epochs 5 \\
        --output runs/ddp
A timm recipe (the args.yaml train.py writes; flags given override it), with RandAugment, mixup and cutmix:
    timm-affinediv finetune --config args.yaml --model resnet18 --norm-layer patchnorm --output runs/recipe
    timm-affinediv finetune --model resnet18 --num-classes 10 --aa rand-m9-mstd0.5 --mixup 0.2 --cutmix 1.0 \\
        --reprob 0.25 --opt lamb --lr-base 5e-3 --epochs 5 --output runs/r18-recipe
Resume (same result as an uninterrupted run, bit for bit): the same command with --resume
    timm-affinediv finetune --model resnet18 --num-classes 10 --epochs 5 --output runs/r18 --resume runs/r18
A streamed dataset (wds/, hfids/, tfds/) resumes at the last epoch boundary: the epoch a stop interrupted
restarts from its beginning, so the resumed run is equivalent to, not bit for bit, an uninterrupted one.
"""
import argparse
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import torch
from timm.utils import ParseKwargs, setup_default_logging

from timm_affinediv.cli import (
    add_data_args,
    add_model_args,
    existing_path,
    non_negative_int,
    norm_name,
    positive_float,
    positive_int,
    refuse_existing_output,
    run_main,
    timm_model_name,
    unit_interval,
)
from timm_affinediv.commands import command_parser
from timm_affinediv.commands.recipe_args import add_recipe_arguments, parse_with_config
from timm_affinediv.data import DataError
from timm_affinediv.publish import publish_run
from timm_affinediv.train import (
    EVAL_METRICS,
    NonFiniteLossError,
    TrainConfig,
    Trainer,
    TrainingError,
    TrainingInterrupted,
    final_top1,
)

_logger = logging.getLogger('finetune')


def add_model_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The shared model flags (`timm_affinediv.cli.add_model_args`) and `--norm-layer`."""
    g = add_model_args(
        p, model_type=timm_model_name, default=d.model, checkpoint=('--initial-checkpoint', '--checkpoint'),
        checkpoint_type=existing_path, help={
            '--model': f'timm model name (default: {d.model})',
            '--pretrained': 'start from timm pretrained weights',
            '--checkpoint': 'weights to start from (.safetensors / .pth, or a Hub-format folder)',
            '--num-classes': 'classes of the head; a head that does not match is replaced by a new one',
            '--in-chans': 'image channels for image folders (Fashion-MNIST: 1)',
            '--model-kwargs': 'extra timm.create_model arguments, e.g. drop_rate=0.1'})
    g.add_argument('--norm-layer', type=norm_name, help="norm layer passed to timm.create_model (e.g. 'patchnorm')")


def add_data_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """`--dataset`/`--data-dir` (`timm_affinediv.cli.add_data_args`), splits, sizes, loading and augmentation."""
    g = add_data_args(p, default='fashion-mnist', any_dataset=True)
    g.add_argument('--train-split', default=d.train_split)
    g.add_argument('--val-split', default=d.val_split)
    g.add_argument('--img-size', type=positive_int,
                   help='input size (default: 32 for Fashion-MNIST, else the model\'s)')
    g.add_argument('--train-subset', type=positive_int, help='train on a fixed random subset of N images')
    g.add_argument('--val-subset', type=positive_int, help='evaluate on a fixed random subset of N images')
    g.add_argument('-b', '--batch-size', type=positive_int, default=d.batch_size, help='batch size per process')
    g.add_argument('-vb', '--validation-batch-size', type=positive_int)
    g.add_argument('-j', '--workers', type=non_negative_int, default=d.workers,
                   help='data loading processes per process')
    g.add_argument('--no-prefetcher', action='store_true',
                   help="timm train.py's: normalise and erase in the workers and mix in this process, instead of "
                        'sending uint8 batches (mixed by FastCollateMixup) and finishing them on the device')


def add_precision_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """AMP, gradient accumulation, EMA (timm's recipe flags: `recipe_args.add_recipe_arguments`)."""
    g = p.add_argument_group('precision, accumulation, EMA')
    g.add_argument('--amp', action='store_true', help='mixed precision (bfloat16 on CPU, float16 on CUDA)')
    g.add_argument('--amp-dtype', choices=('bfloat16', 'float16'))
    g.add_argument('--grad-accum-steps', type=positive_int, default=d.grad_accum_steps)
    g.add_argument('--model-ema', action='store_true', help='keep (and publish) EMA weights')
    g.add_argument('--model-ema-decay', type=unit_interval, default=d.model_ema_decay)
    g.add_argument('--model-ema-warmup', action='store_true')


def add_distillation_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """The teacher and the distillation loss."""
    g = p.add_argument_group('distillation')
    g.add_argument('--teacher', type=timm_model_name,
                   help='timm model name of the teacher (e.g. the unconverted model)')
    g.add_argument('--teacher-checkpoint', metavar='PATH', type=existing_path,
                   help='teacher weights (file or Hub-format folder)')
    g.add_argument('--teacher-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE')
    g.add_argument('--distill-weight', type=unit_interval, default=d.distill_weight, help='weight of the KD loss, 0..1')
    g.add_argument('--distill-temperature', type=positive_float, default=d.distill_temperature)


def add_run_group(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Seed, device, output, resume and logging."""
    g = p.add_argument_group('run')
    g.add_argument('--seed', type=int, default=d.seed)
    g.add_argument('--device', help="'cpu' or 'cuda' (default: cuda if available)")
    g.add_argument('--output', default=d.output, help='output folder (checkpoints, logs, model.safetensors)')
    g.add_argument('--overwrite', action='store_true',
                   help='write into an --output that holds an earlier run (its files of the same names are replaced)')
    g.add_argument('--resume', metavar='PATH', type=existing_path,
                   help='continue from a run folder or checkpoint folder, bit for bit; a streamed dataset (wds/, '
                        'hfids/, tfds/) continues from the last epoch boundary')
    g.add_argument('--no-resume-opt', action='store_true',
                   help='with --resume, restore the weights but not the optimiser state (not bit for bit then)')
    g.add_argument('--eval-metric', default=d.eval_metric, choices=EVAL_METRICS,
                   help='validation metric that picks the best checkpoint and drives --sched plateau')
    g.add_argument('--checkpoint-hist', type=positive_int, default=d.checkpoint_hist, help='epoch checkpoints to keep')
    g.add_argument('--log-interval', type=positive_int, default=d.log_interval,
                   help='updates between loss checks, and between log lines when there are no progress bars')
    g.add_argument('--no-progress', dest='progress', action='store_false', default=None,
                   help='no progress bars (default: bars when stderr is a terminal, else a log line every '
                        '--log-interval updates)')


#: The flag groups of the command line, in --help order; each adds flags whose `dest` is a `TrainConfig` field.
FLAG_GROUPS = (add_model_group, add_data_group, add_recipe_arguments, add_precision_group, add_distillation_group,
               add_run_group)


def build_parser() -> argparse.ArgumentParser:
    """The command line; each flag's `dest` is a `TrainConfig` field, but `--overwrite`."""
    d = TrainConfig()
    p = command_parser('finetune', __doc__)
    p.add_argument('-c', '--config', metavar='FILE',
                   help="a timm train.py args.yaml whose settings are the defaults (machine settings left out)")
    for add_group in FLAG_GROUPS:
        add_group(p, d)
    return p


def _resumes_into(resume: Optional[str], output: str) -> bool:
    """Whether `--resume` continues the run in `output` (its folder or one of its checkpoints)."""
    return bool(resume) and Path(output).resolve() in (Path(resume).resolve(), *Path(resume).resolve().parents)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command line; return the exit status (0 done, 1 failed, 2 bad input, 130 interrupted)."""
    setup_default_logging(default_level=logging.INFO if os.environ.get('RANK', '0') == '0' else logging.WARNING)
    namespace, from_config = parse_with_config(build_parser(), argv)
    args = vars(namespace)
    config = args.pop('config')
    if config:
        _logger.info(f'recipe from {config}: {len(from_config)} settings, the flags given over them')
    if not args.pop('overwrite') and not _resumes_into(args['resume'], args['output']):
        refuse_existing_output(args['output'], flag='--overwrite, or --resume to continue that run,')
    cfg = TrainConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items() if v is not None})
    try:
        trainer = Trainer(cfg)
        result = trainer.fit()
    except TrainingInterrupted as e:
        _logger.warning(f'{e}; continue with --resume {cfg.output}')
        return 130
    except NonFiniteLossError as e:
        _logger.error(str(e))
        return 1
    except (DataError, TrainingError) as e:
        _logger.error(str(e))
        return 2
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if trainer.is_primary:
        base_model = trainer.model.pretrained_cfg.get('hf_hub_id') if cfg.pretrained else None
        source = f'fine-tuned from the weights in {cfg.initial_checkpoint}' if cfg.initial_checkpoint else None
        folder = publish_run(result, dataset=cfg.dataset, data_dir=cfg.data_dir, base_model=base_model,
                             base_model_description=source, overwrite=True)
        _logger.info(f"done: top-1 {final_top1(result.metrics):.2f}%, Hub-ready folder {folder}")
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

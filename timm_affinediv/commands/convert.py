"""Convert a trained BatchNorm/LayerNorm timm model to PatchNorm and write a Hub-ready folder.

    timm-affinediv convert --model resnet18 --checkpoint model.safetensors --num-classes 10 --in-chans 1 \\
        --dataset fashion-mnist --calib-batches 32 --output runs/resnet18-patchnorm
    timm-affinediv convert --model local-dir:runs/baseline --output runs/converted
    timm-affinediv convert --model resnet50.a1_in1k --pretrained --dataset '' --data-dir PATH --calib-images 1024 \\
        --eval-images 0 --output runs/resnet50-patchnorm
    timm-affinediv convert --model local-dir:runs/baseline --output runs/recovered --recover --recover-epochs 0.25

`--dataset` takes what `timm-affinediv finetune` reads (an image folder: `--dataset '' --data-dir PATH`; timm's
`torch/`, `hfds/`, `hfids/`, `wds/`, `tfds/`). Three disjoint draws of its training split: the calibration and
held-out images, read with the model's eval transforms, and the distillation images, with train-time augmentation.
The held-out agreement after the fit decides whether the model is distilled. The folder reloads with
`timm.create_model("local-dir:DIR", pretrained=True)` after `import timm_affinediv`.

`--recover` goes on to recover accuracy with the labels (`timm_affinediv.recover`): the converted model is fine-tuned
on the labelled training split with the original as teacher, for a budget of `--recover-epochs` (a fraction is that
share of the split's images, the schedule spanning exactly it), evaluated on the validation split as it goes and
stopped at the budget's end, at `--recover-target` or after `--recover-patience` evaluations worse than the best on
held-out loss by more than its noise. The peak rate is `--recover-lr`, or by default the best of a short sweep over
`--recover-lr-sweep` on the held-out images, its images counted in those spent.
`--output` is then the run folder: `converted/` (the conversion's Hub folder), the checkpoints and curves,
recovery_report.json, and `model/`, the recovered model's Hub folder, whose card gives the original's, the converted
and the recovered top-1 and the images spent. An interrupted recovery continues with the same command and `--resume`.
"""
import argparse
import logging
import sys
from pathlib import Path
from typing import Optional

import timm_affinediv  # noqa: F401  (registers the layers with timm)
from timm_affinediv.cli import (
    add_data_args,
    add_model_args,
    create_model_kwargs,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    refuse_existing_output,
    run_main,
    unit_interval,
)
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import CONVERSION_NORMS, ConvertOptions, DistillOptions, FitOptions, ReconstructOptions
from timm_affinediv.errors import CheckpointError
from timm_affinediv.model_io import DISTILL_IMAGES, HELDOUT_IMAGES, convert_to_folder, load_trained_model
from timm_affinediv.recover import CONVERTED_FOLDER, REPORT_NAME, RecoverOptions, recover_model
from timm_affinediv.train import TrainConfig, TrainingInterrupted


def add_conversion_args(parser: argparse.ArgumentParser) -> None:
    """ The conversion's flags, one group for each part of `ConvertOptions` (`convert_options` maps them onto it),
    each with the image counts it reads."""
    fit, d, r = FitOptions, DistillOptions, ReconstructOptions
    group = parser.add_argument_group('calibration and the least-squares fit (FitOptions)')
    group.add_argument('--calib-batches', type=non_negative_int, default=32, help='0: the analytic map only')
    group.add_argument('--calib-images', type=non_negative_int,
                       help='calibration images, the first of a fixed random order of the training split '
                            '(default: --calib-batches x --batch-size)')
    group.add_argument('-b', '--batch-size', type=positive_int, default=64)
    group.add_argument('--ridge', type=positive_float, default=fit.ridge,
                       help="the fit's pull towards the analytic map, relative to the normal equations' mean diagonal")
    group.add_argument('--positions-per-unknown', type=positive_float, default=fit.positions_per_unknown,
                       help="output positions sampled for a layer's fit, per unknown")
    group.add_argument('--calib-memory', type=positive_float, default=fit.calib_memory / 2 ** 30,
                       help='GiB of activations kept in memory during calibration; beyond it they spill to disk')
    group = parser.add_argument_group(
        'distillation after the fit, where the held-out agreement is under --distill-threshold (DistillOptions)')
    group.add_argument('--heldout-images', type=non_negative_int, default=HELDOUT_IMAGES,
                       help='training images after the calibration ones, neither fitted nor distilled on: the '
                            'agreement that triggers the distillation, stops it and is reported (0: measured on the '
                            'calibration images)')
    group.add_argument('--distill-images', type=non_negative_int, default=DISTILL_IMAGES,
                       help='training images after those, streamed with train-time augmentation, that the model is '
                            'distilled on (0: the calibration images)')
    group.add_argument('--distill-epochs', type=non_negative_int, default=d.epochs,
                       help='passes over the distillation images at most (0: no distillation)')
    group.add_argument('--distill-threshold', type=non_negative_float, default=d.threshold,
                       help='held-out top-1 agreement (0 to 1) under which the model is distilled (1: always)')
    group.add_argument('--distill-lr', type=positive_float, default=d.lr, help="Adam's peak learning rate")
    group.add_argument('--distill-patience', type=non_negative_int, default=d.patience,
                       help='stop after this many passes that do not lower the held-out KL')
    group = parser.add_argument_group('block reconstruction after the fit, before distillation (ReconstructOptions)')
    group.add_argument('--reconstruct-steps', type=non_negative_int, default=r.steps,
                       help='Adam steps per block at most, on the calibration images (0: none)')
    group.add_argument('--reconstruct-threshold', type=non_negative_float, default=r.threshold,
                       help="where the fitted model's logits have a relative squared error above this, the blocks "
                            'whose output has one above it are reconstructed (0: every block)')
    group.add_argument('--reconstruct-lr', type=positive_float, default=r.lr, help="Adam's learning rate")
    group = parser.add_argument_group('run')
    group.add_argument('--device', default='auto', choices=('auto', 'cpu', 'cuda'), help="'auto': CUDA when available")
    group.add_argument('--seed', type=non_negative_int, default=0,
                       help="seed of the fit's sampled positions and of the distillation's order and augmentation")


def convert_options(args: argparse.Namespace) -> ConvertOptions:
    """`ConvertOptions` of `add_conversion_args`' flags."""
    return ConvertOptions(
        fit=FitOptions(ridge=args.ridge, positions_per_unknown=args.positions_per_unknown,
                       calib_memory=int(args.calib_memory * 2 ** 30)),
        reconstruct=ReconstructOptions(steps=args.reconstruct_steps, threshold=args.reconstruct_threshold,
                                       lr=args.reconstruct_lr),
        distill=DistillOptions(epochs=args.distill_epochs, threshold=args.distill_threshold, lr=args.distill_lr,
                               patience=args.distill_patience, batch_size=args.batch_size),
        device=args.device, progress=True, seed=args.seed)


def top1_percent(text: str) -> float:
    """A top-1 accuracy in %: a number in (0, 100]."""
    value = positive_float(text)
    if value > 100:
        raise argparse.ArgumentTypeError(f'{text} is not a top-1 in % (a number in (0, 100])')
    return value


def add_recovery_args(parser: argparse.ArgumentParser) -> None:
    """ The recovery's flags (`RecoverOptions`, and the run's data and machine), in their own group."""
    r = RecoverOptions
    group = parser.add_argument_group('recovery with labels after the conversion (RecoverOptions)')
    group.add_argument('--recover', action='store_true',
                       help='fine-tune the converted model on the labelled training split with the original as '
                            'teacher; --output is then the run folder (converted/, checkpoints, model/)')
    group.add_argument('--recover-epochs', type=positive_float, default=r.epochs,
                       help="the budget in epochs of the training split (0.25: a quarter of its images)")
    group.add_argument('--recover-evaluations', type=positive_int, default=r.evaluations,
                       help='held-out evaluations spread evenly over the budget, the last at its end')
    group.add_argument('--recover-metric', choices=('loss', 'top1'), default=r.metric,
                       help='what the evaluations, the stop rule and the rate sweep judge on (held-out)')
    group.add_argument('--recover-patience', type=non_negative_int, default=r.patience,
                       help='stop after this many evaluations worse than the best, keeping the best (0: never)')
    group.add_argument('--recover-stop-noise', type=non_negative_float, default=r.stop_noise, metavar='SE',
                       help='an evaluation is worse than the best only by more than this many standard errors')
    group.add_argument('--recover-target', type=top1_percent, metavar='TOP1',
                       help='stop at the first evaluation whose held-out top-1 (%%) reaches this')
    group.add_argument('--recover-lr', type=positive_float, default=r.lr,
                       help="the optimiser's peak learning rate (default: chosen by the sweep)")
    group.add_argument('--recover-lr-sweep', type=positive_float, nargs='+', default=list(r.lr_sweep), metavar='LR',
                       help='the peak rates the sweep tries, in short runs taking together --recover-sweep-share of '
                            'the budget')
    group.add_argument('--recover-sweep-share', type=unit_interval, default=r.sweep_share,
                       help="the share of the budget's images the rate sweep takes")
    group.add_argument('--recover-warmup', type=unit_interval, default=r.warmup,
                       help='the fraction of the budget the learning rate warms up over (then a cosine to 0)')
    group.add_argument('--recover-batch-size', type=positive_int, default=r.batch_size)
    group.add_argument('--recover-distill-weight', type=unit_interval, default=r.distill_weight,
                       help="the weight of the original's logits in the loss (the rest: the labels')")
    group.add_argument('--recover-temperature', type=positive_float, default=r.distill_temperature,
                       help="the distillation's temperature")
    group.add_argument('--recover-scale', type=unit_interval, nargs=2, default=r.scale, metavar=('MIN', 'MAX'),
                       help='the area range of random resized crops (1 1: the whole image, as evaluated)')
    group.add_argument('--recover-hflip', type=unit_interval, default=r.hflip,
                       help='the probability of a horizontal flip')
    group.add_argument('--recover-mixup', type=non_negative_float, default=r.mixup, metavar='ALPHA',
                       help="timm's mixup alpha, the original seeing the same mixed images (0: off)")
    group.add_argument('--recover-keep-trained', action='store_true',
                       help='return the trained model even where it is not better than the converted one on '
                            'held-out --recover-metric (by default the converted model is kept then)')
    group.add_argument('--recover-train-images', type=positive_int, metavar='N',
                       help='train on a fixed random N of the training split (the budget is in epochs of them)')
    group.add_argument('--recover-val-images', type=positive_int, metavar='N',
                       help='the held-out top-1 on a fixed random N of the validation split (default: all of it)')
    group.add_argument('--workers', type=non_negative_int, default=TrainConfig.workers,
                       help='data loading processes of the recovery')
    group.add_argument('--resume', action='store_true',
                       help='continue the interrupted recovery of --output (its converted/ and checkpoints)')


def recover_options(args: argparse.Namespace) -> RecoverOptions:
    """`RecoverOptions` of `add_recovery_args`' flags, checked."""
    options = RecoverOptions(
        epochs=args.recover_epochs, evaluations=args.recover_evaluations, patience=args.recover_patience or None,
        metric=args.recover_metric, stop_noise=args.recover_stop_noise, target_top1=args.recover_target,
        lr=args.recover_lr, lr_sweep=tuple(args.recover_lr_sweep), sweep_share=args.recover_sweep_share,
        warmup=args.recover_warmup,
        batch_size=args.recover_batch_size, distill_weight=args.recover_distill_weight,
        distill_temperature=args.recover_temperature, scale=tuple(args.recover_scale), hflip=args.recover_hflip,
        mixup=args.recover_mixup, keep_converted=not args.recover_keep_trained, seed=args.seed)
    options.validate()
    return options


def main(argv=None) -> int:
    parser = command_parser('convert', __doc__)
    add_model_args(parser, help={'--num-classes': 'classes of the checkpoint (timm model name only)',
                                 '--in-chans': 'input channels of the checkpoint (timm model name only)'})
    group = add_data_args(parser, old_source_flags=('--calib-data',), any_dataset=True)
    group.add_argument('--eval-images', type=non_negative_int,
                       help='validation images for the top-1 figures (default: all; 0: no evaluation)')
    parser.add_argument('--norm', default='patchnorm', choices=CONVERSION_NORMS)
    parser.add_argument('--output', required=True,
                        help='the Hub-format folder (with --recover: the run folder, holding it in converted/)')
    parser.add_argument('--overwrite', action='store_true', help='replace an existing output folder')
    add_conversion_args(parser)
    add_recovery_args(parser)
    args = parser.parse_args(argv)
    if args.resume and not args.recover:
        parser.error('--resume continues an interrupted recovery: add --recover')
    options = recover_options(args) if args.recover else None
    folder = Path(args.output) / CONVERTED_FOLDER if args.recover else Path(args.output)
    if args.resume and not (folder / 'config.json').is_file():
        raise CheckpointError(f'{args.output} holds no converted model ({folder}/config.json) to resume the recovery '
                              'of: run the command without --resume to convert and recover anew.')
    if not args.overwrite and not args.resume:
        refuse_existing_output(args.output)
    logging.basicConfig(level=logging.INFO, format='%(message)s')

    model = load_trained_model(args.model, args.checkpoint, pretrained=args.pretrained, **create_model_kwargs(args))
    base_model = args.model[len('hf-hub:'):] if args.model.startswith('hf-hub:') else (
        model.pretrained_cfg.get('hf_hub_id') if args.pretrained else None)
    if args.resume:
        converted = load_trained_model(f'local-dir:{folder}')
    else:
        converted, report, metrics = convert_to_folder(
            model, str(folder), norm=args.norm, dataset=args.dataset, data_dir=args.data_dir,
            calib_batches=args.calib_batches, batch_size=args.batch_size, calib_images=args.calib_images,
            heldout_images=args.heldout_images, distill_images=args.distill_images, eval_images=args.eval_images,
            options=convert_options(args), base_model=base_model, overwrite=args.overwrite, **args.model_kwargs)
        print(report.format_table())
        print(report.describe())
        if 'converted' in metrics:
            print(f"top-1: original {metrics['original']['top1']:.2f}%, converted {metrics['converted']['top1']:.2f}%")
        print(f'wrote {folder.resolve()} (conversion_report.json beside the weights)')
    return _recover(args, model, converted, options, base_model) if options else 0


def _recover(args: argparse.Namespace, model, converted, options: RecoverOptions, base_model: Optional[str]) -> int:
    """The recovery after the conversion; 130 where it was interrupted (after a checkpoint)."""
    train = TrainConfig(dataset=args.dataset, data_dir=args.data_dir, train_subset=args.recover_train_images,
                        val_subset=args.recover_val_images, workers=args.workers,
                        device=None if args.device == 'auto' else args.device, output=args.output,
                        resume=args.output if args.resume else None)
    try:
        _, report = recover_model(
            model, converted, options, train=train, base_model=base_model,
            base_model_description=f'converted to PatchNorm ({Path(args.output) / CONVERTED_FOLDER}), then '
                                   'fine-tuned with labels and the original as teacher')
    except TrainingInterrupted as e:
        print(f'{e}; continue with the same command and --resume', file=sys.stderr)
        return 130
    print(report.describe())
    print(f"wrote {(Path(args.output) / 'model').resolve()} ({REPORT_NAME} beside the weights and in "
          f'{Path(args.output).resolve()})')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

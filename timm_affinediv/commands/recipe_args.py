"""timm's recipe flags for `finetune`: the names, meanings and (for what fine-tuning does not change) the defaults
of timm's `train.py`, grouped as train.py groups them. Each flag's `dest` is a `TrainConfig` field.

`--config FILE` reads a train.py `args.yaml` (`load_timm_args`) into the parser's defaults before the command line
is parsed, as train.py does, so a published recipe is reused as it is and any flag given overrides it.
"""
import argparse
from typing import List, Optional, Sequence, Tuple

from timm.optim import list_optimizers
from timm.utils import ParseKwargs

from timm_affinediv.cli import non_negative_float, non_negative_int, positive_float, positive_int, unit_interval
from timm_affinediv.train import TrainConfig, load_timm_args

__all__ = ['add_recipe_arguments', 'parse_with_config']


def add_recipe_arguments(p: argparse.ArgumentParser, d: TrainConfig) -> None:
    """Add train.py's model-regularisation, input, augmentation, mixup/loss, optimiser and schedule flags."""
    g = p.add_argument_group('model regularisation and speed (timm train.py)')
    g.add_argument('--drop', type=unit_interval, default=d.drop, metavar='PCT', help='dropout rate')
    g.add_argument('--drop-path', type=unit_interval, metavar='PCT', help='drop path (stochastic depth) rate')
    g.add_argument('--drop-block', type=unit_interval, metavar='PCT', help='drop block rate')
    g.add_argument('--gp', metavar='POOL', help="global pool type ('avg', 'max', 'avgmax', 'catavgmax')")
    g.add_argument('--bn-momentum', type=unit_interval, help='BatchNorm momentum (EfficientNet-family models)')
    g.add_argument('--bn-eps', type=positive_float, help='BatchNorm epsilon (EfficientNet-family models)')
    g.add_argument('--head-init-scale', type=float, metavar='SCALE', help="scale the head's initial weight and bias")
    g.add_argument('--head-init-bias', type=float, metavar='BIAS', help="set the head's initial bias")
    g.add_argument('--grad-checkpointing', action='store_true', help='gradient checkpointing through blocks/stages')
    g.add_argument('--channels-last', action='store_true', help='channels_last memory layout')
    g.add_argument('--torchcompile', nargs='?', const='inductor', metavar='BACKEND',
                   help='torch.compile the training forward (default backend: inductor); checkpoints keep the '
                        'uncompiled parameter names')
    g.add_argument('--torchcompile-mode', metavar='MODE', help='torch.compile mode')

    g = p.add_argument_group('input (timm resolve_data_config; default: the dataset\'s, else the model\'s)')
    g.add_argument('--input-size', type=positive_int, nargs=3, metavar=('C', 'H', 'W'))
    g.add_argument('--crop-pct', type=positive_float, metavar='PCT', help='centre-crop fraction for evaluation')
    g.add_argument('--mean', type=float, nargs='+', metavar='MEAN')
    g.add_argument('--std', type=positive_float, nargs='+', metavar='STD')
    g.add_argument('--interpolation', default=d.interpolation, metavar='NAME',
                   help='resize interpolation (bilinear, bicubic, ...)')
    g.add_argument('--train-num-samples', type=positive_int, metavar='N',
                   help='samples per epoch of a streamed train split (wds/, hfids/, tfds/) without its count')
    g.add_argument('--val-num-samples', type=positive_int, metavar='N')

    g = p.add_argument_group('augmentation (timm create_transform)')
    g.add_argument('--no-aug', action='store_true', help='no training augmentation (overrides the others)')
    g.add_argument('--train-crop-mode', metavar='MODE', help="training crop mode ('rrc', 'rkrc', 'rkrr')")
    g.add_argument('--scale', type=unit_interval, nargs=2, default=d.scale, metavar=('MIN', 'MAX'),
                   help='random resized crop area range (default: %(default)s; train.py: 0.08 1.0)')
    g.add_argument('--ratio', type=positive_float, nargs=2, default=d.ratio, metavar=('MIN', 'MAX'),
                   help='random resized crop aspect ratio range')
    g.add_argument('--hflip', type=unit_interval, default=d.hflip, help='horizontal flip probability')
    g.add_argument('--vflip', type=unit_interval, default=d.vflip, help='vertical flip probability')
    g.add_argument('--color-jitter', type=non_negative_float, default=d.color_jitter, metavar='PCT',
                   help='colour jitter factor (default: %(default)s; train.py: 0.4)')
    g.add_argument('--color-jitter-prob', type=unit_interval, metavar='PCT')
    g.add_argument('--grayscale-prob', type=unit_interval, metavar='PCT')
    g.add_argument('--gaussian-blur-prob', type=unit_interval, metavar='PCT')
    g.add_argument('--aa', metavar='NAME', help="AutoAugment / RandAugment policy, e.g. 'rand-m9-mstd0.5-inc1'")
    g.add_argument('--reprob', type=unit_interval, default=d.reprob, metavar='PCT', help='random erase probability')
    g.add_argument('--remode', default=d.remode, choices=('pixel', 'rand', 'const'), help='random erase mode')
    g.add_argument('--recount', type=positive_int, default=d.recount, help='random erase count')
    g.add_argument('--train-interpolation', default=d.train_interpolation, metavar='NAME',
                   help="training resize interpolation ('random', 'bilinear', 'bicubic')")
    g.add_argument('--aug-repeats', type=non_negative_float, default=d.aug_repeats, metavar='N',
                   help="repeated augmentation: each image N times an epoch (timm's RepeatAugSampler; 0: off)")

    g = p.add_argument_group('mixup / cutmix (timm Mixup) and the loss')
    g.add_argument('--mixup', type=non_negative_float, default=d.mixup, help='mixup alpha, on if > 0')
    g.add_argument('--cutmix', type=non_negative_float, default=d.cutmix, help='cutmix alpha, on if > 0')
    g.add_argument('--cutmix-minmax', type=unit_interval, nargs=2, metavar=('MIN', 'MAX'),
                   help='cutmix min/max box ratio (overrides --cutmix alpha, turns cutmix on)')
    g.add_argument('--mixup-prob', type=unit_interval, default=d.mixup_prob,
                   help='probability of mixup or cutmix per batch / pair / element')
    g.add_argument('--mixup-switch-prob', type=unit_interval, default=d.mixup_switch_prob,
                   help='probability of cutmix instead of mixup when both are on')
    g.add_argument('--mixup-mode', default=d.mixup_mode, choices=('batch', 'pair', 'elem'))
    g.add_argument('--mixup-off-epoch', type=non_negative_int, default=d.mixup_off_epoch, metavar='N',
                   help='turn mixup off from this epoch (0: never)')
    g.add_argument('--smoothing', type=unit_interval, default=d.smoothing, help='label smoothing')
    g.add_argument('--bce-loss', action='store_true', help='binary cross-entropy loss (with or without mixup)')
    g.add_argument('--bce-sum', action='store_true', help='sum the BCE loss over classes')
    g.add_argument('--bce-target-thresh', type=unit_interval, help='binarise soft BCE targets at this threshold')
    g.add_argument('--bce-pos-weight', type=positive_float, help='positive weight of the BCE loss')

    g = p.add_argument_group('optimiser (timm create_optimizer_v2)')
    g.add_argument('--opt', default=d.opt, choices=list_optimizers(), metavar='OPT',
                   help='timm optimizer name (default: %(default)s; train.py: sgd)')
    g.add_argument('--opt-eps', type=positive_float, metavar='EPSILON', help='optimizer epsilon')
    g.add_argument('--opt-betas', type=float, nargs='+', metavar='BETA', help='optimizer betas')
    g.add_argument('--momentum', type=non_negative_float, default=d.momentum)
    g.add_argument('--weight-decay', type=non_negative_float, default=d.weight_decay,
                   help='weight decay (default: %(default)s; train.py: 2e-5)')
    g.add_argument('--clip-grad', type=positive_float, metavar='NORM', help='gradient clipping value')
    g.add_argument('--clip-mode', default=d.clip_mode, choices=('norm', 'value', 'agc'))
    g.add_argument('--layer-decay', type=positive_float, help='layer-wise learning-rate decay')
    g.add_argument('--layer-decay-min-scale', type=non_negative_float, default=d.layer_decay_min_scale)
    g.add_argument('--layer-decay-no-opt-scale', type=non_negative_float,
                   help='layers whose decayed scale falls below this are not optimised')
    g.add_argument('--opt-kwargs', nargs='*', default={}, action=ParseKwargs, metavar='KEY=VALUE',
                   help='extra optimizer arguments, e.g. amsgrad=True')

    g = p.add_argument_group('learning-rate schedule (timm create_scheduler_v2)')
    g.add_argument('--sched', default=d.sched, help="timm scheduler name, or 'none'")
    g.add_argument('--sched-on-updates', dest='sched_on_updates', action='store_true', default=d.sched_on_updates,
                   help='step the schedule each optimiser update (the default here; train.py steps per epoch)')
    g.add_argument('--sched-on-epochs', dest='sched_on_updates', action='store_false',
                   help='step the schedule once per epoch')
    g.add_argument('--lr', type=positive_float, metavar='LR',
                   help=f'learning rate; overrides --lr-base (default without either: {d.resolve_lr()})')
    g.add_argument('--lr-base', type=positive_float, metavar='LR',
                   help='base learning rate: lr = lr_base * global batch / lr_base_size')
    g.add_argument('--lr-base-size', type=positive_int, default=d.lr_base_size, metavar='DIV')
    g.add_argument('--lr-base-scale', default=d.lr_base_scale, choices=('', 'linear', 'sqrt'),
                   help="'linear' or 'sqrt' scaling with the batch (default: sqrt for ada*/lamb, else linear)")
    g.add_argument('--lr-noise', type=float, nargs='+', metavar='PCT',
                   help='learning-rate noise on/off epoch fractions')
    g.add_argument('--lr-noise-pct', type=float, default=d.lr_noise_pct)
    g.add_argument('--lr-noise-std', type=float, default=d.lr_noise_std)
    g.add_argument('--lr-cycle-mul', type=positive_float, default=d.lr_cycle_mul)
    g.add_argument('--lr-cycle-decay', type=positive_float, default=d.lr_cycle_decay)
    g.add_argument('--lr-cycle-limit', type=positive_int, default=d.lr_cycle_limit)
    g.add_argument('--lr-k-decay', type=positive_float, default=d.lr_k_decay)
    g.add_argument('--warmup-lr', type=non_negative_float, default=d.warmup_lr)
    g.add_argument('--min-lr', type=non_negative_float, default=d.min_lr)
    g.add_argument('--epochs', type=positive_int, default=d.epochs)
    g.add_argument('--decay-milestones', type=positive_int, nargs='+', default=d.decay_milestones, metavar='EPOCH')
    g.add_argument('--decay-epochs', type=positive_float, default=d.decay_epochs)
    g.add_argument('--warmup-epochs', type=non_negative_int, default=d.warmup_epochs)
    g.add_argument('--warmup-prefix', action='store_true', help='exclude the warmup from the decay schedule')
    g.add_argument('--cooldown-epochs', type=non_negative_int, default=d.cooldown_epochs)
    g.add_argument('--patience-epochs', type=non_negative_int, default=d.patience_epochs)
    g.add_argument('--decay-rate', '--dr', type=positive_float, default=d.decay_rate)


def parse_with_config(p: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, List]:
    """Parse `argv`, with the settings of `--config FILE` (a train.py `args.yaml`) as the defaults, as train.py
    does; returns the arguments and the names of the settings the file gave."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument('-c', '--config', default='')
    known, _ = pre.parse_known_args(argv)
    settings = load_timm_args(known.config) if known.config else {}
    dests = {a.dest for a in p._actions}
    p.set_defaults(**{k: v for k, v in settings.items() if k in dests})
    return p.parse_args(argv), sorted(settings)

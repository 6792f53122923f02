"""Fine-tuning a converted model, with and without distillation, against training the same PatchNorm model from
scratch for the same number of steps, and the original BatchNorm model; top-1 on the Fashion-MNIST test set.

    python scripts/measure_finetune.py runs/demo      # after `make demo`
"""
import sys
from pathlib import Path

import timm_affinediv  # noqa: F401
from timm_affinediv.cli import existing_dir, positive_int, refuse_existing_output, run_main
from timm_affinediv.commands import command_parser
from timm_affinediv.data import create_eval_loader, resolve_dataset_data_config
from timm_affinediv.model_io import load_trained_model
from timm_affinediv.pipeline import PipelineConfig, final_top1, train_config
from timm_affinediv.train import Trainer, evaluate


def main(argv=None) -> int:
    parser = command_parser('measure-finetune', __doc__, prog='scripts/measure_finetune.py')
    parser.add_argument('run', nargs='?', default='runs/demo', type=existing_dir, help='the pipeline run (runs/demo)')
    parser.add_argument('--epochs', type=positive_int, default=2, help='epochs of fine-tuning (default 2)')
    parser.add_argument('--train-subset', type=positive_int, default=PipelineConfig.train_subset,
                        help='training images of each fine-tuning run')
    parser.add_argument('--overwrite', action='store_true', help='replace the results of an earlier measurement')
    args = parser.parse_args(argv)
    run, epochs = args.run, args.epochs
    if not args.overwrite:
        refuse_existing_output(Path(run) / 'measure')
    cfg = PipelineConfig(output=run, val_subset=None, train_subset=args.train_subset)
    baseline = load_trained_model(f'local-dir:{Path(run) / "baseline"}')
    data_config = resolve_dataset_data_config('fashion-mnist', baseline, in_chans=1)
    test = create_eval_loader('fashion-mnist', None, data_config, 256, workers=0)
    rows = [('original BatchNorm', evaluate(baseline, test)['top1'])]

    def converted():
        return load_trained_model(f'local-dir:{Path(run) / "converted"}')
    rows.append(('converted, before fine-tuning', evaluate(converted(), test)['top1']))
    runs = [('fine-tuned with distillation', dict(model=converted(), teacher=baseline), dict(distill_weight=0.5)),
            ('fine-tuned without distillation', dict(model=converted()), {}),
            ('PatchNorm from scratch, same steps', {}, dict(norm_layer='patchnorm', lr=cfg.lr))]
    for name, modules, overrides in runs:
        settings = dict(epochs=epochs, lr=cfg.finetune_lr, distill_temperature=cfg.distill_temperature,
                        output=str(Path(run) / 'measure' / name.replace(' ', '-').replace(',', '')), progress=False)
        settings.update(overrides)
        result = Trainer(train_config(cfg, **settings), **modules).fit()
        rows.append((name, final_top1(result.metrics)))
    print(f'| model ({epochs} epochs of fine-tuning, {cfg.train_subset} training images) | top-1 % (10k test) |')
    print('|---|---:|')
    for name, top1 in rows:
        print(f'| {name} | {top1:.2f} |')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

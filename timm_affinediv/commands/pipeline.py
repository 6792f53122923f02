"""The main job: a trained BatchNorm model -> PatchNorm -> fine-tuned with distillation -> Hub-ready folder.

    timm-affinediv pipeline                      # built-in default: narrow resnet18 on Fashion-MNIST, trained here
    timm-affinediv pipeline --model resnet18 --checkpoint baseline.safetensors \
        --model-kwargs "channels=(16,32,64,128)" stem_width=16 --output runs/demo-own

Writes <output>/baseline (when trained here), <output>/converted, <output>/model (the fine-tuned, publishable
folder: push it with timm-affinediv push) and the runs' logs and checkpoints.
"""
import json
import logging
import sys

import timm_affinediv  # noqa: F401  (registers the layers with timm)
from timm_affinediv.cli import (
    add_model_args,
    non_negative_int,
    positive_float,
    positive_int,
    run_main,
    timm_model_name,
    unit_interval,
)
from timm_affinediv.commands import command_parser
from timm_affinediv.convert import CONVERSION_NORMS
from timm_affinediv.pipeline import PipelineConfig, run_pipeline


def main(argv=None) -> int:
    defaults = PipelineConfig()
    parser = command_parser('pipeline', __doc__)
    parser.add_argument('--output', default=defaults.output)
    add_model_args(parser, model_type=timm_model_name, default=defaults.model, pretrained=False, head=False, help={
        '--model': 'timm model name',
        '--model-kwargs': f'timm.create_model arguments (default: {defaults.model_kwargs} for the default model)',
        '--checkpoint': 'trained BatchNorm weights; without it a baseline is trained here'})
    parser.add_argument('--norm', default=defaults.norm, choices=CONVERSION_NORMS)
    for name, kind in (('train_subset', positive_int), ('val_subset', positive_int), ('baseline_epochs', positive_int),
                       ('finetune_epochs', positive_int), ('batch_size', positive_int), ('calib_batches',
                                                                                         non_negative_int),
                       ('workers', non_negative_int), ('seed', int), ('lr', positive_float), ('finetune_lr',
                                                                                              positive_float),
                       ('distill_weight', unit_interval), ('distill_temperature', positive_float)):
        parser.add_argument('--' + name.replace('_', '-'), type=kind, default=getattr(defaults, name))
    parser.add_argument('--overwrite', action='store_true', help='replace the output folders of an earlier run')
    args = vars(parser.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format='%(message)s')
    if not args['model_kwargs'] and args['model'] == defaults.model:  # the narrow default belongs to that model only
        args['model_kwargs'] = defaults.model_kwargs
    summary = run_pipeline(PipelineConfig(**args))
    print(json.dumps(summary, indent=2))
    folder = f"{args['output']}/model"
    print(f'publish-ready folder: {folder}  (timm-affinediv push {folder} --repo-id ORG/NAME)')
    return 0


if __name__ == '__main__':
    sys.exit(run_main(main))

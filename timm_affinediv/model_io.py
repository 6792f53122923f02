""" Trained models in and out of files: load one (a checkpoint, `local-dir:` or `hf-hub:`), convert it into a Hub folder

`timm-affinediv convert` and the demo pipeline (`timm_affinediv.pipeline`) are built on this.
"""
import json
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import timm
import torch
import torch.nn as nn
from timm.models._input import get_model_args

from .convert import ConversionError, ConversionReport, convert_model, model_in_chans
from .data import create_eval_loader, is_fashion_mnist, resolve_dataset_data_config
from .hub import model_card_template, save_hub_folder
from .train import evaluate

__all__ = ['load_trained_model', 'evaluate', 'convert_to_folder', 'hub_dataset']


def load_trained_model(model: str, checkpoint: Optional[str] = None, **kwargs: Any) -> nn.Module:
    """ A trained timm model, in eval mode.

    `model` is `hf-hub:org/name` or `local-dir:PATH` (timm loads the weights), or a timm model name whose
    weights come from `checkpoint` (safetensors, or a timm/PyTorch checkpoint); `kwargs` go to
    `timm.create_model` (e.g. `num_classes`, `in_chans`, architecture arguments).
    """
    if model.startswith(('hf-hub:', 'local-dir:')):
        if checkpoint:
            raise ConversionError(f'{model} carries its weights: drop --checkpoint, or give a timm model name.')
        return timm.create_model(model, pretrained=True, **kwargs).eval()
    if not timm.is_model(model):
        raise ConversionError(f"unknown model '{model}': give a timm model name (timm.list_models()), "
                              'hf-hub:org/name or local-dir:PATH.')
    if not checkpoint:
        raise ConversionError(f"'{model}' needs its trained weights: pass --checkpoint FILE.")
    if not Path(checkpoint).is_file():
        raise ConversionError(f'checkpoint {checkpoint} not found.')
    net = timm.create_model(model, **kwargs)
    try:
        timm.models.load_checkpoint(net, checkpoint, strict=True)
    except RuntimeError as e:
        raise ConversionError(
            f'checkpoint {checkpoint} does not fit {model} {kwargs or ""}: {e}\n'
            'Check the architecture and its arguments (--num-classes, --in-chans, --model-kwargs).') from e
    except Exception as e:  # not a checkpoint at all, truncated, ...
        raise ConversionError(f'checkpoint {checkpoint} is unreadable ({type(e).__name__}: {e}).') from e
    return net.eval()


@torch.no_grad()
def hub_dataset(dataset: str, data_dir: Optional[str]) -> str:
    """The Hub dataset id for the model card's metadata."""
    if is_fashion_mnist(dataset):
        return 'zalando-datasets/fashion_mnist'
    return dataset or Path(data_dir or 'imagefolder').name


def convert_to_folder(
        model: nn.Module,
        output: str,
        *,
        norm: str = 'patchnorm',
        dataset: str = 'fashion-mnist',
        data_dir: Optional[str] = None,
        calib_batches: int = 32,
        batch_size: int = 64,
        eval_images: Optional[int] = None,
        base_model: Optional[str] = None,
        overwrite: bool = False,
        progress: bool = True,
        workers: int = 0,
        **model_kwargs: Any,
) -> Tuple[nn.Module, ConversionReport, Dict[str, Any]]:
    """ Convert `model` with `calib_batches` batches of `dataset`'s training split, evaluate the original and
    the converted model on its validation split, and write the Hub folder `output` (weights, config, card,
    `conversion_report.json`). Returns the converted model, the report and the metrics.
    """
    if Path(output).exists() and not overwrite:
        raise FileExistsError(f'{output} already exists; pass --overwrite to replace it.')
    model_card_template()  # an install without its templates fails here, not after the conversion
    data_config = resolve_dataset_data_config(dataset, model, in_chans=model_in_chans(model))
    calibration = None
    if calib_batches:
        loader = create_eval_loader(dataset, data_dir, data_config, batch_size, split='train',
                                    subset=calib_batches * batch_size, workers=workers)
        calibration = [images for images, _ in loader]
    converted, report = convert_model(model, norm, calibration, progress=progress, **model_kwargs)
    # the preprocessing the weights expect, for timm's resolve_data_config on the published model
    converted.pretrained_cfg = dict(converted.pretrained_cfg, **data_config, num_classes=converted.num_classes)
    eval_loader = create_eval_loader(dataset, data_dir, data_config, 256, subset=eval_images, workers=workers)
    metrics = dict(original=evaluate(model, eval_loader), converted=evaluate(converted, eval_loader),
                   conversion_seconds=report.seconds)
    recipe = (f'Converted from `{base_model or report.architecture}` ({report.architecture}, BatchNorm/LayerNorm) '
              f'to `norm_layer="{norm}"` with timm-affinediv: weights carried over, each divergence-corrected '
              f'layer fitted by ridge least squares to the original\'s outputs on {report.calibration_images} '
              f'{dataset} training images ({report.calibration_batches} batches), in forward order. '
              f'Top-1 before conversion {metrics["original"]["top1"]:.2f}%, after {metrics["converted"]["top1"]:.2f}% '
              '(no fine-tuning).')
    save_hub_folder(
        converted, output, overwrite=overwrite,
        model_args=get_model_args(converted),
        card=dict(base_model=base_model, datasets=[hub_dataset(dataset, data_dir)], dataset_name=dataset,
                  recipe=recipe, norm_layer=norm),
        metrics=dict(top1=round(metrics['converted']['top1'], 2), top5=round(metrics['converted']['top5'], 2)),
        extra_files={'conversion_report.json': json.dumps(dict(report.to_dict(), metrics=metrics), indent=2)},
    )
    return converted, report, metrics

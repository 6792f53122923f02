""" Trained models in and out of files: load one (a checkpoint, `local-dir:` or `hf-hub:`), convert it into a Hub folder

`timm-affinediv convert` and the demo pipeline (`timm_affinediv.pipeline`) are built on this.
"""
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import timm
import torch
import torch.nn as nn

from ._state_dict import describe_mismatch
from ._timm_compat import get_model_args
from .convert import ConversionError, ConversionReport, convert_model, model_in_chans
from .data import (
    create_eval_loader,
    dataset_class_names,
    describe_split,
    is_fashion_mnist,
    is_stream,
    resolve_dataset_data_config,
)
from .errors import CheckpointError, MissingFileError, NormMismatchError
from .hub import model_card_template, save_hub_folder
from .labels import label_config, model_labels, with_labels
from .train import evaluate

__all__ = ['load_trained_model', 'evaluate', 'convert_to_folder', 'hub_dataset']


def load_trained_model(model: str, checkpoint: Optional[str] = None, pretrained: bool = False,
                       **kwargs: Any) -> nn.Module:
    """ A trained timm model, in eval mode.

    `model` is `hf-hub:org/name` or `local-dir:PATH` (timm loads the weights), a timm model name with
    `pretrained=True` (timm's pretrained weights for it, e.g. `resnet50.a1_in1k`), or a timm model name whose
    weights come from `checkpoint` (safetensors, or a timm/PyTorch checkpoint); `kwargs` go to
    `timm.create_model` (e.g. `num_classes`, `in_chans`, architecture arguments). Weights that cannot be
    loaded raise an error, never a randomly initialised model: `MissingFileError` (a `FileNotFoundError`) for a
    checkpoint that does not exist, `CheckpointError` for one that is unreadable or does not fit, `ConversionError`
    for a model that cannot be created or fetched.
    """
    if model.startswith(('hf-hub:', 'local-dir:')) or pretrained:
        if checkpoint:
            raise ConversionError(f'{model} gets its weights from {"timm" if pretrained else "there"}: '
                                  'drop --checkpoint (or --pretrained).')
        if pretrained and not timm.is_model(model):
            raise ConversionError(
                f"unknown model '{model}': give a timm model name (timm.list_models(pretrained=True)).")
        try:
            return timm.create_model(model, pretrained=True, **kwargs).eval()
        except (RuntimeError, ValueError) as e:  # timm: 'No pretrained weights exist ...', weights that do not fit
            message = ' '.join(str(e).split())
            raise ConversionError(f'cannot load the weights of {model} {kwargs or ""}: {message}') from e
        except OSError as e:  # the Hub cannot be reached (offline), a missing local folder or file
            raise ConversionError(
                f'cannot fetch the weights of {model} ({type(e).__name__}: {" ".join(str(e).split())}). Without '
                'network access, download them elsewhere and pass local-dir:PATH or --checkpoint FILE.') from e
    if not timm.is_model(model):
        raise ConversionError(f"unknown model '{model}': give a timm model name (timm.list_models()), "
                              'hf-hub:org/name or local-dir:PATH.')
    if not checkpoint:
        raise ConversionError(f"'{model}' needs its trained weights: pass --checkpoint FILE (or --pretrained "
                              "for timm's own).")
    if not Path(checkpoint).is_file():
        raise MissingFileError(f'checkpoint {checkpoint} not found: pass the path of an existing file.')
    net = timm.create_model(model, **kwargs)
    try:  # timm's reading (safetensors / .pth, EMA weights preferred), as `timm.models.load_checkpoint` does
        state_dict = timm.models.load_state_dict(checkpoint)
    except Exception as e:  # not a checkpoint at all, truncated, ...
        raise CheckpointError(f'checkpoint {checkpoint} is unreadable ({type(e).__name__}: {e}).') from e
    try:
        net.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:
        raise CheckpointError(
            f'checkpoint {checkpoint} does not fit {model} {kwargs or ""}: {describe_mismatch(net, state_dict) or e}. '
            'Check the architecture and its arguments (--num-classes, --in-chans, --model-kwargs).') from e
    except NormMismatchError as e:  # a BatchNorm checkpoint for patchnorm slots
        raise CheckpointError(f'checkpoint {checkpoint}: {e}') from e
    return net.eval()


def _first_images(loader: Iterable, images: int, labels: bool = False) -> List:
    """The batches of `loader` up to `images` images (a stream takes no subset: its first ones), the last one cut;
    images only, or (images, labels) pairs with `labels`."""
    batches, seen = [], 0
    for x, y in loader:
        x, y = x[:images - seen], y[:images - seen]
        batches.append((x, y) if labels else x)
        seen += len(x)
        if seen >= images:
            break
    return batches


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
        calib_images: Optional[int] = None,
        eval_images: Optional[int] = None,
        base_model: Optional[str] = None,
        base_model_description: Optional[str] = None,
        overwrite: bool = False,
        progress: bool = True,
        workers: int = 0,
        device: Optional[str] = None,
        calib_memory: int = 4 << 30,
        calibration: Optional[Iterable] = None,
        **model_kwargs: Any,
) -> Tuple[nn.Module, ConversionReport, Dict[str, Any]]:
    """ Convert `model` with `calib_images` (default `calib_batches * batch_size`) images of `dataset`'s training
    split (any name `timm-affinediv finetune` reads: Fashion-MNIST, an image folder, timm's `torch/`, `hfds/`,
    `hfids/`, `wds/`, `tfds/`; the first images of a stream), read with the model's own eval transforms
    (`resolve_data_config` of its `pretrained_cfg`), or the batches of `calibration` (an iterable of image tensors
    or (images, labels) pairs, read as they are) when given; evaluate the original and the converted model on the
    dataset's validation split (`eval_images=0`: skipped), and write the Hub folder `output` (weights, config,
    card, `conversion_report.json`). `base_model` is the Hub id of `model` when it has one,
    `base_model_description` says where it came from otherwise; `model_kwargs` go to `convert_model` (its
    calibration options, e.g. `reconstruct_steps`, then `timm.create_model`'s). Returns the converted model, the
    report and the metrics.
    """
    if Path(output).exists() and not overwrite:
        raise FileExistsError(f'{output} already exists; pass --overwrite to replace it.')
    if calib_batches < 0 or batch_size < 1 or (calib_images is not None and calib_images < 0) or (
            eval_images is not None and eval_images < 0):
        raise ConversionError(f'calib_batches must be >= 0 (got {calib_batches}), batch_size >= 1 (got {batch_size}), '
                              f'calib_images >= 0 or None (got {calib_images}), '
                              f'eval_images >= 0 or None (got {eval_images}).')
    model_card_template()  # an install without its templates fails here, not after the conversion
    data_config = resolve_dataset_data_config(dataset, model, in_chans=model_in_chans(model))
    calib_images = calib_batches * batch_size if calib_images is None else calib_images
    dataset_given = calibration is not None
    datasets_read = []
    if calibration is None and calib_images:
        calib_loader = create_eval_loader(dataset, data_dir, data_config, batch_size, split='train',
                                          subset=calib_images, workers=workers)
        datasets_read.append(calib_loader.dataset)
        calibration = _first_images(calib_loader, calib_images)
    converted, report = convert_model(model, norm, calibration, progress=progress, device=device,
                                      calib_memory=calib_memory, **model_kwargs)
    metrics: Dict[str, Any] = dict(conversion_seconds=report.seconds, data_config=data_config)
    evaluated = eval_images != 0
    if evaluated:
        eval_loader = create_eval_loader(dataset, data_dir, data_config, 256, subset=eval_images, workers=workers)
        datasets_read.append(eval_loader.dataset)
        batches = _first_images(eval_loader, eval_images, labels=True) if is_stream(eval_loader.dataset) and \
            eval_images else eval_loader
        metrics.update(original=evaluate(model, batches), converted=evaluate(converted, batches))
    # the preprocessing the weights expect, for timm's resolve_data_config on the published model, and the names of
    # their classes: the dataset's where it names each output, else the original model's
    names = next(filter(None, map(dataset_class_names, datasets_read)), None)
    converted.pretrained_cfg = with_labels(dict(converted.pretrained_cfg, **data_config,
                                                num_classes=converted.num_classes),
                                           label_config(names, converted.num_classes) or model_labels(model))
    source = 'given' if dataset_given else f'{dataset or data_dir} training'
    recipe = (f'Converted from `{base_model or report.architecture}` ({report.architecture}, BatchNorm/LayerNorm) '
              f'to `norm_layer="{norm}"` with timm-affinediv: weights carried over, then, on '
              f'{report.calibration_images} {source} images ({report.calibration_batches} batches, no labels), '
              f'in forward order: {report.describe()}. ')
    if evaluated:
        recipe += (f'Top-1 before conversion {metrics["original"]["top1"]:.2f}%, '
                   f'after {metrics["converted"]["top1"]:.2f}% (no fine-tuning).')
    save_hub_folder(
        converted, output, overwrite=overwrite,
        model_args=get_model_args(converted),
        card=dict(base_model=base_model, datasets=[hub_dataset(dataset, data_dir)],
                  dataset_name='Fashion-MNIST' if is_fashion_mnist(dataset) else dataset or Path(data_dir).name,
                  eval_set=describe_split(eval_loader.dataset, dataset or data_dir,
                                          'validation') if evaluated else None,
                  recipe=recipe, norm_layer=norm, model_name=f'{report.architecture}-{norm}',
                  base_model_description=base_model_description or (
                      None if base_model else f'converted from a trained `{report.architecture}`, not on the Hub')),
        data_config=data_config,
        metrics=dict(top1=round(metrics['converted']['top1'], 2), top5=round(metrics['converted']['top5'], 2))
        if evaluated else None,
        extra_files={'conversion_report.json': json.dumps(dict(report.to_dict(), metrics=metrics), indent=2)},
    )
    return converted, report, metrics

""" Trained models in and out of files: load one (a checkpoint, `local-dir:` or `hf-hub:`), convert it into a Hub folder

`timm-affinediv convert` and the demo pipeline (`timm_affinediv.pipeline`) are built on this.
"""
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import timm
import torch
import torch.nn as nn
from timm.data import create_transform
from torch.utils.data import DataLoader, Dataset, Subset

from ._hub_folder import check_folder
from ._state_dict import WeightsFile
from ._timm_compat import get_model_args
from .convert import ConversionError, ConversionReport, ConvertOptions, convert_model, model_in_chans
from .data import (
    create_eval_loader,
    create_image_dataset,
    dataset_class_names,
    describe_split,
    is_fashion_mnist,
    is_stream,
    resolve_dataset,
    resolve_dataset_data_config,
)
from .errors import AffineDivError, MissingFileError, OutputExistsError
from .hub import model_card_template, save_hub_folder
from .labels import label_config, model_labels, with_labels
from .train import TrainConfig, evaluate

__all__ = ['load_trained_model', 'evaluate', 'convert_to_folder', 'conversion_images', 'ConversionImages',
           'hub_dataset']


def load_trained_model(model: str, checkpoint: Optional[str] = None, pretrained: bool = False,
                       **kwargs: Any) -> nn.Module:
    """ A trained timm model, in eval mode.

    `model` is `hf-hub:org/name` or `local-dir:PATH` (timm loads the weights), a timm model name with
    `pretrained=True` (timm's pretrained weights for it, e.g. `resnet50.a1_in1k`), or a timm model name whose
    weights come from `checkpoint` (safetensors, or a timm/PyTorch checkpoint); `kwargs` go to
    `timm.create_model` (e.g. `num_classes`, `in_chans`, architecture arguments). Weights that cannot be
    loaded raise an error, never a randomly initialised model: `MissingFileError` (a `FileNotFoundError`) for a
    checkpoint that does not exist, `CheckpointError` for one that is unreadable, not finite or does not fit,
    `HubError` for a folder that is broken or inconsistent (`timm_affinediv._hub_folder`), `ConversionError` for a
    model that cannot be created or fetched.
    """
    if model.startswith(('hf-hub:', 'local-dir:')) or pretrained:
        if checkpoint:
            raise ConversionError(f'{model} gets its weights from {"timm" if pretrained else "there"}: '
                                  'drop --checkpoint (or --pretrained).')
        if pretrained and not timm.is_model(model):
            raise ConversionError(
                f"unknown model '{model}': give a timm model name (timm.list_models(pretrained=True)).")
        try:
            if not pretrained:  # a folder's config and weights are refused in one line before timm reads them
                check_folder(model)
            return timm.create_model(model, pretrained=True, **kwargs).eval()
        except AffineDivError:  # the plugin's own refusal of a folder: already one line that says what to do
            raise
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
    weights = WeightsFile('checkpoint', checkpoint)
    weights.load_into(net, weights.read(), target=f'{model} {kwargs or ""}'.strip(),
                      hint='Check the architecture and its arguments (--num-classes, --in-chans, --model-kwargs).')
    return net.eval()


def _first_images(loader: Iterable, images: int, labels: bool = False, skip: int = 0) -> List:
    """The batches of `loader` up to `images` images after the first `skip` (a stream takes no subset: its first
    ones), the last one cut; images only, or (images, labels) pairs with `labels`."""
    batches, seen = [], 0
    for x, y in loader:
        cut = min(len(x), skip)
        skip -= cut
        x, y = x[cut:][:images - seen], y[cut:][:images - seen]
        if not len(x):
            continue
        batches.append((x, y) if labels else x)
        seen += len(x)
        if seen >= images:
            break
    return batches


class _StreamAfter:
    """The images of a stream after its first `skip`, `images` of them, in batches of `loader` (read anew, in the
    stream's order, each pass); its length is their batches."""

    def __init__(self, loader: DataLoader, skip: int, images: int):
        self.loader, self.skip, self.images = loader, skip, images

    def __len__(self) -> int:
        return -(-self.images // self.loader.batch_size)

    def __iter__(self):
        return iter(_first_images(self.loader, self.images, skip=self.skip))


#: The command's default held-out and distillation images (docs/families.md: how they were chosen).
HELDOUT_IMAGES = 1024
DISTILL_IMAGES = 8192


@dataclass
class ConversionImages:
    """The images of a conversion (`conversion_images`): calibration and held-out batches (in memory), the
    distillation images (a loader, streamed; None where there are none) and the training split they were drawn
    from (for its class names)."""
    calibration: List[torch.Tensor]
    heldout: List[torch.Tensor]
    distill: Optional[Iterable]
    source: Optional[Dataset] = None

    @property
    def distill_images(self) -> int:
        return len(self.distill.dataset) if isinstance(self.distill, DataLoader) else getattr(
            self.distill, 'images', 0)


def conversion_images(dataset: str, data_dir: Optional[str], data_config: Dict[str, Any], batch_size: int, *,
                      calib_images: int, heldout_images: int = 0, distill_images: int = 0,
                      augment: Optional[Dict[str, Any]] = None, workers: int = 0, seed: int = 0
                      ) -> ConversionImages:
    """ Three disjoint draws of `dataset`'s training split for a conversion: `calib_images` calibration images (the
    first of a fixed random order, seed 0: `create_eval_loader(subset=...)`'s subset), the next `heldout_images`
    held out, both read with the eval transforms and held in memory, and the next `distill_images` for the
    distillation, read with timm's train-time augmentation (`create_transform(is_training=True, **augment)`; default
    `augment`: the training defaults of `TrainConfig`, a new view of each image each pass) by a shuffling loader,
    streamed. A stream (no random access) gives them in its order: its first images, the next, the next. Where the
    split has fewer images, the held-out and distillation draws get what is left."""
    eval_transform = create_transform(**data_config, is_training=False)
    train_transform = create_transform(**{**data_config, **(augment or TrainConfig().transform_kwargs())},
                                       is_training=True)
    in_chans = data_config['input_size'][0]
    source = create_image_dataset(dataset, data_dir, 'train', in_chans=in_chans, transform=eval_transform,
                                  batch_size=batch_size, workers=workers)
    if is_stream(source):
        loader = DataLoader(source, batch_size=batch_size, num_workers=workers)
        stream = create_image_dataset(dataset, data_dir, 'train', in_chans=in_chans, transform=train_transform,
                                      batch_size=batch_size, workers=workers)
        try:  # timm's streams know their length where their metadata says it
            distill_images = min(distill_images, max(0, len(source) - calib_images - heldout_images))
        except TypeError:
            pass
        return ConversionImages(
            _first_images(loader, calib_images), _first_images(loader, heldout_images, skip=calib_images),
            _StreamAfter(DataLoader(stream, batch_size=batch_size, num_workers=workers), calib_images +
                         heldout_images, distill_images) if distill_images else None, source)
    order = torch.randperm(len(source), generator=torch.Generator().manual_seed(0)).tolist()
    cuts = itertools.accumulate((calib_images, heldout_images, distill_images), initial=0)
    calib, heldout, distill = (order[a:b] for a, b in itertools.pairwise(cuts))

    def batches(indices: List[int]) -> List[torch.Tensor]:
        return [x for x, _ in DataLoader(Subset(source, sorted(indices)), batch_size=batch_size,
                                         num_workers=workers)]
    distill_loader = None
    if distill:
        augmented = create_image_dataset(dataset, data_dir, 'train', in_chans=in_chans, transform=train_transform)
        distill_loader = DataLoader(Subset(augmented, distill), batch_size=batch_size, shuffle=True,
                                    num_workers=workers, generator=torch.Generator().manual_seed(seed))
    return ConversionImages(batches(calib), batches(heldout), distill_loader, source)


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
        dataset: Optional[str] = None,
        data_dir: Optional[str] = None,
        calib_batches: int = 32,
        batch_size: int = 64,
        calib_images: Optional[int] = None,
        heldout_images: int = HELDOUT_IMAGES,
        distill_images: int = DISTILL_IMAGES,
        eval_images: Optional[int] = None,
        base_model: Optional[str] = None,
        base_model_description: Optional[str] = None,
        overwrite: bool = False,
        workers: int = 0,
        options: Optional[ConvertOptions] = None,
        calibration: Optional[Iterable] = None,
        **model_kwargs: Any,
) -> Tuple[nn.Module, ConversionReport, Dict[str, Any]]:
    """ Convert `model` on images of `dataset`'s training split (any name `timm-affinediv finetune` reads:
    'fashion-mnist', '' or None for the image folder at `data_dir`, timm's `torch/`, `hfds/`, `hfids/`, `wds/`,
    `tfds/`; no default: `ConfigError` without `dataset` or `data_dir`): `calib_images` (default
    `calib_batches * batch_size`) calibration images and `heldout_images` held-out ones read with the model's own
    eval transforms (`resolve_data_config` of its `pretrained_cfg`), and `distill_images` more for the distillation,
    streamed with train-time augmentation (`conversion_images`); or, where `calibration` (an iterable of image
    tensors or (images, labels) pairs, read as they are) is given, on those alone. Evaluate the original and the
    converted model on the dataset's validation split (`eval_images=0`: skipped), and write the Hub folder `output`
    (weights, config, card, `conversion_report.json`). `base_model` is the Hub id of `model` when it has one,
    `base_model_description` says where it came from otherwise; `options` go to `convert_model`, `model_kwargs` to
    `timm.create_model`. Returns the converted model, the report and the metrics.
    """
    if Path(output).exists() and not overwrite:
        raise OutputExistsError(f'{output} already exists; pass --overwrite to replace it.')
    counts = dict(calib_batches=calib_batches, calib_images=calib_images, heldout_images=heldout_images,
                  distill_images=distill_images, eval_images=eval_images)
    wrong = [f'{k} must be >= 0 (got {v})' for k, v in counts.items() if v is not None and v < 0] + (
        [f'batch_size must be >= 1 (got {batch_size})'] if batch_size < 1 else [])
    if wrong:
        raise ConversionError('; '.join(wrong) + '.')
    dataset = resolve_dataset(dataset, data_dir)
    model_card_template()  # an install without its templates fails here, not after the conversion
    data_config = resolve_dataset_data_config(dataset, model, in_chans=model_in_chans(model))
    calib_images = calib_batches * batch_size if calib_images is None else calib_images
    dataset_given = calibration is not None
    images = ConversionImages(list(calibration or []), [], None)
    if not dataset_given and calib_images:
        images = conversion_images(dataset, data_dir, data_config, batch_size, calib_images=calib_images,
                                   heldout_images=heldout_images, distill_images=distill_images, workers=workers,
                                   seed=(options or ConvertOptions()).seed)
    converted, report = convert_model(model, norm, images.calibration or None, options=options,
                                      heldout=images.heldout or None, distill_data=images.distill, **model_kwargs)
    metrics: Dict[str, Any] = dict(conversion_seconds=report.seconds, data_config=data_config,
                                   distill_images=images.distill_images)
    datasets_read = [images.source] if images.source is not None else []
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
    if report.distillation is not None and images.distill is not None:
        recipe += (f'The distillation images are {images.distill_images} further {source} images, read with '
                   'train-time augmentation (no labels). ')
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

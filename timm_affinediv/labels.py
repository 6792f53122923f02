""" The class names of a model's outputs, kept as timm keeps them

timm's `pretrained_cfg` names a classifier's outputs with `label_names` (output index -> unique name: a WordNet
synset for ImageNet) and `label_descriptions` (name -> words), and a Hub folder's `config.json` carries both at its
top level (`timm.models.save_for_hf`'s `model_config`), where timm's `hf-hub:`/`local-dir:` loading reads them back
into `pretrained_cfg` and transformers' `TimmWrapperConfig` makes `label_names` its `id2label` (the labels of
`pipeline("image-classification")`).

The Trainer and `convert_to_folder` set them from the dataset the weights were trained or converted on
(`timm_affinediv.data.dataset_class_names`); a Hub folder of a model without them gets ImageNet's where timm infers an
ImageNet subset from the class count (`timm.data.infer_imagenet_subset`, as transformers does for a config without
names). Names that are ImageNet synsets get their WordNet lemmas as descriptions (`timm.data.ImageNetInfo`).
"""
import functools
from typing import Any, Dict, List, Mapping, Optional, Sequence

from timm.data import ImageNetInfo, infer_imagenet_subset
from torch import nn

__all__ = ['LABEL_KEYS', 'label_config', 'with_labels', 'model_labels']

#: The `pretrained_cfg` (and `config.json`) entries that name a model's outputs.
LABEL_KEYS = ('label_names', 'label_descriptions')


def label_config(names: Optional[Sequence[str]], num_classes: int) -> Dict[str, Any]:
    """`label_names` for the `num_classes` outputs named by `names`, with `label_descriptions` where timm knows them
    (ImageNet synsets); {} unless `names` holds one name for each output."""
    if not names or len(names) != num_classes:
        return {}
    names = [str(name) for name in names]
    descriptions = _imagenet_descriptions(tuple(names))
    return dict(label_names=names, **({'label_descriptions': descriptions} if descriptions else {}))


def with_labels(pretrained_cfg: Mapping[str, Any], labels: Mapping[str, Any]) -> Dict[str, Any]:
    """`pretrained_cfg` with its label entries replaced by those of `labels` (none: names it cannot vouch for are
    dropped)."""
    return {**{k: v for k, v in pretrained_cfg.items() if k not in LABEL_KEYS}, **labels}


def model_labels(model: nn.Module) -> Dict[str, Any]:
    """The label entries that name `model`'s outputs: those of its `pretrained_cfg` where they name every output,
    else ImageNet's where timm infers an ImageNet subset from its class count; {} otherwise."""
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    num_classes = getattr(model, 'num_classes', 0)
    labels = label_config(_as_list(cfg.get('label_names')), num_classes)
    descriptions = cfg.get('label_descriptions')
    if labels and isinstance(descriptions, Mapping) and all(n in descriptions for n in labels['label_names']):
        labels['label_descriptions'] = {n: str(descriptions[n]) for n in labels['label_names']}
    subset = infer_imagenet_subset(model) if not labels else None
    return label_config(ImageNetInfo(subset).label_names(), num_classes) if subset else labels


def _as_list(names: Any) -> Optional[List[str]]:
    """timm's `label_names`, a list or an {index: name} mapping (JSON keys are strings), as a list by index; None
    for a mapping with gaps."""
    if isinstance(names, Mapping):
        by_index = {int(k): v for k, v in names.items()}
        return [by_index[i] for i in range(len(by_index))] if set(by_index) == set(range(len(by_index))) else None
    return list(names) if names else None


@functools.lru_cache(maxsize=4)
def _imagenet_descriptions(names: tuple) -> Optional[Dict[str, str]]:
    """name -> WordNet lemma where every name is an ImageNet synset timm knows, else None."""
    info = _imagenet_info()
    try:
        return {name: info.label_name_to_description(name) for name in names}
    except KeyError:
        return None


@functools.lru_cache(maxsize=1)
def _imagenet_info() -> ImageNetInfo:
    return ImageNetInfo()  # its lemmas cover every synset of timm's ImageNet subsets, not only ImageNet-1k's

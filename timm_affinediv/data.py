"""Datasets and loaders for training: built-in Fashion-MNIST and image folders, through timm's data pipeline.

Fashion-MNIST is read from the gzipped IDX files of Debian's `dataset-fashion-mnist` (no download), and yields
PIL images so timm's transforms apply unchanged. Image folders go through `timm.data.create_dataset`. Loaders use
`timm.data.resolve_data_config` + `create_transform`, and a `DistributedSampler` whose order depends only on
(seed, epoch), so that a resumed run sees the same data order as an uninterrupted one.
"""
import functools
import gzip
import os
import struct
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image
from timm.data import create_dataset, create_transform, resolve_data_config
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from .errors import DataError

__all__ = [
    'DataError', 'FashionMNIST', 'FASHION_MNIST_DIR', 'FASHION_MNIST_MEAN', 'FASHION_MNIST_STD',
    'FASHION_MNIST_CLASSES', 'is_fashion_mnist', 'create_image_dataset', 'dataset_num_classes',
    'resolve_dataset_data_config', 'create_train_loader', 'set_loader_epoch', 'create_eval_loader',
]

FASHION_MNIST_DIR = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_MEAN = (0.2860,)
FASHION_MNIST_STD = (0.3530,)
FASHION_MNIST_CLASSES = (
    'T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt', 'Sneaker', 'Bag', 'Ankle boot')
FASHION_MNIST_SIZE = 32  # 28x28 resized to 32x32 so every stride of ResNet / ConvNeXt divides it
_FASHION_MNIST_FILES = {
    'train': ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz'),
    'test': ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz'),
}
_TRAIN_SPLITS = ('train', 'training')
_EVAL_SPLITS = ('test', 'val', 'validation', 'eval', 'evaluation')
_IDX_DTYPES = {0x08: np.uint8}


class FashionMNIST(Dataset):
    """Fashion-MNIST from its gzipped IDX files, as 28x28 grayscale ('L') PIL images and integer labels.

    Args:
        root: folder holding the four `*-idx?-ubyte.gz` files (Debian's `dataset-fashion-mnist` default).
        split: 'train' (60k) or 'test' (10k); 'val' / 'validation' are accepted for 'test'.
        transform: applied to each PIL image (e.g. from `timm.data.create_transform`).
        target_transform: applied to each label.
    """

    classes = FASHION_MNIST_CLASSES

    def __init__(
            self,
            root: str = FASHION_MNIST_DIR,
            split: str = 'train',
            transform: Optional[Callable] = None,
            target_transform: Optional[Callable] = None,
    ):
        self.root = root
        self.split = _canonical_split(split)
        self.transform = transform
        self.target_transform = target_transform
        image_file, label_file = (os.path.join(root, f) for f in _FASHION_MNIST_FILES[self.split])
        self.images = _read_idx(image_file, ndim=3)
        self.targets = _read_idx(label_file, ndim=1).astype(np.int64)
        if len(self.images) != len(self.targets):
            raise DataError(
                f'{image_file} has {len(self.images)} images but {label_file} has {len(self.targets)} labels; '
                f'reinstall the dataset (apt-get install --reinstall dataset-fashion-mnist).')

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        img = Image.fromarray(self.images[index])  # 2-D uint8: mode 'L'
        target = int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


def _canonical_split(split: str) -> str:
    if split in _TRAIN_SPLITS:
        return 'train'
    if split in _EVAL_SPLITS:
        return 'test'
    raise DataError(f"unknown Fashion-MNIST split '{split}'; use 'train' or 'test' (or 'validation').")


@functools.lru_cache(maxsize=8)
def _read_idx(path: str, ndim: int) -> np.ndarray:
    """Read a gzipped IDX file (the MNIST format) into a read-only numpy array, checking its header (cached)."""
    if not os.path.isfile(path):
        raise DataError(
            f'Fashion-MNIST file {path} not found. Install it with `apt-get install dataset-fashion-mnist` '
            f'(files under {FASHION_MNIST_DIR}) or give the folder holding the IDX .gz files as the data dir.')
    try:
        with gzip.open(path, 'rb') as f:
            data = f.read()
        zero, dtype_code, file_ndim = struct.unpack('>HBB', data[:4])
        if zero != 0 or dtype_code not in _IDX_DTYPES or file_ndim != ndim:
            raise ValueError(f'bad IDX header (dtype 0x{dtype_code:02x}, {file_ndim} dims, expected {ndim})')
        shape = struct.unpack(f'>{ndim}I', data[4:4 + 4 * ndim])
        array = np.frombuffer(data, dtype=_IDX_DTYPES[dtype_code], offset=4 + 4 * ndim)
        return array.reshape(shape)
    except (OSError, EOFError, ValueError, struct.error) as e:
        raise DataError(
            f'cannot read Fashion-MNIST file {path}: {e}. '
            f'Reinstall it (apt-get install --reinstall dataset-fashion-mnist).') from e


def is_fashion_mnist(name: str) -> bool:
    """True for the names the built-in Fashion-MNIST answers to ('fashion-mnist', 'fashion_mnist', ...)."""
    return name.lower().replace('_', '-') in ('fashion-mnist', 'fashionmnist', 'fmnist')


class _CheckedImageDataset(Dataset):
    """Wrap a timm ImageDataset so an unreadable image fails loudly, naming the file (timm skips it with a warning)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset
        self.dataset._max_retries = 1  # timm retries the next sample on a decode error; make the first one fatal

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        try:
            return self.dataset[index]
        except RuntimeError as e:
            path = self.dataset.filename(index, absolute=True)
            raise DataError(f'cannot read image {path} ({e}); remove or replace the file.') from e

    @property
    def transform(self) -> Optional[Callable]:
        return self.dataset.transform

    @transform.setter
    def transform(self, value: Optional[Callable]) -> None:
        self.dataset.transform = value


def create_image_dataset(
        name: str,
        root: Optional[str],
        split: str,
        in_chans: int = 3,
        transform: Optional[Callable] = None,
) -> Dataset:
    """Create the built-in Fashion-MNIST (`name='fashion-mnist'`) or an image folder dataset (`name=''`).

    Args:
        name: 'fashion-mnist', or '' / any timm `create_dataset` name for an image folder (`<root>/<split>/<class>/*`).
        root: data folder; for Fashion-MNIST None means `FASHION_MNIST_DIR`.
        split: 'train' or 'validation' (timm searches `root` for a matching sub-folder).
        in_chans: 1 reads folder images as grayscale ('L'), 3 as RGB.
        transform: transform applied to each PIL image.
    """
    if is_fashion_mnist(name):
        return FashionMNIST(root or FASHION_MNIST_DIR, split=split, transform=transform)
    if not root:
        raise DataError(f"dataset '{name}' needs a data folder: pass --data-dir PATH.")
    if not os.path.isdir(root):
        raise DataError(f'data folder {root} does not exist; pass --data-dir with a folder of class sub-folders.')
    try:
        dataset = create_dataset(
            name, root=root, split=split, is_training=False, input_img_mode='L' if in_chans == 1 else 'RGB')
    except RuntimeError as e:  # timm's folder reader: 'Found 0 images in subfolders of ...'
        raise DataError(f'{e}. Put images in class sub-folders (<data-dir>/<split>/<class>/<image>).') from e
    if len(dataset) == 0:
        raise DataError(f'data folder {root} (split {split}) holds no images; put images in class sub-folders.')
    dataset = _CheckedImageDataset(dataset)
    dataset.transform = transform
    return dataset


def dataset_num_classes(dataset: Dataset) -> int:
    """Number of classes of a dataset made by `create_image_dataset`."""
    if isinstance(dataset, Subset):
        return dataset_num_classes(dataset.dataset)
    if isinstance(dataset, FashionMNIST):
        return len(dataset.classes)
    if isinstance(dataset, _CheckedImageDataset):
        return len(dataset.dataset.reader.class_to_idx)
    raise DataError(f'cannot tell the number of classes of {type(dataset).__name__}; pass --num-classes.')


def resolve_dataset_data_config(
        name: str,
        model: Optional[torch.nn.Module] = None,
        in_chans: int = 3,
        img_size: Optional[int] = None,
) -> Dict[str, Any]:
    """timm data config (input_size, interpolation, mean, std, crop_pct, crop_mode) for a dataset and model.

    Fashion-MNIST: 1 channel, 32x32 (resized from 28x28, no crop), its own mean / std. Image folders: the model's
    pretrained config, with `in_chans` / `img_size` overriding it.
    """
    if is_fashion_mnist(name):
        size = img_size or FASHION_MNIST_SIZE
        args = dict(
            input_size=(1, size, size), mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD,
            interpolation='bilinear', crop_pct=1.0)
        return resolve_data_config(args)
    args = dict(in_chans=in_chans)
    if img_size:
        args['input_size'] = (in_chans, img_size, img_size)
    config = resolve_data_config(args, model=model)
    if len(config['mean']) != config['input_size'][0]:  # an RGB pretrained_cfg used for a grayscale model
        config['mean'] = (sum(config['mean']) / len(config['mean']),) * config['input_size'][0]
        config['std'] = (sum(config['std']) / len(config['std']),) * config['input_size'][0]
    return config


def _subset(dataset: Dataset, size: Optional[int], seed: int = 0) -> Dataset:
    """A fixed random subset of `size` samples (the same for every run with the same seed), or the dataset itself."""
    if not size or size >= len(dataset):
        return dataset
    indices = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:size]
    return Subset(dataset, indices.sort().values.tolist())


def describe_split(dataset: Dataset, name: str, split: str) -> str:
    """The evaluation set in words, with its size, for model cards: 'the 10,000 images of the Fashion-MNIST test
    split', or 'a fixed random 2,000 of the 10,000 images of ...' for a subset (`_subset`)."""
    if is_fashion_mnist(name):
        name, split = 'Fashion-MNIST', _canonical_split(split)
    where = f'the {name} {split} split'
    if isinstance(dataset, Subset):
        return f'a fixed random {len(dataset):,} of the {len(dataset.dataset):,} images of {where}'
    return f'the {len(dataset):,} images of {where}'


def create_train_loader(
        name: str,
        root: Optional[str],
        data_config: Dict[str, Any],
        batch_size: int,
        *,
        split: str = 'train',
        subset: Optional[int] = None,
        workers: int = 2,
        seed: int = 42,
        rank: int = 0,
        world_size: int = 1,
        no_aug: bool = False,
        scale: Optional[Sequence[float]] = None,
        hflip: float = 0.5,
        color_jitter: float = 0.,
        pin_memory: bool = False,
) -> DataLoader:
    """Training loader: timm train transforms, shuffled by a `DistributedSampler` (also with one process).

    The order of an epoch depends only on (seed, epoch): call `set_loader_epoch(loader, epoch)` before each epoch.
    Batches are per process (`batch_size` each); the last incomplete batch is dropped.
    """
    transform = create_transform(
        **data_config, is_training=True, no_aug=no_aug, scale=scale, hflip=hflip, color_jitter=color_jitter)
    dataset = create_image_dataset(name, root, split, in_chans=data_config['input_size'][0], transform=transform)
    dataset = _subset(dataset, subset)
    if len(dataset) < batch_size * world_size:
        raise DataError(
            f'the training set has {len(dataset)} images, fewer than one batch ({batch_size} x {world_size} '
            f'processes); lower --batch-size or use more data.')
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, drop_last=True,
        pin_memory=pin_memory, generator=torch.Generator(), persistent_workers=False)


def set_loader_epoch(loader: DataLoader, epoch: int, seed: int, rank: int = 0) -> None:
    """Fix the data order and the worker seeds (augmentation) of `epoch` for a loader from `create_train_loader`."""
    loader.sampler.set_epoch(epoch)
    loader.generator.manual_seed(seed * 1_000_003 + epoch * 1_009 + rank)


def create_eval_loader(
        name: str,
        root: Optional[str],
        data_config: Dict[str, Any],
        batch_size: int,
        *,
        split: str = 'validation',
        subset: Optional[int] = None,
        workers: int = 2,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
) -> DataLoader:
    """Evaluation loader: timm eval transforms, each process takes every `world_size`-th sample (no padding).

    Without padding the per-rank sums of loss / correct predictions add up to the exact metrics of the whole set.
    """
    transform = create_transform(**data_config, is_training=False)
    dataset = create_image_dataset(name, root, split, in_chans=data_config['input_size'][0], transform=transform)
    dataset = _subset(dataset, subset)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=list(range(rank, len(dataset), world_size)),
        num_workers=workers, pin_memory=pin_memory)

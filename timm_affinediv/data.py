"""Datasets and loaders for training: built-in Fashion-MNIST and every dataset of timm's `create_dataset`.

Fashion-MNIST is read from the gzipped IDX files of Debian's `dataset-fashion-mnist` (no download), and yields
PIL images so timm's transforms apply unchanged. Everything else goes through `timm.data.create_dataset`: image
folders and tars, `torch/NAME`, `hfds/NAME` (map-style), and the streams `wds/NAME`, `hfids/NAME`, `tfds/NAME`.
Loaders use `timm.data.resolve_data_config` + `create_transform`, and for map-style datasets a
`DistributedSampler` whose order depends only on (seed, epoch), so that a resumed run sees the same data order
as an uninterrupted one. Streams shuffle and shard themselves (timm's readers), seeded by (seed, epoch).
The training loader is timm train.py's prefetcher path by default: workers send uint8 batches (`fast_collate`,
mixup/cutmix in `FastCollateMixup`), and `BatchNormalizer` makes them float, normalised and erased on the device.
"""
import functools
import gzip
import importlib.util
import os
import struct
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from PIL import Image
from timm.data import FastCollateMixup, create_dataset, create_transform, resolve_data_config
from timm.data.distributed_sampler import RepeatAugSampler
from timm.data.loader import fast_collate
from timm.data.random_erasing import RandomErasing
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Subset

from .errors import ConfigError, DataError

__all__ = [
    'DataError', 'FashionMNIST', 'FASHION_MNIST_DIR', 'FASHION_MNIST_MEAN', 'FASHION_MNIST_STD',
    'FASHION_MNIST_CLASSES', 'is_fashion_mnist', 'resolve_dataset', 'create_image_dataset', 'dataset_num_classes',
    'dataset_class_names', 'resolve_dataset_data_config', 'create_train_loader', 'BatchNormalizer', 'set_loader_epoch',
    'create_eval_loader', 'dataset_scheme', 'is_stream',
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
        if zero == 0 and dtype_code in _IDX_DTYPES and file_ndim == ndim:
            shape = struct.unpack(f'>{ndim}I', data[4:4 + 4 * ndim])
            return np.frombuffer(data, dtype=_IDX_DTYPES[dtype_code], offset=4 + 4 * ndim).reshape(shape)
    except (OSError, EOFError, ValueError, struct.error) as e:
        raise DataError(_unreadable_idx(path, e)) from e
    raise DataError(_unreadable_idx(
        path, f'bad IDX header (dtype 0x{dtype_code:02x}, {file_ndim} dims, expected {ndim})'))


def _unreadable_idx(path: str, problem: Any) -> str:
    """The line for an IDX file that cannot be read because of `problem` (an exception or a description)."""
    return (f'cannot read Fashion-MNIST file {path}: {problem}. '
            'Reinstall it (apt-get install --reinstall dataset-fashion-mnist).')


def is_fashion_mnist(name: str) -> bool:
    """True for the names the built-in Fashion-MNIST answers to ('fashion-mnist', 'fashion_mnist', ...)."""
    return name.lower().replace('_', '-') in ('fashion-mnist', 'fashionmnist', 'fmnist')


def resolve_dataset(dataset: Optional[str], data_dir: Optional[str]) -> str:
    """ The dataset name the functions here take: `dataset` as given, or '' (the image folder at `data_dir`) where it
    is None. Raises `ConfigError` where neither says which data to read: the library has no default dataset.
    """
    if dataset is not None:
        return dataset
    if data_dir:
        return ''
    raise ConfigError("no dataset given: pass dataset='fashion-mnist' (the built-in one), a timm dataset name "
                      "('torch/cifar10', 'hfds/NAME', ...), or data_dir=PATH for an image folder")


_SCHEMES = {  # create_dataset prefix -> (module it needs, how to install it)
    'wds': ('webdataset', 'pip install "timm-affinediv[wds]"'),
    'hfds': ('datasets', 'pip install "timm-affinediv[hfds]"'),
    'hfids': ('datasets', 'pip install "timm-affinediv[hfds]"'),
    'tfds': ('tensorflow_datasets', 'pip install tensorflow-datasets'),
    'torch': ('torchvision', 'pip install torchvision'),
}


def dataset_scheme(name: str) -> str:
    """The `timm.data.create_dataset` scheme of a dataset name: 'wds', 'hfds', 'hfids', 'tfds', 'torch', or ''
    (an image folder or tar)."""
    prefix, sep, _ = name.partition('/')
    return prefix.lower() if sep and prefix.lower() in _SCHEMES else ''


class _CheckedImageDataset(Dataset):
    """A map-style timm/torchvision dataset whose images come in `img_mode`, and whose unreadable image fails
    loudly, naming the file (timm's folder reader would skip it with a warning)."""

    def __init__(self, dataset: Dataset, img_mode: str):
        self.dataset = dataset
        self.img_mode = img_mode
        self.transform: Optional[Callable] = None
        if hasattr(dataset, '_max_retries'):
            dataset._max_retries = 1  # timm retries the next sample on a decode error; make the first one fatal
        if hasattr(dataset, 'transform'):
            dataset.transform = None  # the mode is converted first, then `self.transform` applies

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Tuple[Any, Any]:
        try:
            img, target = self.dataset[index][:2]
        except RuntimeError as e:
            where = self.dataset.filename(index, absolute=True) if hasattr(self.dataset, 'filename') else index
            raise DataError(f'cannot read image {where} ({e}); remove or replace the file.') from e
        if isinstance(img, Image.Image) and img.mode != self.img_mode:
            img = img.convert(self.img_mode)  # torchvision's MNIST gives 'L', CIFAR 'RGB', whatever the model takes
        if self.transform is not None:
            img = self.transform(img)
        return img, target


def _check_scheme(name: str, root: Optional[str]) -> str:
    scheme = dataset_scheme(name)
    if scheme:
        module, install = _SCHEMES[scheme]
        if importlib.util.find_spec(module) is None:
            raise DataError(f"dataset '{name}' needs the '{module}' package: {install}.")
        if scheme in ('wds', 'torch') and not root:
            raise DataError(f"dataset '{name}' needs its data folder: pass --data-dir PATH.")
        return scheme
    if not root:
        raise DataError(f"dataset '{name}' needs a data folder: pass --data-dir PATH.")
    if not os.path.exists(root):
        raise DataError(f'data folder {root} does not exist; pass --data-dir with a folder of class sub-folders.')
    return scheme


def create_image_dataset(
        name: str,
        root: Optional[str],
        split: str,
        in_chans: int = 3,
        transform: Optional[Callable] = None,
        *,
        is_training: bool = False,
        num_samples: Optional[int] = None,
        batch_size: int = 1,
        seed: int = 42,
        workers: int = 0,
) -> Dataset:
    """Create the built-in Fashion-MNIST (`name='fashion-mnist'`) or any dataset of `timm.data.create_dataset`.

    Args:
        name: 'fashion-mnist'; '' (or any name without a scheme) for an image folder (`<root>/<split>/<class>/*`)
            or tar; `torch/NAME` (torchvision, from `root`, no download); `hfds/NAME` (Hugging Face `datasets`,
            map-style); streamed: `wds/NAME` (WebDataset shards and `_info.json` in `root`), `hfids/NAME`, `tfds/NAME`.
        root: data folder; for Fashion-MNIST None means `FASHION_MNIST_DIR`; for `hfds/` the cache folder.
        split: 'train' or 'validation' (timm searches `root` for a matching sub-folder).
        in_chans: 1 reads images as grayscale ('L'), 3 as RGB.
        transform: transform applied to each PIL image.
        is_training: streams shuffle (shards and samples, seeded by `seed` and the epoch).
        num_samples: the samples of a streamed split (when its `_info.json` / dataset info does not say).
        batch_size, workers: a stream's length per process is a whole number of batches of each loader worker.
    """
    if is_fashion_mnist(name):
        return FashionMNIST(root or FASHION_MNIST_DIR, split=split, transform=transform)
    scheme = _check_scheme(name, root)
    img_mode = 'L' if in_chans == 1 else 'RGB'
    try:
        dataset = create_dataset(
            name, root=root, split=split, is_training=is_training, input_img_mode=img_mode, batch_size=batch_size,
            num_samples=num_samples, seed=seed)
    except (RuntimeError, AssertionError, FileNotFoundError, ValueError) as e:
        hint = ('Put images in class sub-folders (<data-dir>/<split>/<class>/<image>).' if not scheme else
                'For a stream without its sample count, pass --train-num-samples / --val-num-samples.')
        raise DataError(f"cannot open dataset '{name}' (split {split}) at {root}: {e}. {hint}") from e
    if is_stream(dataset):
        dataset.set_loader_cfg(num_workers=workers)
        dataset.transform = transform
        return dataset
    if len(dataset) == 0:
        raise DataError(f'data folder {root} (split {split}) holds no images; put images in class sub-folders.')
    dataset = _CheckedImageDataset(dataset, img_mode)
    dataset.transform = transform
    return dataset


def is_stream(dataset: Dataset) -> bool:
    """True for an iterable (streamed) dataset: no random access, its own shuffling and sharding over processes."""
    return isinstance(dataset, IterableDataset)


def dataset_num_classes(dataset: Dataset) -> Optional[int]:
    """Number of classes of a dataset made by `create_image_dataset`, or None where it does not say (a stream of
    `.cls` labels)."""
    classes = _class_index(dataset)
    return len(classes) if classes else None


def dataset_class_names(dataset: Dataset) -> Optional[Tuple[str, ...]]:
    """The class names of a dataset made by `create_image_dataset`, by label: Fashion-MNIST's ten, an image
    folder's class folders, a timm dataset's classes (its reader's `class_to_idx`, a torchvision dataset's
    `classes`); None where it has none, or they do not name each label once."""
    classes = _class_index(dataset)
    if not classes:
        return None
    names = dict((index, str(name)) for name, index in classes)
    if len(names) != len(classes) or set(names) != set(range(len(names))):
        return None
    return tuple(names[index] for index in range(len(names)))


def _class_index(dataset: Dataset) -> Optional[List[Tuple[Any, int]]]:
    """(class name, label) pairs of a dataset made by `create_image_dataset`, as its reader or itself lists them."""
    if isinstance(dataset, Subset):
        return _class_index(dataset.dataset)
    inner = dataset.dataset if isinstance(dataset, _CheckedImageDataset) else dataset
    class_to_idx = getattr(getattr(inner, 'reader', None), 'class_to_idx', None) or getattr(inner, 'class_to_idx',
                                                                                           None)
    if class_to_idx:
        return list(class_to_idx.items())
    classes = getattr(inner, 'classes', None)
    return [(name, index) for index, name in enumerate(classes)] if classes else None


def resolve_dataset_data_config(
        name: str,
        model: Optional[torch.nn.Module] = None,
        in_chans: int = 3,
        img_size: Optional[int] = None,
        overrides: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """timm data config (input_size, interpolation, mean, std, crop_pct, crop_mode) for a dataset and model.

    Fashion-MNIST: 1 channel, 32x32 (resized from 28x28, no crop), its own mean / std. Other datasets: the
    model's pretrained config, with `in_chans` / `img_size` overriding it. `overrides`: train.py's
    `--input-size` / `--img-size` / `--crop-pct` / `--mean` / `--std` / `--interpolation` (`resolve_data_config`'s
    argument names), over both.
    """
    overrides = dict(overrides or {})
    if img_size:
        overrides.setdefault('img_size', img_size)
    if is_fashion_mnist(name):
        size = overrides.pop('img_size', None) or FASHION_MNIST_SIZE
        args = dict(input_size=(1, size, size), mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD,
                    interpolation='bilinear', crop_pct=1.0)
        return resolve_data_config({**args, **overrides})
    args = dict(in_chans=in_chans, **overrides)
    if 'img_size' in args and 'input_size' not in args:
        args['input_size'] = (in_chans, args['img_size'], args['img_size'])
    config = resolve_data_config(args, model=model)
    channels = config['input_size'][0]
    for key in ('mean', 'std'):
        if len(config[key]) != channels:  # an RGB pretrained_cfg used for a grayscale model, or a single value
            config[key] = (sum(config[key]) / len(config[key]),) * channels
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
        num_samples: Optional[int] = None,
        workers: int = 2,
        seed: int = 42,
        rank: int = 0,
        world_size: int = 1,
        augment: Optional[Dict[str, Any]] = None,
        prefetcher: bool = True,
        mixup: Optional[Dict[str, Any]] = None,
        aug_repeats: float = 0,
        pin_memory: bool = False,
) -> DataLoader:
    """Training loader: `timm.data.create_transform(**data_config, is_training=True, **augment)`, shuffled by a
    `DistributedSampler` (also with one process), or, for a stream, in the stream's own order. `aug_repeats` > 0:
    timm's `RepeatAugSampler` (train.py's `--aug-repeats`): each image `aug_repeats` times an epoch, augmented anew
    each time, the copies spread over the processes; an epoch keeps the dataset's length (rounded down to a multiple
    of 256 / processes when it has 256 images or more), its order depends on the epoch alone, as in train.py.

    `augment` holds `create_transform`'s training arguments by their timm names (`auto_augment`, `re_prob`,
    `scale`, `hflip`, ...). With `prefetcher` (timm train.py's default), batches are uint8 (`fast_collate`, or
    `FastCollateMixup(**mixup)` mixing them in the workers) and `BatchNormalizer` finishes them on the device;
    without, they are normalised and erased in the workers, and `mixup` is left to the caller (`timm.data.Mixup`).
    The order of an epoch and its augmentation depend only on (seed, epoch): call `set_loader_epoch(loader, epoch)`
    before each epoch. Batches are per process (`batch_size` each); the last incomplete batch is dropped. A stream
    shards itself over processes and loader workers (timm's readers) and takes no `subset`: `num_samples` sets its
    epoch length where its metadata does not.
    """
    transform = create_transform(**{**data_config, **(augment or {})}, is_training=True, use_prefetcher=prefetcher)
    dataset = create_image_dataset(
        name, root, split, in_chans=data_config['input_size'][0], transform=transform, is_training=True,
        num_samples=num_samples, batch_size=batch_size, seed=seed, workers=workers)
    if is_stream(dataset):
        if subset:
            raise DataError(f"a streamed dataset ('{name}') has no random access for a subset: pass "
                            f'--train-num-samples {subset} to shorten its epochs instead.')
        if aug_repeats:
            raise DataError(f"a streamed dataset ('{name}') has no random access to repeat images: leave out "
                            f'--aug-repeats.')
        sampler = None
    else:
        dataset = _subset(dataset, subset)
        sampler = RepeatAugSampler(dataset, num_replicas=world_size, rank=rank, num_repeats=aug_repeats) \
            if aug_repeats else DistributedSampler(
                dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    per_process = len(dataset) if sampler is None else len(sampler)
    if per_process < batch_size:
        raise DataError(
            f'the training set gives {per_process} images an epoch to each of {world_size} processes, fewer than one '
            f'batch ({batch_size}); lower --batch-size or use more data.')
    collate = None
    if prefetcher and mixup:  # the dataset's class count first, as the trainer sizes the head
        collate = FastCollateMixup(**{**mixup, 'num_classes': dataset_num_classes(dataset) or mixup['num_classes']})
    elif prefetcher:
        collate = fast_collate
    # not persistent: each epoch's workers are seeded afresh from (seed, epoch), so a resumed epoch draws the same
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, drop_last=True, collate_fn=collate,
        pin_memory=pin_memory, generator=torch.Generator(), persistent_workers=False)


class BatchNormalizer:
    """ The device half of timm's prefetcher (`timm.data.PrefetchLoader`) for a uint8 batch of a prefetcher
    loader: `x = (float(x) - 255 mean) / (255 std)` on `device`, then timm's `RandomErasing` there, in `memory_format`.

    Unlike `PrefetchLoader`, it runs when a batch is consumed, not one batch ahead, so the erasing draws from the
    random state in batch order: a run resumed mid-epoch draws exactly what the uninterrupted one did.
    """

    def __init__(self, data_config: Dict[str, Any], device: torch.device, re_prob: float = 0., re_mode: str = 'pixel',
                 re_count: int = 1, memory_format: torch.memory_format = torch.contiguous_format):
        shape = (1, -1, 1, 1)
        self.device = device
        self.mean = torch.tensor([255 * m for m in data_config['mean']], device=device).view(shape)
        self.std = torch.tensor([255 * s for s in data_config['std']], device=device).view(shape)
        self.random_erasing = RandomErasing(
            probability=re_prob, mode=re_mode, max_count=re_count, device=device) if re_prob > 0 else None
        self.memory_format = memory_format

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True).float().sub_(self.mean).div_(self.std)
        if self.random_erasing is not None:
            x = self.random_erasing(x)
        return x.contiguous(memory_format=self.memory_format)


def set_loader_epoch(loader: DataLoader, epoch: int, seed: int, rank: int = 0) -> None:
    """Fix the data order and the worker seeds (augmentation) of `epoch` for a loader from `create_train_loader`."""
    if loader.sampler is not None and hasattr(loader.sampler, 'set_epoch'):
        loader.sampler.set_epoch(epoch)
    if hasattr(loader.dataset, 'set_epoch'):  # a stream's shard and sample shuffle
        loader.dataset.set_epoch(epoch)
    loader.generator.manual_seed(seed * 1_000_003 + epoch * 1_009 + rank)


def create_eval_loader(
        name: str,
        root: Optional[str],
        data_config: Dict[str, Any],
        batch_size: int,
        *,
        split: str = 'validation',
        subset: Optional[int] = None,
        num_samples: Optional[int] = None,
        workers: int = 2,
        rank: int = 0,
        world_size: int = 1,
        pin_memory: bool = False,
) -> DataLoader:
    """Evaluation loader: timm eval transforms, each process takes every `world_size`-th sample (no padding).

    Without padding the per-rank sums of loss / correct predictions add up to the exact metrics of the whole set.
    A stream is split over processes by its shards (timm's readers), in order.
    """
    transform = create_transform(**data_config, is_training=False)
    dataset = create_image_dataset(name, root, split, in_chans=data_config['input_size'][0], transform=transform,
                                   num_samples=num_samples, batch_size=batch_size, workers=workers)
    if is_stream(dataset):
        return DataLoader(dataset, batch_size=batch_size, num_workers=workers, pin_memory=pin_memory)
    dataset = _subset(dataset, subset)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=list(range(rank, len(dataset), world_size)),
        num_workers=workers, pin_memory=pin_memory)

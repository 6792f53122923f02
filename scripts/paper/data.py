""" Fashion-MNIST in memory, as the paper experiments train on it """
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from timm_affinediv.data import FASHION_MNIST_DIR, FASHION_MNIST_MEAN, FASHION_MNIST_STD, FashionMNIST

__all__ = ['Splits', 'load_fashion_mnist']


@dataclass
class Splits:
    """In-memory train / validation / test tensors: images `(N, 1, H, W)` normalised, int64 labels."""
    train: Tuple[torch.Tensor, torch.Tensor]
    val: Tuple[torch.Tensor, torch.Tensor]
    test: Tuple[torch.Tensor, torch.Tensor]


def load_fashion_mnist(
        n_train: int, n_val: int, n_test: int, size: int = 28, root: Optional[str] = None, split_seed: int = 0,
) -> Splits:
    """ Fashion-MNIST subsets as normalised tensors, zero-padded (in pixel space) to `size`.

    Train and validation are disjoint random subsets of the 60k training images (fixed by
    `split_seed`), test is the first `n_test` of the 10k test images.
    """
    def to_tensors(ds, index):
        images = torch.from_numpy(ds.images[index]).float().div_(255).unsqueeze(1)
        pad = (size - images.shape[-1]) // 2
        if pad < 0 or size - images.shape[-1] != 2 * pad:
            raise ValueError(f"size must be 28 plus an even padding, got {size}")
        images = F.pad(images, (pad, pad, pad, pad))
        images = (images - FASHION_MNIST_MEAN[0]) / FASHION_MNIST_STD[0]
        return images, torch.from_numpy(ds.targets[index])

    root = root or FASHION_MNIST_DIR
    train = FashionMNIST(root=root, split='train')
    test = FashionMNIST(root=root, split='test')
    if n_train + n_val > len(train) or n_test > len(test):
        raise ValueError(f"asked for {n_train}+{n_val} training and {n_test} test images; "
                         f"Fashion-MNIST has {len(train)} and {len(test)}")
    order = np.random.default_rng(split_seed).permutation(len(train))
    return Splits(
        to_tensors(train, order[:n_train]), to_tensors(train, order[n_train:n_train + n_val]),
        to_tensors(test, np.arange(n_test)))

"""Inputs for sparse DNNs: binary feature vectors of length N (§6.1).

The challenge scales MNIST's 28x28 images to sqrt(N) x sqrt(N), thresholds and flattens them.
The embedded default does the same with scikit-learn's bundled 8x8 digits (no download); real
MNIST is read from IDX files when the user points at them (with the project's one IDX reader,
:func:`models.data.read_idx`).  :func:`train_test_split` holds out a fixed part of the images
for the test accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from models.data import (
    IDX_IMAGES_MAGIC,
    IDX_LABELS_MAGIC,
    DatasetFormatError,
    read_digits,
    read_idx,
)

__all__ = ["Dataset", "class_targets", "digits_dataset", "images_to_features", "mnist_dataset",
           "train_test_split"]


@dataclass(frozen=True)
class Dataset:
    """Binary features (num_images, N) float32 in {0, 1} and integer labels."""

    features: np.ndarray
    labels: np.ndarray
    name: str


def _side(neurons: int) -> int:
    s = math.isqrt(neurons)
    if s * s != neurons:
        raise ValueError(f"N={neurons} is not a square; images are scaled to sqrt(N) x sqrt(N), "
                         "so use N in {1024, 4096, 16384, 65536}")
    return s


def images_to_features(images: np.ndarray, neurons: int, threshold: float) -> np.ndarray:
    """Scale (nearest neighbour) to sqrt(N) x sqrt(N), threshold and flatten (§6.1).

    ``images`` are (num, h, w) with values in [0, 1]; a pixel becomes 1 when > ``threshold``.
    """
    s = _side(neurons)
    n, h, w = images.shape
    ri = (np.arange(s) * h) // s
    ci = (np.arange(s) * w) // s
    scaled = images[:, ri][:, :, ci]
    return (scaled > threshold).reshape(n, s * s).astype(np.float32)


def digits_dataset(neurons: int, threshold: float = 0.25) -> Dataset:
    """scikit-learn's 8x8 digits (1797 images, values 0..16) as binary vectors of length N,
    read from its bundled file without importing scikit-learn (:func:`models.data.read_digits`)."""
    images, target = read_digits()
    return Dataset(images_to_features(images / 16.0, neurons, threshold), target, "digits")


def mnist_dataset(images_path, labels_path, neurons: int, threshold: float = 0.5,
                  limit: int | None = None) -> Dataset:
    """MNIST from IDX files, scaled to sqrt(N) x sqrt(N), thresholded and flattened."""
    images = read_idx(images_path, IDX_IMAGES_MAGIC)
    labels = read_idx(labels_path, IDX_LABELS_MAGIC).astype(np.int64)
    if labels.shape[0] != images.shape[0]:
        raise DatasetFormatError(f"{labels_path}: {labels.shape[0]} labels but {images_path} has "
                                 f"{images.shape[0]} images; pass matching IDX files")
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return Dataset(images_to_features(images.astype(np.float64) / 255.0, neurons, threshold),
                   labels, "mnist")


def class_targets(labels: np.ndarray, neurons: int, num_classes: int = 10) -> np.ndarray:
    """Targets y for the MSE loss: y(j) = 1 where j mod num_classes == label, else 0.

    Shape (num_images, N) float32: every output neuron has a target, so every processor's part
    of x^L contributes to the loss.
    """
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes})")
    j = np.arange(neurons) % num_classes
    return (j[None, :] == labels[:, None]).astype(np.float32)


def train_test_split(ds: Dataset, test_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """A fixed split: a permutation from ``default_rng([seed, 3])``; its first
    ``round(test_fraction * n)`` images are the held-out test set (0: an empty test set)."""
    if not 0 <= test_fraction < 1:
        raise ValueError(f"--test-fraction must be in [0, 1), got {test_fraction}")
    n = ds.features.shape[0]
    perm = np.random.default_rng([seed, 3]).permutation(n)
    n_test = int(round(test_fraction * n))
    test, train = np.sort(perm[:n_test]), np.sort(perm[n_test:])
    return (Dataset(ds.features[train], ds.labels[train], ds.name),
            Dataset(ds.features[test], ds.labels[test], ds.name + "-test"))

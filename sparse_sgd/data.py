"""Inputs for sparse DNNs: binary feature vectors of length N (§6.1).

The challenge scales MNIST's 28x28 images to sqrt(N) x sqrt(N), thresholds and flattens them.
The embedded default does the same with scikit-learn's bundled 8x8 digits (no download); real
MNIST is read from IDX files when the user points at them.
"""

from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Dataset", "class_targets", "digits_dataset", "images_to_features", "mnist_dataset",
           "read_idx"]


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
    """scikit-learn's 8x8 digits (1797 images, values 0..16) as binary vectors of length N."""
    from sklearn.datasets import load_digits  # noqa: PLC0415 - bundled with sklearn, no download

    d = load_digits()
    images = d.images.astype(np.float64) / 16.0
    return Dataset(images_to_features(images, neurons, threshold), d.target.astype(np.int64),
                   "digits")


def read_idx(path) -> np.ndarray:
    """Read an IDX file (MNIST format, optionally gzipped) into a NumPy array."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number); pass MNIST's "
                         "train-images-idx3-ubyte / train-labels-idx1-ubyte files")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ValueError(f"{path}: unknown IDX data type 0x{raw[2]:02x}")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    data = np.frombuffer(raw, dtype=dtypes[raw[2]], offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: truncated IDX file ({data.size} of {int(np.prod(dims))} "
                         "values)")
    return data.reshape(tuple(dims))


def mnist_dataset(images_path, labels_path, neurons: int, threshold: float = 0.5,
                  limit: int | None = None) -> Dataset:
    """MNIST from IDX files, scaled to sqrt(N) x sqrt(N), thresholded and flattened."""
    images = read_idx(images_path)
    labels = read_idx(labels_path).astype(np.int64)
    if images.ndim != 3 or labels.shape[0] != images.shape[0]:
        raise ValueError(f"{images_path} / {labels_path}: expected (n, h, w) images and n labels")
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

"""Datasets (digits, MNIST IDX, CIFAR-10 pickles, synthetic), sharding and mini-batches.

* Images are ``(N, C, H, W)`` float32 and labels ``(N,)`` int64.  Loaders scale pixels to
  ``[0, 1]`` and then normalize every channel with the *training* set's mean and standard
  deviation (:func:`channel_stats`, :func:`normalize`), applied to both splits.
* :func:`shard` gives each rank a disjoint, equal-size, deterministic slice (the remainder is
  dropped so every rank runs the same number of steps).
* :func:`iterate_batches` shuffles with ``numpy.random.default_rng([seed, rank, epoch])``; the
  global NumPy RNG is never used.
* Corrupt input raises :class:`DatasetFormatError` (a ``ValueError``) and missing input
  :class:`DatasetNotFoundError` (a ``FileNotFoundError``); both name the file and what was
  expected.
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import io
import os
import pickle
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np

__all__ = [
    "DATASETS",
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "Dataset",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "DatasetSplit",
    "ShardSplit",
    "channel_stats",
    "check_batch_size",
    "iterate_batches",
    "load_cifar10",
    "load_dataset",
    "load_digits",
    "load_mnist",
    "load_shard",
    "make_synthetic",
    "normalize",
    "num_batches",
    "read_digits",
    "read_idx",
    "shard",
]

#: IDX magic number of an unsigned-byte 3-D array (MNIST images): 0x00000803.
IDX_IMAGES_MAGIC = 2051
#: IDX magic number of an unsigned-byte 1-D array (MNIST labels): 0x00000801.
IDX_LABELS_MAGIC = 2049


class DatasetFormatError(ValueError):
    """A dataset file exists but is not what was expected (wrong magic, truncated, bad shape)."""


class DatasetNotFoundError(FileNotFoundError, ValueError):
    """A dataset directory or file is missing (an input error: a ``ValueError`` too, so the
    runner's error path reports it in one line, without a traceback)."""


@dataclass(frozen=True, eq=False)
class Dataset:
    """Images and labels of one split.

    Attributes
    ----------
    x : array (N, C, H, W), float32 (NumPy or CuPy)
    y : array (N,), int64
    num_classes : int
    name : str
    """

    x: object
    y: object
    num_classes: int
    name: str = "dataset"

    def __post_init__(self) -> None:
        if self.x.ndim < 2 or self.y.ndim != 1 or self.x.shape[0] != self.y.shape[0]:
            raise ValueError(f"dataset {self.name!r}: x must be (N, ...) and y (N,), got "
                             f"{tuple(self.x.shape)} and {tuple(self.y.shape)}")
        if self.num_classes < 1:
            raise ValueError(f"dataset {self.name!r}: num_classes must be >= 1")

    def __len__(self) -> int:
        return int(self.x.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Per-sample shape ``(C, H, W)``."""
        return tuple(int(s) for s in self.x.shape[1:])

    def subset(self, indices) -> Dataset:
        """Rows ``indices`` (copied)."""
        return Dataset(self.x[indices], self.y[indices], self.num_classes, self.name)

    def to(self, xp) -> Dataset:
        """The same data as ``xp`` arrays (``numpy`` or ``cupy``)."""
        return Dataset(xp.asarray(self.x), xp.asarray(self.y), self.num_classes, self.name)


class DatasetSplit(NamedTuple):
    """``(train, test)`` pair returned by every loader."""

    train: Dataset
    test: Dataset


# ---------------------------------------------------------------------------------------------
# normalization
# ---------------------------------------------------------------------------------------------
def channel_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and standard deviation of ``(N, C, H, W)`` images (float64).

    A channel with zero variance gets std 1 so that normalization never divides by zero.
    """
    x = np.asarray(x)
    axes = (0,) + tuple(range(2, x.ndim))
    mean = x.mean(axis=axes, dtype=np.float64)
    std = x.std(axis=axes, dtype=np.float64)
    std[std == 0] = 1.0
    return mean, std


def normalize(ds: Dataset, mean, std) -> Dataset:
    """``(x − mean_c) / std_c`` per channel, as float32."""
    mean = np.asarray(mean, dtype=np.float64)
    std = np.asarray(std, dtype=np.float64)
    if mean.shape != (ds.x.shape[1],) or std.shape != mean.shape:
        raise ValueError(f"mean/std need one value per channel ({ds.x.shape[1]}), got "
                         f"{mean.shape}, {std.shape}")
    if np.any(std <= 0):
        raise ValueError("std must be > 0 for every channel")
    shape = (1, -1) + (1,) * (ds.x.ndim - 2)
    x = ((ds.x - mean.reshape(shape)) / std.reshape(shape)).astype(np.float32)
    return Dataset(x, ds.y, ds.num_classes, ds.name)


def _finish(train: Dataset, test: Dataset, do_normalize: bool) -> DatasetSplit:
    if do_normalize:
        mean, std = channel_stats(train.x)
        train, test = normalize(train, mean, std), normalize(test, mean, std)
    return DatasetSplit(train, test)


# ---------------------------------------------------------------------------------------------
# digits (scikit-learn, bundled, no download)
# ---------------------------------------------------------------------------------------------
def _digits_file() -> Path | None:
    """scikit-learn's ``datasets/data/digits.csv.gz``, located without importing scikit-learn."""

    spec = importlib.util.find_spec("sklearn")
    for base in (spec.submodule_search_locations or []) if spec else []:
        path = Path(base) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    return None


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as ``(images (N, 8, 8) float64 in 0..16, labels (N,) int64)``.

    Reads scikit-learn's bundled CSV (64 pixel columns, then the label) directly: importing
    :mod:`sklearn.datasets` costs every rank ~65 MiB of resident memory and seconds of start-up.
    Falls back to :func:`sklearn.datasets.load_digits` where the file is not found.
    """
    path = _digits_file()
    if path is None:
        try:
            from sklearn.datasets import load_digits as _sk_load_digits  # noqa: PLC0415 (optional dataset source, ~1 s to import)
        except ImportError as e:
            raise DatasetNotFoundError(
                "the digits dataset ships with scikit-learn, which is not installed; "
                "pip install scikit-learn") from e
        bunch = _sk_load_digits()
        return np.asarray(bunch.images, dtype=np.float64), np.asarray(bunch.target, np.int64)
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    if data.ndim != 2 or data.shape[1] != 65:
        raise DatasetFormatError(f"{path}: expected 65 comma-separated columns (64 pixels and "
                                 f"the label), got shape {data.shape}")
    return data[:, :64].reshape(-1, 8, 8), data[:, 64].astype(np.int64)


def load_digits(*, test_fraction: float = 0.2, split_seed: int = 0,
                normalize_data: bool = True) -> DatasetSplit:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), shape ``(N, 1, 8, 8)``.

    Pixels (0..16) are scaled to ``[0, 1]`` and normalized with the training mean/std.  The split
    is a fixed permutation from ``default_rng(split_seed)``: the first ``round(test_fraction N)``
    samples are the test set.

    Parameters
    ----------
    test_fraction : float in (0, 1)
    split_seed : int
    normalize_data : bool
    """
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    images, target = read_digits()
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    y = target.astype(np.int64)
    perm = np.random.default_rng(split_seed).permutation(len(y))
    n_test = round(test_fraction * len(y))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    train = Dataset(x[train_idx], y[train_idx], 10, "digits")
    test = Dataset(x[test_idx], y[test_idx], 10, "digits")
    return _finish(train, test, normalize_data)


# ---------------------------------------------------------------------------------------------
# MNIST (IDX files, raw or gzip)
# ---------------------------------------------------------------------------------------------
def _read_bytes(path: Path) -> bytes:
    """File contents, gunzipped for ``.gz``; errors name the file."""
    if not path.is_file():
        raise DatasetNotFoundError(f"{path}: file not found")
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise DatasetFormatError(
            f"{path}: cannot decompress ({exc}); expected a complete gzip file, re-download it"
        ) from exc


def read_idx(path, expected_magic: int) -> np.ndarray:
    """Read an IDX file of unsigned bytes (raw or ``.gz``) and check its header.

    Parameters
    ----------
    path : str or Path
    expected_magic : int
        :data:`IDX_IMAGES_MAGIC` (2051, 3-D) or :data:`IDX_LABELS_MAGIC` (2049, 1-D).

    Returns
    -------
    numpy.ndarray of uint8 with the dimensions from the header.

    Raises
    ------
    DatasetNotFoundError
        The file does not exist.
    DatasetFormatError
        Wrong magic number, header or payload shorter/longer than the header says.
    """
    path = Path(path)
    kinds = {IDX_IMAGES_MAGIC: "images", IDX_LABELS_MAGIC: "labels"}
    if expected_magic not in kinds:
        raise ValueError(f"expected_magic must be {IDX_IMAGES_MAGIC} (images) or "
                         f"{IDX_LABELS_MAGIC} (labels), got {expected_magic}")
    raw = _read_bytes(path)
    what = kinds[expected_magic]
    if len(raw) < 4:
        raise DatasetFormatError(f"{path}: truncated IDX header ({len(raw)} bytes); expected at "
                                 f"least 4 bytes for the magic number of an {what} file")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        hint = ""
        if magic in kinds:
            hint = f"; is this a {kinds[magic]} file?"
        raise DatasetFormatError(
            f"{path}: expected magic {expected_magic} for {what}, got {magic}{hint}; not an "
            f"IDX {what} file, or damaged: re-download it")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetFormatError(f"{path}: truncated IDX header; expected {header} bytes for "
                                 f"{ndim} dimensions, got {len(raw)}")
    dims = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    n_data = int(np.prod(dims, dtype=np.int64))
    if len(raw) - header != n_data:
        state = "truncated" if len(raw) - header < n_data else "has trailing bytes"
        raise DatasetFormatError(
            f"{path}: {state}; header says dims {dims} = {n_data} data bytes, file has "
            f"{len(raw) - header}: re-download it")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_file(root: Path, candidates: list[str], dataset: str) -> Path:
    for name in candidates:
        p = root / name
        if p.is_file():
            return p
    raise DatasetNotFoundError(
        f"{root / candidates[0]}: {dataset} file not found in {root} (looked for "
        f"{', '.join(candidates)})")


def _mnist_file(root: Path, split: str, kind: str) -> Path:
    n = 3 if kind == "images" else 1
    names = [f"{split}-{kind}-idx{n}-ubyte", f"{split}-{kind}.idx{n}-ubyte"]
    return _find_file(root, [v for nm in names for v in (nm, nm + ".gz")], "MNIST")


def load_mnist(root, *, normalize_data: bool = True) -> DatasetSplit:
    """MNIST (or Fashion-MNIST) from the four IDX files in ``root``, shape ``(N, 1, 28, 28)``.

    Looks for ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each optionally ``.gz``; the
    ``train-images.idx3-ubyte`` spelling also works).  Nothing is downloaded.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetNotFoundError(
            f"{root}: MNIST directory does not exist; put train-images-idx3-ubyte(.gz), "
            "train-labels-idx1-ubyte(.gz), t10k-images-idx3-ubyte(.gz) and "
            "t10k-labels-idx1-ubyte(.gz) there")
    splits = []
    for split in ("train", "t10k"):
        img_path = _mnist_file(root, split, "images")
        lab_path = _mnist_file(root, split, "labels")
        images = read_idx(img_path, IDX_IMAGES_MAGIC)
        labels = read_idx(lab_path, IDX_LABELS_MAGIC)
        if images.ndim != 3:
            raise DatasetFormatError(f"{img_path}: expected 3 dimensions (N, H, W), got "
                                     f"{images.ndim}")
        if labels.ndim != 1:
            raise DatasetFormatError(f"{lab_path}: expected 1 dimension (N,), got {labels.ndim}")
        if images.shape[0] != labels.shape[0]:
            raise DatasetFormatError(f"{lab_path}: {labels.shape[0]} labels but {img_path} has "
                                     f"{images.shape[0]} images; expected equal counts")
        if labels.size and labels.max() > 9:
            raise DatasetFormatError(f"{lab_path}: label {int(labels.max())} out of range; "
                                     "expected 0..9")
        x = (images.astype(np.float32) / 255.0)[:, None, :, :]
        splits.append(Dataset(x, labels.astype(np.int64), 10, "mnist"))
    return _finish(splits[0], splits[1], normalize_data)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 (python pickle batches)
# ---------------------------------------------------------------------------------------------
class _CifarUnpickler(pickle.Unpickler):
    """Unpickler that only reconstructs NumPy arrays and builtin containers (no code execution)."""

    _ALLOWED: ClassVar[dict] = {
        ("numpy.core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"): ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.numeric", "_frombuffer"): ("numpy._core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"): ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"): ("numpy", "ndarray"),
        ("numpy", "dtype"): ("numpy", "dtype"),
        ("_codecs", "encode"): ("_codecs", "encode"),   # bytes in protocol-2 pickles
    }

    def find_class(self, module, name):
        target = self._ALLOWED.get((module, name))
        if target is None:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")

        return getattr(importlib.import_module(target[0]), target[1])


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise DatasetNotFoundError(f"{path}: CIFAR-10 batch not found") from exc
    try:
        obj = _CifarUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as exc:  # truncated / not a pickle / disallowed content
        raise DatasetFormatError(
            f"{path}: not a readable CIFAR-10 python batch ({type(exc).__name__}: {exc}); "
            "expected a complete pickle of a dict with b'data' and b'labels' "
            "(file truncated or wrong format?)") from exc
    if not isinstance(obj, dict):
        raise DatasetFormatError(f"{path}: expected a dict with b'data' and b'labels', got "
                                 f"{type(obj).__name__}")
    def get(k):
        return obj.get(k.encode(), obj.get(k))
    data, labels = get("data"), get("labels")
    if data is None or labels is None:
        raise DatasetFormatError(f"{path}: expected keys b'data' and b'labels', found "
                                 f"{sorted(map(repr, obj))}")
    data = np.asarray(data)
    labels = np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DatasetFormatError(f"{path}: expected b'data' as uint8 (N, 3072), got "
                                 f"{data.dtype} {data.shape}")
    if labels.shape != (data.shape[0],):
        raise DatasetFormatError(f"{path}: {labels.shape[0]} labels for {data.shape[0]} images; "
                                 "expected equal counts")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DatasetFormatError(f"{path}: labels outside 0..9")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_root(root) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise DatasetNotFoundError(
            f"{root}: CIFAR-10 directory does not exist; extract cifar-10-python.tar.gz there "
            "(data_batch_1..5, test_batch)")
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    for name in _CIFAR_TRAIN + _CIFAR_TEST:
        if not (root / name).is_file():
            raise DatasetNotFoundError(f"{root / name}: CIFAR-10 batch not found; expected "
                                       "data_batch_1..5 and test_batch in " + str(root))
    return root


_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = ("test_batch",)
#: ``v / 255`` in float32 for every byte value (the pixel values of a CIFAR image).
_U8_TO_F32 = (np.arange(256, dtype=np.float32) / np.float32(255.0))


def _cifar_set(root: Path, names, rows: np.ndarray | None = None):
    """Images ``(n, 3, 32, 32)`` float32 in [0, 1], labels, and per-channel byte histograms
    ``(3, 256)`` of the WHOLE set, reading one batch file at a time.  ``rows`` (ascending
    positions in the concatenated set) keeps only those images: the whole set is never held."""
    xs, ys, hist, start = [], [], np.zeros((3, 256), dtype=np.int64), 0
    for name in names:
        data, labels = _read_cifar_batch(root / name)
        n = data.shape[0]
        for c in range(3):
            hist[c] += np.bincount(data[:, c].ravel(), minlength=256)
        if rows is None:
            keep = slice(None)
        else:
            lo, hi = np.searchsorted(rows, [start, start + n])
            keep = rows[lo:hi] - start
        xs.append(_U8_TO_F32[data[keep]])
        ys.append(labels[keep])
        start += n
    return np.concatenate(xs), np.concatenate(ys), hist, start


def _stats_from_histogram(hist: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`channel_stats` of images whose per-channel byte histograms are ``hist``: the same
    float64 mean and standard deviation of the float32 values ``v / 255``, without the images
    (equal to float64 round-off: the sums run over 256 values instead of every pixel)."""
    v = _U8_TO_F32.astype(np.float64)
    n = hist.sum(axis=1)
    mean = (hist * v).sum(axis=1) / n
    std = np.sqrt((hist * (v[None, :] - mean[:, None]) ** 2).sum(axis=1) / n)
    std[std == 0] = 1.0
    return mean, std


def load_cifar10(root, *, normalize_data: bool = True) -> DatasetSplit:
    """CIFAR-10 from the python batches ``data_batch_1..5`` and ``test_batch``, ``(N, 3, 32, 32)``.

    ``root`` is the ``cifar-10-batches-py`` directory or its parent.  Nothing is downloaded.
    The batch files are read one at a time (see :func:`load_shard` for one rank's shard).
    """
    return _load_cifar10(root, normalize_data)[0]


def _load_cifar10(root, normalize_data: bool = True, rank_shard=None) -> tuple[DatasetSplit, int]:
    """CIFAR-10 and the size of its whole training set.  With ``rank_shard=(rank, size, seed)``
    ``train`` is that rank's :func:`shard`: the other images are dropped batch by batch as the
    files are read (a rank holds 1/size of the 600 MB float32 training set, never all of it),
    and the normalization statistics are still the whole training set's (per-batch byte
    histograms)."""
    root = _cifar_root(root)
    rows = idx = None
    n_total = None
    if rank_shard is not None:
        n_total = sum(_cifar_count(root / name) for name in _CIFAR_TRAIN)
        idx = _shard_positions(n_total, *rank_shard)
        rows = np.sort(idx)
    x, y, hist, n_total = _cifar_set(root, _CIFAR_TRAIN, rows)
    if idx is not None:             # back to the shard's own order (that of the permutation)
        pos = np.searchsorted(rows, idx)
        x, y = x[pos], y[pos]
    xt, yt, _, _ = _cifar_set(root, _CIFAR_TEST)
    train, test = Dataset(x, y, 10, "cifar10"), Dataset(xt, yt, 10, "cifar10")
    if normalize_data:
        mean, std = _stats_from_histogram(hist)
        train, test = normalize(train, mean, std), normalize(test, mean, std)
    return DatasetSplit(train, test), n_total


def _cifar_count(path: Path) -> int:
    """Images in one CIFAR batch (read and validated; the file is small next to the set)."""
    return _read_cifar_batch(path)[0].shape[0]


# ---------------------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------------------
def make_synthetic(*, n_train: int = 1024, n_test: int = 256, input_shape=(1, 8, 8),
                   num_classes: int = 10, noise: float = 1.0, seed: int = 0) -> DatasetSplit:
    """Gaussian class clusters: ``x = mu_y + noise · e``, ``mu_k ~ N(0, I)``, ``e ~ N(0, I)``.

    Deterministic in ``seed``; learnable (the Bayes error shrinks as ``noise`` decreases).
    """
    if n_train < 1 or n_test < 1 or num_classes < 2 or noise < 0:
        raise ValueError("make_synthetic needs n_train, n_test >= 1, num_classes >= 2, noise >= 0")
    shape = tuple(int(s) for s in input_shape)
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal((num_classes, *shape))

    def draw(n):
        y = rng.integers(0, num_classes, n)
        x = mu[y] + noise * rng.standard_normal((n, *shape))
        return Dataset(x.astype(np.float32), y.astype(np.int64), num_classes, "synthetic")

    return DatasetSplit(draw(n_train), draw(n_test))


def _needs_root(fn: Callable[..., DatasetSplit], name: str) -> Callable[..., DatasetSplit]:
    def load(root=None, **kwargs):
        if root is None:
            raise ValueError(f"dataset {name!r} needs a data directory: pass --data-dir DIR")
        return fn(root, **kwargs)
    load.__doc__ = fn.__doc__
    return load


#: ``--dataset`` name -> loader ``(root=None, **kwargs) -> DatasetSplit``
DATASETS: dict[str, Callable[..., DatasetSplit]] = {
    "digits": lambda root=None, **kw: load_digits(**kw),
    "mnist": _needs_root(load_mnist, "mnist"),
    "cifar10": _needs_root(load_cifar10, "cifar10"),
    "synthetic": lambda root=None, **kw: make_synthetic(**kw),
}


def load_dataset(name: str, root=None, **kwargs) -> DatasetSplit:
    """Load ``DATASETS[name]``; ValueError listing the valid names for an unknown one."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {sorted(DATASETS)}")
    if root is not None:
        root = os.fspath(root)
    return DATASETS[name](root, **kwargs)


# ---------------------------------------------------------------------------------------------
# sharding and mini-batches
# ---------------------------------------------------------------------------------------------
def shard(dataset: Dataset, rank: int, size: int, *, seed: int | None = None) -> Dataset:
    """Rank ``rank``'s shard of ``size`` disjoint, equal, deterministic shards.

    Shard ``r`` holds positions ``[r n, (r + 1) n)`` of the order (``n = N // size``; the last
    ``N mod size`` samples are dropped).  The order is the dataset order, or a fixed permutation
    ``default_rng(seed).permutation(N)`` when ``seed`` is given (same on every rank).
    """
    idx = _shard_positions(len(dataset), rank, size, seed)
    xp_idx = idx if isinstance(dataset.x, np.ndarray) else _to_module(dataset.x, idx)
    return dataset.subset(xp_idx)


def _shard_positions(N: int, rank: int, size: int, seed: int | None = None) -> np.ndarray:
    """Positions of rank ``rank``'s :func:`shard` in a set of ``N`` samples."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need 0 <= rank < size, got rank={rank}, size={size}")
    n = N // size
    if n == 0:
        raise ValueError(f"{N} samples cannot be split into {size} non-empty shards; use fewer "
                         "ranks or more data")
    order = np.arange(N) if seed is None else np.random.default_rng(seed).permutation(N)
    return order[rank * n:(rank + 1) * n]


class ShardSplit(NamedTuple):
    """What :func:`load_shard` returns: this rank's ``train`` shard, the whole ``test`` set, and
    ``train_total``, the size of the whole training set the shard was cut from."""

    train: Dataset
    test: Dataset
    train_total: int


def load_shard(name: str, root=None, *, rank: int, size: int, seed: int | None = None,
               **kwargs) -> ShardSplit:
    """Rank ``rank``'s :func:`shard` of dataset ``name``'s training set (and its test set).

    Equal to ``shard(load_dataset(name, root).train, rank, size, seed=seed)`` (to float32
    round-off of the normalization statistics); for CIFAR-10 the other ranks' images are
    dropped batch by batch as the files are read, so no rank holds the whole training set.  The
    small sets (digits, MNIST, synthetic, text) are loaded whole and cut.
    """
    if name == "cifar10":
        if root is None:
            raise ValueError("dataset 'cifar10' needs a data directory: pass --data-dir DIR")
        split, total = _load_cifar10(os.fspath(root), rank_shard=(rank, size, seed), **kwargs)
        return ShardSplit(split.train, split.test, total)
    split = load_dataset(name, root, **kwargs)
    return ShardSplit(shard(split.train, rank, size, seed=seed), split.test, len(split.train))


def _to_module(like, idx: np.ndarray):
    from substrate.backend import array_module  # noqa: PLC0415 (CuPy-aware index conversion; models import no backend at module level)

    return array_module(like).asarray(idx)


def check_batch_size(batch_size: int, available: int, what: str,
                     flag: str = "--batch-size") -> None:
    """Refuse a mini-batch larger than the samples it is drawn from.

    Raises
    ------
    ValueError
        ``"{flag} B is larger than {what} (N samples): pass {flag} N or less"``, e.g. with
        ``what = "each rank's shard of the 1438 digits training samples split over 4 ranks"``.
    """
    if batch_size > available:
        raise ValueError(f"{flag} {batch_size} is larger than {what} ({available} samples): "
                         f"pass {flag} {available} or less")


def num_batches(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Number of mini-batches :func:`iterate_batches` yields for ``n`` samples."""
    return n // batch_size if drop_last else -(-n // batch_size)


def iterate_batches(dataset: Dataset, batch_size: int, *, seed: int = 0, rank: int = 0,
                    epoch: int = 0, shuffle: bool = True,
                    drop_last: bool = False) -> Iterator[tuple[object, object]]:
    """Yield ``(x, y)`` mini-batches (arrays of the dataset's module: NumPy or CuPy).

    The order is ``default_rng([seed, rank, epoch]).permutation(N)`` when ``shuffle`` (a fresh,
    reproducible stream per run seed, rank and epoch), the dataset order otherwise.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if min(seed, rank, epoch) < 0:
        raise ValueError(f"seed, rank and epoch must be >= 0, got {seed}, {rank}, {epoch}")
    N = len(dataset)
    order = (np.random.default_rng([seed, rank, epoch]).permutation(N) if shuffle
             else np.arange(N))
    on_host = isinstance(dataset.x, np.ndarray)
    stop = N - N % batch_size if drop_last else N
    for start in range(0, stop, batch_size):
        idx = order[start:start + batch_size]
        if not on_host:
            idx = _to_module(dataset.x, idx)
        yield dataset.x[idx], dataset.y[idx]

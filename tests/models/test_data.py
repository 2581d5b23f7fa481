"""Datasets: loaders on tiny files in the real formats, corrupted files, shards, batches."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest

import models.data as data_mod
from models.data import (
    DATASETS,
    DatasetFormatError,
    DatasetNotFoundError,
    channel_stats,
    iterate_batches,
    load_cifar10,
    load_dataset,
    load_digits,
    load_mnist,
    load_shard,
    make_synthetic,
    num_batches,
    read_idx,
    shard,
)


# --------------------------------------------------------------------------- writers (formats)
def write_idx(path, array: np.ndarray, magic: int | None = None, gz: bool = False,
              truncate: int = 0):
    """IDX: 0x00 0x00 0x08(ubyte) ndim, then big-endian int32 dims, then the bytes."""
    array = np.asarray(array, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 | array.ndim
    data = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    data += array.tobytes()
    if truncate:
        data = data[:-truncate]
    if gz:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def write_mnist(root, n_train=12, n_test=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, n in (("train", n_train), ("t10k", n_test)):
        imgs = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labs = rng.integers(0, 10, n, dtype=np.uint8)
        sfx = ".gz" if gz else ""
        write_idx(root / f"{split}-images-idx3-ubyte{sfx}", imgs, gz=gz)
        write_idx(root / f"{split}-labels-idx1-ubyte{sfx}", labs, gz=gz)
        out[split] = (imgs, labs)
    return out


def write_cifar(root, n_per_batch=4, seed=0):
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, n_per_batch)]
        with open(root / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": labels, b"data": data,
                         b"filenames": [b"x.png"] * n_per_batch}, f, protocol=2)
        out[name] = (data, labels)
    return out


# --------------------------------------------------------------------------- MNIST
@pytest.mark.parametrize("gz", [False, True])
def test_mnist_loader_reads_idx(tmp_path, gz):
    raw = write_mnist(tmp_path / "mnist", gz=gz)
    split = load_mnist(tmp_path / "mnist", normalize_data=False)
    assert split.train.x.shape == (12, 1, 28, 28) and split.test.x.shape == (5, 1, 28, 28)
    assert split.train.x.dtype == np.float32 and split.train.y.dtype == np.int64
    np.testing.assert_allclose(split.train.x[:, 0], raw["train"][0] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(split.test.y, raw["t10k"][1])
    norm = load_mnist(tmp_path / "mnist")
    mean, std = channel_stats(split.train.x)
    np.testing.assert_allclose(norm.test.x, (split.test.x - mean[0]) / std[0], rtol=1e-5,
                               atol=1e-5)
    assert abs(norm.train.x.mean()) < 1e-5 and norm.train.x.std() == pytest.approx(1, rel=1e-4)


def test_idx_wrong_magic_names_file_and_kind(tmp_path):
    root = tmp_path / "m"
    write_mnist(root)
    # a labels file where the images file should be
    (root / "train-images-idx3-ubyte").write_bytes((root / "train-labels-idx1-ubyte").read_bytes())
    with pytest.raises(DatasetFormatError) as exc:
        load_mnist(root)
    msg = str(exc.value)
    assert "train-images-idx3-ubyte" in msg
    assert "expected magic 2051 for images, got 2049" in msg and "labels file" in msg
    assert isinstance(exc.value, ValueError)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_truncated_names_file(tmp_path, gz):
    root = tmp_path / "m"
    write_mnist(root, gz=gz)
    sfx = ".gz" if gz else ""
    labs = np.zeros(5, np.uint8)
    write_idx(root / f"t10k-labels-idx1-ubyte{sfx}", labs, gz=gz, truncate=2)
    with pytest.raises(DatasetFormatError, match="t10k-labels-idx1-ubyte.*truncated"):
        load_mnist(root)


def test_gzip_stream_cut_short_names_file(tmp_path):
    root = tmp_path / "m"
    write_mnist(root, gz=True)
    p = root / "train-images-idx3-ubyte.gz"
    p.write_bytes(p.read_bytes()[:200])
    with pytest.raises(DatasetFormatError, match="train-images-idx3-ubyte.gz"):
        load_mnist(root)


def test_mnist_missing_dir_and_file(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="nowhere.*does not exist"):
        load_mnist(tmp_path / "nowhere")
    root = tmp_path / "m"
    write_mnist(root)
    (root / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        load_mnist(root)


def test_mnist_count_mismatch(tmp_path):
    root = tmp_path / "m"
    write_mnist(root)
    write_idx(root / "train-labels-idx1-ubyte", np.zeros(3, np.uint8))
    with pytest.raises(DatasetFormatError, match="train-labels-idx1-ubyte.*3 labels"):
        load_mnist(root)


def test_read_idx_rejects_trailing_bytes(tmp_path):
    p = tmp_path / "x-idx1-ubyte"
    p.write_bytes(struct.pack(">II", 2049, 2) + b"\x01\x02\x03")
    with pytest.raises(DatasetFormatError, match="trailing"):
        read_idx(p, 2049)
    p.write_bytes(struct.pack(">II", 2049, 3) + b"\x01\x02\x03")
    np.testing.assert_array_equal(read_idx(p, 2049), [1, 2, 3])


# --------------------------------------------------------------------------- CIFAR-10
@pytest.mark.parametrize("nested", [False, True])
def test_cifar_loader_reads_pickles(tmp_path, nested):
    root = tmp_path / "c"
    raw = write_cifar(root / "cifar-10-batches-py" if nested else root)
    split = load_cifar10(root, normalize_data=False)
    assert split.train.x.shape == (20, 3, 32, 32) and split.test.x.shape == (4, 3, 32, 32)
    data, labels = raw["data_batch_2"]
    # CIFAR rows are 1024 red, 1024 green, 1024 blue values, each row-major 32x32
    np.testing.assert_allclose(split.train.x[4:8, 1].reshape(4, -1), data[:, 1024:2048] / 255.0,
                               rtol=1e-6)
    np.testing.assert_array_equal(split.train.y[4:8], labels)
    np.testing.assert_array_equal(split.test.y, raw["test_batch"][1])
    norm = load_cifar10(root)
    assert np.allclose(norm.train.x.mean(axis=(0, 2, 3)), 0, atol=1e-5)


@pytest.mark.parametrize("size,seed", [(1, None), (3, None), (3, 7), (7, 1)])
@pytest.mark.parametrize("normalize_data", [False, True])
def test_cifar_shard_loaded_per_rank_equals_the_cut_of_the_whole_set(tmp_path, size, seed,
                                                                      normalize_data):
    # 5 batches of 5 (25 images): shards of uneven remainders, shuffled or not
    write_cifar(tmp_path, n_per_batch=5, seed=3)
    whole = load_cifar10(tmp_path, normalize_data=normalize_data)
    seen = []
    for rank in range(size):
        got = load_shard("cifar10", tmp_path, rank=rank, size=size, seed=seed,
                         normalize_data=normalize_data)
        want = shard(whole.train, rank, size, seed=seed)
        assert got.train_total == 25 and len(got.train) == 25 // size
        np.testing.assert_array_equal(got.train.y, want.y)
        # the statistics come from byte histograms, the reference's from every pixel:
        # equal to float64 round-off, so the float32 images agree to one rounding
        np.testing.assert_allclose(got.train.x, want.x, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.test.x, whole.test.x, rtol=1e-6, atol=1e-6)
        seen.append(got.train.y)
    assert sum(map(len, seen)) == size * (25 // size)


def test_histogram_statistics_equal_channel_stats():
    rng = np.random.default_rng(0)
    u8 = rng.integers(0, 256, (11, 3, 4, 5), dtype=np.uint8)
    u8[:, 2] = 17                                    # a constant channel: std 1 by convention
    hist = np.stack([np.bincount(u8[:, c].ravel(), minlength=256) for c in range(3)])
    mean, std = data_mod._stats_from_histogram(hist)
    ref_mean, ref_std = channel_stats(u8.astype(np.float32) / 255.0)
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-14)
    np.testing.assert_allclose(std, ref_std, rtol=1e-12)
    assert std[2] == 1.0


def test_load_shard_of_a_small_set_is_its_shard():
    got = load_shard("digits", rank=2, size=3, seed=5)
    whole = load_dataset("digits")
    want = shard(whole.train, 2, 3, seed=5)
    assert got.train_total == len(whole.train)
    np.testing.assert_array_equal(got.train.x, want.x)
    np.testing.assert_array_equal(got.train.y, want.y)
    with pytest.raises(ValueError, match="--data-dir"):
        load_shard("cifar10", rank=0, size=1)
    with pytest.raises(ValueError, match="rank"):
        load_shard("digits", rank=3, size=3)


def test_cifar_truncated_batch_names_file(tmp_path):
    root = tmp_path / "c"
    write_cifar(root)
    p = root / "data_batch_3"
    p.write_bytes(p.read_bytes()[:500])
    with pytest.raises(DatasetFormatError, match="data_batch_3.*truncated"):
        load_cifar10(root)


def test_cifar_wrong_content_and_missing(tmp_path):
    root = tmp_path / "c"
    write_cifar(root)
    with open(root / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(DatasetFormatError, match="test_batch.*3072"):
        load_cifar10(root)
    (root / "data_batch_5").unlink()
    with pytest.raises(DatasetNotFoundError, match="data_batch_5"):
        load_cifar10(root)
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        load_cifar10(tmp_path / "missing_dir")


def test_cifar_unpickler_refuses_code(tmp_path):
    root = tmp_path / "c"
    write_cifar(root)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with open(root / "data_batch_1", "wb") as f:
        pickle.dump({b"data": Evil(), b"labels": []}, f)
    with pytest.raises(DatasetFormatError, match="data_batch_1.*not allowed"):
        load_cifar10(root)


# --------------------------------------------------------------------------- digits, synthetic
def test_digits_split_is_fixed_and_normalized():
    a = load_digits()
    b = load_digits()
    assert a.train.x.shape == (1438, 1, 8, 8) and a.test.x.shape == (359, 1, 8, 8)
    np.testing.assert_array_equal(a.train.y, b.train.y)
    np.testing.assert_array_equal(a.test.x, b.test.x)
    assert abs(a.train.x.mean()) < 1e-5 and a.train.x.std() == pytest.approx(1.0, rel=1e-4)
    raw = load_digits(normalize_data=False)
    assert raw.train.x.min() >= 0 and raw.train.x.max() <= 1
    from sklearn.datasets import load_digits as sk
    # train and test together are exactly the bundled data set (as a multiset of rows)
    allx = np.concatenate([raw.train.x, raw.test.x]).reshape(1797, 64) * 16
    ref = sk().data
    key = lambda m: np.lexsort(np.round(m).T)  # noqa: E731
    np.testing.assert_allclose(allx[key(allx)], ref[key(ref)], atol=1e-4)


def test_digits_reader_matches_sklearn_without_importing_it(monkeypatch):
    """The direct CSV read gives scikit-learn's arrays in its order, and loading digits (the
    models' and H-SGD's) in a fresh interpreter leaves scikit-learn unimported (it costs every
    rank ~65 MiB and about a second)."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits as sk

    from models import data as data_mod
    images, target = data_mod.read_digits()
    ref = sk()
    np.testing.assert_array_equal(images, ref.images)
    np.testing.assert_array_equal(target, ref.target)
    # where the bundled file is not found, scikit-learn's loader gives the same split
    direct = load_digits()
    monkeypatch.setattr(data_mod, "_digits_file", lambda: None)
    fallback = load_digits()
    np.testing.assert_array_equal(direct.train.x, fallback.train.x)
    np.testing.assert_array_equal(direct.test.y, fallback.test.y)
    # H-SGD's binary digits read the same file: neither loader imports scikit-learn
    code = ("import sys; from models.data import load_digits; d = load_digits(); "
            "from sparse_sgd.data import digits_dataset; h = digits_dataset(64); "
            "assert len(d.train) == 1438 and h.features.shape == (1797, 64); "
            "print('sklearn' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_synthetic_is_deterministic_and_dataset_registry():
    a = make_synthetic(n_train=50, n_test=10, seed=3)
    b = make_synthetic(n_train=50, n_test=10, seed=3)
    np.testing.assert_array_equal(a.train.x, b.train.x)
    assert a.train.x.shape == (50, 1, 8, 8) and a.test.y.shape == (10,)
    # the image loaders of this module (models/__init__ adds the text corpus beside them)
    assert {"digits", "mnist", "cifar10", "synthetic"} <= set(DATASETS)
    with pytest.raises(ValueError, match="valid names"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="--data-dir"):
        load_dataset("mnist")


# --------------------------------------------------------------------------- shards, batches
def test_shards_disjoint_equal_deterministic():
    ds = make_synthetic(n_train=103, n_test=2, seed=0).train
    ds = type(ds)(ds.x, np.arange(103), 103, "ids")    # labels = sample ids, to track rows
    for seed in (None, 7):
        shards = [shard(ds, r, 4, seed=seed) for r in range(4)]
        ids = [s.y for s in shards]
        assert all(len(i) == 25 for i in ids)            # 103 // 4, remainder dropped
        assert len(np.unique(np.concatenate(ids))) == 100
        again = [shard(ds, r, 4, seed=seed).y for r in range(4)]
        for a, b in zip(ids, again):
            np.testing.assert_array_equal(a, b)
        for s in shards:
            np.testing.assert_array_equal(s.x, ds.x[s.y])
    with pytest.raises(ValueError, match="rank"):
        shard(ds, 4, 4)
    with pytest.raises(ValueError, match="fewer"):
        shard(ds, 0, 200)


def test_batches_cover_epoch_and_depend_on_seed_rank_epoch():
    ds = make_synthetic(n_train=37, n_test=2, seed=0).train
    ds = type(ds)(ds.x, np.arange(37), 37, "ids")

    def order(**kw):
        return np.concatenate([y for _, y in iterate_batches(ds, 8, **kw)])

    base = order(seed=1, rank=0, epoch=0)
    assert sorted(base) == list(range(37))
    np.testing.assert_array_equal(base, order(seed=1, rank=0, epoch=0))
    np.testing.assert_array_equal(base, np.random.default_rng([1, 0, 0]).permutation(37))
    for kw in ({"seed": 2, "rank": 0, "epoch": 0}, {"seed": 1, "rank": 1, "epoch": 0},
               {"seed": 1, "rank": 0, "epoch": 1}):
        assert not np.array_equal(base, order(**kw))
    sizes = [len(y) for _, y in iterate_batches(ds, 8, drop_last=True)]
    assert sizes == [8, 8, 8, 8] and num_batches(37, 8, drop_last=True) == 4
    assert num_batches(37, 8) == 5
    np.testing.assert_array_equal(order(shuffle=False), np.arange(37))
    # the global RNG is untouched
    state = np.random.get_state()[1].copy()
    order(seed=5)
    np.testing.assert_array_equal(np.random.get_state()[1], state)

"""Graph Challenge TSV, category and IDX I/O: round trips, streaming, malformed input."""

import gzip

import numpy as np
import pytest

from models.data import read_idx
from sparse_sgd.data import (
    class_targets,
    digits_dataset,
    images_to_features,
    mnist_dataset,
    train_test_split,
)
from sparse_sgd.io import (
    layer_path,
    network_folder,
    read_categories,
    read_challenge_layer,
    read_challenge_network,
    read_input_tsv,
    read_triples,
    write_categories,
    write_challenge_network,
    write_input_tsv,
    write_triples,
)
from sparse_sgd.radixnet import graph_challenge_network


def test_network_round_trip_and_orientation(tmp_path):
    W = graph_challenge_network(1024, 3, seed=2).weights
    folder = write_challenge_network(tmp_path, W)
    assert folder == tmp_path / "neuron1024" == network_folder(tmp_path, 1024)
    assert layer_path(folder, 1024, 2) == tmp_path / "neuron1024" / "n1024-l2.tsv"
    for d in (tmp_path, folder):  # the challenge root or the network folder itself
        back = read_challenge_network(d, 1024, 3)
        for a, b in zip(W, back):
            assert (a != b).nnz == 0
    # the file holds the challenge orientation (row = input neuron, col = output neuron)
    tmp_path = folder
    r, c, _v = read_triples(layer_path(tmp_path, 1024, 1))
    i = 5
    np.testing.assert_array_equal(np.sort(r[c == i]), W[0].indices[W[0].indptr[i]:
                                                                  W[0].indptr[i + 1]])
    first = layer_path(tmp_path, 1024, 1).read_text().splitlines()[0].split("\t")
    assert int(first[0]) >= 1 and int(first[1]) >= 1 and float(first[2]) == 1 / 16


def test_streaming_reads_in_chunks(tmp_path):
    rng = np.random.default_rng(0)
    r, c, v = rng.integers(0, 50, 1000), rng.integers(0, 40, 1000), rng.normal(size=1000)
    write_triples(tmp_path / "t.tsv", r, c, v)
    with pytest.raises(ValueError, match="duplicate entry"):  # random pairs repeat
        read_triples(tmp_path / "t.tsv")
    for chunk in (1, 7, 1000, 5000):
        rr, cc, vv = read_triples(tmp_path / "t.tsv", chunk_lines=chunk, sum_duplicates=True)
        np.testing.assert_array_equal(rr, r)
        np.testing.assert_array_equal(cc, c)
        np.testing.assert_array_equal(vv, v)  # %.17g round-trips exactly


def test_inputs_and_categories_round_trip(tmp_path):
    Y0 = (np.random.default_rng(1).random((20, 1024)) < 0.1).astype(np.float32)
    Y0[3] = 0
    write_input_tsv(tmp_path / "in.tsv", Y0)
    back = read_input_tsv(tmp_path / "in.tsv", 1024, num_inputs=20).toarray()
    np.testing.assert_array_equal(back, Y0)
    write_categories(tmp_path / "cat.tsv", [0, 4, 19])
    assert (tmp_path / "cat.tsv").read_text() == "1\n5\n20\n"
    np.testing.assert_array_equal(read_categories(tmp_path / "cat.tsv"), [0, 4, 19])


@pytest.mark.parametrize("bad,what", [
    ("3\t4\n", "expected 3"),
    ("3\t4\tx\n", "integers"),
    ("0\t4\t1\n", "1-based"),
    ("3 4\n", "expected 3"),
    ("3\t4.5\t1\n", "integers"),
    ("3\t4\t1\t9\n", "expected 3"),
    ("3\t4\tinf\n", "finite"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad, what):
    p = tmp_path / "bad.tsv"
    good = "".join(f"{i}\t{i}\t1\n" for i in range(1, 8))
    p.write_text(good + "\n" + bad + good)  # the bad line is line 9 (after a blank line)
    for chunk in (3, 1 << 16):
        with pytest.raises(ValueError, match=rf"bad\.tsv:9: .*{what}"):
            read_triples(p, chunk_lines=chunk)


def test_any_whitespace_separates_fields(tmp_path):
    p = tmp_path / "ws.tsv"
    p.write_text("1 2 0.5\n3\t4   0.25\n  5 \t 6 1e-1 \n")
    r, c, v = read_triples(p)
    np.testing.assert_array_equal(r, [0, 2, 4])
    np.testing.assert_array_equal(c, [1, 3, 5])
    np.testing.assert_array_equal(v, [0.5, 0.25, 0.1])
    # blank lines (and chunks holding nothing else), CRLF ends, every chunk size
    p.write_text("\n\n \t\n1 2 0.5\r\n\n\n\n3 4 0.25\n\n")
    for chunk in (1, 2, 3, 100):
        r, c, v = read_triples(p, chunk_lines=chunk)
        assert (r.tolist(), c.tolist(), v.tolist()) == ([0, 2], [1, 3], [0.5, 0.25])
    p.write_text("\n\n\n")
    with pytest.raises(ValueError, match="no entries"):
        read_triples(p, chunk_lines=2)


def test_empty_truncated_and_duplicate_files_are_refused(tmp_path):
    W = graph_challenge_network(1024, 2, seed=1).weights
    folder = write_challenge_network(tmp_path, W)
    path = layer_path(folder, 1024, 2)
    text = path.read_text()
    path.write_text("")  # an empty layer file
    with pytest.raises(ValueError, match=r"n1024-l2\.tsv: no entries"):
        read_challenge_network(tmp_path, 1024, 2)
    lines = text.splitlines(keepends=True)
    cut = lines[100][:lines[100].rfind("\t")]  # cut inside line 101: the value is gone
    path.write_text("".join(lines[:100]) + cut)
    with pytest.raises(ValueError, match=r"n1024-l2\.tsv:101: malformed line .*expected 3 "
                                         r".*found 2.*ends inside this line.*truncated"):
        read_challenge_network(tmp_path, 1024, 2)
    path.write_text("".join(lines[:50]) + lines[7] + "".join(lines[50:]))  # line 51 repeats 8
    with pytest.raises(ValueError, match=r"n1024-l2\.tsv:51: duplicate entry .* line 8; .*"
                                         r"--sum-duplicates"):
        read_challenge_network(tmp_path, 1024, 2)
    summed = read_challenge_network(tmp_path, 1024, 2, sum_duplicates=True)[1]
    rr, cc, vv = (float(x) for x in lines[7].split())
    assert summed[int(cc) - 1, int(rr) - 1] == 2 * vv  # the repeated entry, added
    assert summed.nnz == W[1].nnz
    path.write_text("".join(line.replace("\t0.0625", "\t0") for line in lines))
    with pytest.raises(ValueError, match="no nonzero weight"):
        read_challenge_network(tmp_path, 1024, 2)
    path.write_text(text)
    with pytest.raises(ValueError, match="n1024-l3.tsv: layer file not found"):
        read_challenge_network(tmp_path, 1024, 3)


def test_num_inputs_keeps_the_first_images(tmp_path):
    Y0 = (np.random.default_rng(1).random((20, 1024)) < 0.1).astype(np.float32)
    write_input_tsv(tmp_path / "in.tsv", Y0)
    np.testing.assert_array_equal(read_input_tsv(tmp_path / "in.tsv", 1024, 7).toarray(), Y0[:7])
    with pytest.raises(ValueError, match="--num-inputs must be >= 1"):
        read_input_tsv(tmp_path / "in.tsv", 1024, 0)


def test_train_test_split_is_fixed_and_disjoint():
    ds = digits_dataset(1024)
    a, b = train_test_split(ds, 0.2, seed=3)
    a2, b2 = train_test_split(ds, 0.2, seed=3)
    assert b.features.shape[0] == round(0.2 * 1797) and a.features.shape[0] + 359 == 1797
    np.testing.assert_array_equal(b.labels, b2.labels)
    np.testing.assert_array_equal(a.features, a2.features)
    rows = {r.tobytes() for r in ds.features}
    assert len(rows) < 1797 or not ({r.tobytes() for r in a.features}
                                    & {r.tobytes() for r in b.features})


def test_malformed_category_file(tmp_path):
    p = tmp_path / "c.tsv"
    p.write_text("1\n2\nthree\n")
    with pytest.raises(ValueError, match=r"c\.tsv:3"):
        read_categories(p)


def test_layer_index_out_of_range(tmp_path):
    write_triples(tmp_path / "l.tsv", [0, 2000], [1, 1], [1.0, 1.0])
    with pytest.raises(ValueError, match="exceeds N=1024"):
        read_challenge_layer(tmp_path / "l.tsv", 1024)


def test_index_above_n_names_its_line(tmp_path):
    """An index above N is reported with the file and the line that holds it, in
    any chunk of the streamed file, for layer files (either index) and input files."""
    rows = np.arange(300) % 1024
    cols = np.arange(300) % 7
    rows[212] = 1024  # 1-based 1025 on line 213
    write_triples(tmp_path / "l.tsv", rows, cols, np.ones(300))
    with pytest.raises(ValueError, match=r"l\.tsv:213: row index 1025 exceeds N=1024; "
                                         r"pass .*--neurons"):
        read_challenge_layer(tmp_path / "l.tsv", 1024)
    for chunk in (1, 50, 1000):
        with pytest.raises(ValueError, match=r"l\.tsv:213: row index 1025 exceeds N=1024"):
            read_triples(tmp_path / "l.tsv", chunk, bounds=(1024, 1024))
    write_triples(tmp_path / "c.tsv", cols, rows, np.ones(300))  # the column is too large
    with pytest.raises(ValueError, match=r"c\.tsv:213: column index 1025 exceeds N=1024"):
        read_challenge_layer(tmp_path / "c.tsv", 1024)
    with pytest.raises(ValueError, match=r"c\.tsv:213: column index 1025 exceeds N=1024"):
        read_input_tsv(tmp_path / "c.tsv", 1024)


def test_last_line_without_newline_is_read(tmp_path):
    """A valid last line without a trailing newline is part of the file (POSIX-tolerant, like
    the challenge's reference reader): the layer reads back whole, whatever the chunking."""
    W = graph_challenge_network(1024, 1, seed=3).weights
    folder = write_challenge_network(tmp_path, W)
    path = layer_path(folder, 1024, 1)
    path.write_text(path.read_text().rstrip("\n"))
    assert not path.read_text().endswith("\n")
    back = read_challenge_network(tmp_path, 1024, 1)[0]
    assert back.nnz == W[0].nnz and (back != W[0]).nnz == 0
    for chunk in (1, 3, W[0].nnz, W[0].nnz + 1):
        r, c, v = read_triples(path, chunk)
        assert r.size == W[0].nnz
    (tmp_path / "one.tsv").write_text("3 4 0.5")  # a one-line file without newline
    r, c, v = read_triples(tmp_path / "one.tsv")
    assert (r.tolist(), c.tolist(), v.tolist()) == ([2], [3], [0.5])


def _write_idx(path, arr, code):
    header = bytes([0, 0, code, arr.ndim]) + np.array(arr.shape, ">u4").tobytes()
    data = header + arr.astype({0x08: ">u1"}[code]).tobytes()
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as fh:
        fh.write(data)


def test_idx_reader_and_mnist_features(tmp_path):
    rng = np.random.default_rng(3)
    imgs = rng.integers(0, 256, (5, 28, 28)).astype(np.uint8)
    labels = np.array([0, 1, 9, 3, 3], dtype=np.uint8)
    _write_idx(tmp_path / "img.gz", imgs, 0x08)
    _write_idx(tmp_path / "lab", labels, 0x08)
    np.testing.assert_array_equal(read_idx(tmp_path / "img.gz", 2051), imgs)
    ds = mnist_dataset(tmp_path / "img.gz", tmp_path / "lab", 1024)
    assert ds.features.shape == (5, 1024)
    # nearest-neighbour scaling: pixel (i, j) of the 32x32 image is (i*28//32, j*28//32)
    i, j = 31, 17
    assert ds.features[2, i * 32 + j] == float(imgs[2, i * 28 // 32, j * 28 // 32] / 255 > 0.5)
    (tmp_path / "junk").write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(ValueError, match="junk: expected magic 2051"):
        mnist_dataset(tmp_path / "junk", tmp_path / "lab", 1024)
    raw = (tmp_path / "lab").read_bytes()
    (tmp_path / "short").write_bytes(raw[:-2])  # a truncated labels file: one clear error
    with pytest.raises(ValueError, match="short: truncated"):
        mnist_dataset(tmp_path / "img.gz", tmp_path / "short", 1024)


def test_digits_features_and_targets():
    ds = digits_dataset(1024)
    assert ds.features.shape == (1797, 1024)
    assert set(np.unique(ds.features)) <= {0.0, 1.0}
    img = np.zeros((1, 8, 8))
    img[0, 2, 3] = 1.0
    f = images_to_features(img, 1024, 0.5).reshape(32, 32)
    assert f.sum() == 16 and f[8:12, 12:16].all()  # upscaled 4x, thresholded, flattened
    T = class_targets(np.array([3, 0]), 1024)
    assert T[0, 3] == 1 and T[0, 13] == 1 and T[0, 4] == 0 and T[1].sum() == 103
    with pytest.raises(ValueError, match="square"):
        images_to_features(img, 1000, 0.5)

"""Local-file datasets: FEMNIST (LEAF JSON) and MNIST (IDX), from generated fixtures only."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest

from edge_fl.data.femnist import (
    LeafFormatError,
    load_femnist,
    read_leaf_json,
    write_leaf_dir,
    write_leaf_json,
)
from edge_fl.data.mnist import IdxFormatError, load_mnist, read_idx, write_idx
from edge_fl.privacy.rng import seeded_generator

F = 784


def _writer(rng, n, n_features=F, n_classes=62):
    X = rng.random((n, n_features), dtype=np.float32)
    y = rng.integers(0, n_classes, n)
    return X, y


@pytest.fixture
def leaf(tmp_path):
    """5 writers with 2..6 train and 1..2 test samples each, spread over two files per split."""
    rng = seeded_generator(0)
    train = {f"f{i:04d}_0{i}": _writer(rng, 2 + i) for i in range(5)}
    test = {u: _writer(rng, 1 + i % 2) for i, u in enumerate(train)}
    root = write_leaf_dir(tmp_path / "femnist", train, test, files_per_split=2)
    return root, train, test


# ---------------------------------------------------------------- FEMNIST / LEAF


def test_leaf_roundtrip_natural_partition(leaf):
    root, train, test = leaf
    assert len(list((root / "train").glob("*.json"))) == 2
    ds = load_femnist(root)
    assert ds.name == "femnist" and ds.n_classes == 62 and ds.n_devices == 5
    assert ds.X_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    assert ds.X_train.shape == (sum(y.size for _, y in train.values()), F)
    for d, (X, y) in enumerate(train.values()):  # one device per writer, in file order
        Xd, yd = ds.device_data(d)
        np.testing.assert_array_equal(Xd, X)
        np.testing.assert_array_equal(yd, y)
    np.testing.assert_array_equal(ds.X_test, np.concatenate([X for X, _ in test.values()]))
    np.testing.assert_array_equal(ds.y_test, np.concatenate([y for _, y in test.values()]))


def test_leaf_writer_subset_is_seeded(leaf):
    root, train, test = leaf
    users = list(train)
    picks = {}
    for seed in range(6):
        ds = load_femnist(root, n_devices=3, seed=seed)
        assert ds.n_devices == 3
        chosen = []
        for d in range(3):  # every device is exactly one whole writer
            Xd, _ = ds.device_data(d)
            match = [u for u in users if np.array_equal(train[u][0], Xd)]
            assert len(match) == 1
            chosen.append(match[0])
        assert chosen == sorted(chosen, key=users.index)  # file order kept
        # held-out set: the chosen writers' test samples only
        np.testing.assert_array_equal(ds.y_test, np.concatenate([test[u][1] for u in chosen]))
        picks[seed] = tuple(chosen)
        again = load_femnist(root, n_devices=3, seed=seed)
        np.testing.assert_array_equal(again.X_train, ds.X_train)
    assert len(set(picks.values())) > 1  # 10 possible subsets; 6 seeds all equal has p ~ 1e-5


def test_leaf_too_many_devices(leaf):
    root, _, _ = leaf
    with pytest.raises(ValueError, match=r"n_devices=6 exceeds the 5 writers"):
        load_femnist(root, n_devices=6)
    with pytest.raises(ValueError, match=r"n_devices=0"):
        load_femnist(root, n_devices=0)


def test_leaf_user_split_keeps_all_test_users(tmp_path):
    rng = seeded_generator(1)
    train = {"a": _writer(rng, 3), "b": _writer(rng, 2)}
    test = {"c": _writer(rng, 4)}  # LEAF -t user: disjoint users
    root = write_leaf_dir(tmp_path, train, test)
    ds = load_femnist(root, n_devices=1)
    np.testing.assert_array_equal(ds.X_test, test["c"][0])


def test_leaf_writer_without_training_data_is_not_a_device(tmp_path):
    rng = seeded_generator(2)
    train = {"a": _writer(rng, 3), "empty": _writer(rng, 0), "b": _writer(rng, 1)}
    root = write_leaf_dir(tmp_path, train, {"a": _writer(rng, 1), "b": _writer(rng, 1)})
    ds = load_femnist(root)
    assert ds.n_devices == 2 and [len(i) for i in ds.device_indices] == [3, 1]


def _leaf_doc(n=2, features=F):
    rng = seeded_generator(3)
    X, y = _writer(rng, n, features)
    return {
        "users": ["u"],
        "num_samples": [n],
        "user_data": {"u": {"x": X.tolist(), "y": y.tolist()}},
    }


def _femnist_dir(tmp_path, train_doc, test_doc=None):
    for split, doc in (("train", train_doc), ("test", test_doc or _leaf_doc())):
        (tmp_path / split).mkdir(exist_ok=True)
        text = doc if isinstance(doc, str) else json.dumps(doc)
        (tmp_path / split / "data.json").write_text(text)
    return tmp_path


def test_leaf_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"FEMNIST data_dir not found: .*nowhere"):
        load_femnist(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"LEAF split directory not found: .*train"):
        load_femnist(tmp_path)
    (tmp_path / "train").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no LEAF \*.json files in .*train"):
        load_femnist(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"LEAF JSON file not found"):
        read_leaf_json(tmp_path / "x.json")


def test_leaf_test_split_missing(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.json").write_text(json.dumps(_leaf_doc()))
    with pytest.raises(FileNotFoundError, match=r"LEAF split directory not found: .*test"):
        load_femnist(tmp_path)


def test_leaf_malformed_json_names_the_file(tmp_path):
    root = _femnist_dir(tmp_path, '{"users": ["u"], "num_samples": [1,')
    with pytest.raises(LeafFormatError, match=r"train[/\\]data\.json: malformed JSON .*line 1"):
        load_femnist(root)
    (root / "train" / "data.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(LeafFormatError, match=r"data.json: (not UTF-8|malformed JSON)"):
        load_femnist(root)


def _mutated(mutate):
    doc = _leaf_doc()
    mutate(doc)
    return doc


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("user_data"), "missing key 'user_data'"),
        (lambda d: d.update(users="u"), "'users' must be a JSON array"),
        (lambda d: d.update(num_samples=[2, 2]), "inconsistent num_samples: 1 users but 2"),
        (lambda d: d.update(num_samples=[3]), "inconsistent num_samples: declared 3, found 2"),
        (lambda d: d["user_data"]["u"]["y"].pop(), "declared 2, found 2 x rows and 1 y labels"),
        (lambda d: d["user_data"]["u"]["x"][0].pop(), "wrong shape"),
        (lambda d: d["user_data"]["u"].update(x=[[0.0] * 10] * 2), r"wrong shape.*\(2, 10\)"),
        (lambda d: d["user_data"]["u"].update(y=[0, 62]), r"labels must lie in \[0, 62\)"),
        (lambda d: d["user_data"]["u"].update(y=[0, 1.5]), "integer labels"),
        (lambda d: d["user_data"].update(v={"x": [], "y": []}), "do not match 'users'"),
        (lambda d: d["user_data"].update(u=[1, 2]), "must be an object with 'x' and 'y'"),
        (lambda d: d.update(users=["u", "u"], num_samples=[2, 2]), "duplicate user"),
    ],
)
def test_leaf_structure_errors(tmp_path, mutate, message):
    root = _femnist_dir(tmp_path, _mutated(mutate))
    with pytest.raises(LeafFormatError, match=message) as err:
        load_femnist(root)
    assert "data.json" in str(err.value)


def test_leaf_top_level_and_duplicates_across_files(tmp_path):
    root = _femnist_dir(tmp_path, "[1, 2]")
    with pytest.raises(LeafFormatError, match=r"top level must be an object"):
        load_femnist(root)
    (root / "train" / "data.json").write_text(json.dumps(_leaf_doc()))
    (root / "train" / "more.json").write_text(json.dumps(_leaf_doc()))
    with pytest.raises(LeafFormatError, match=r"user 'u' appears in both .*data.json and .*more"):
        load_femnist(root)


def test_write_leaf_json_rejects_mismatched_arrays(tmp_path):
    with pytest.raises(ValueError, match=r"user 'u'"):
        write_leaf_json(tmp_path / "a.json", {"u": (np.zeros((2, 3)), np.zeros(3))})


# ---------------------------------------------------------------- MNIST / IDX


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_roundtrip(tmp_path, dtype, suffix):
    a = (seeded_generator(4).random((3, 4, 5)) * 100).astype(dtype)
    path = write_idx(tmp_path / f"a.idx{suffix}", a)
    if suffix:
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    b = read_idx(path)
    assert b.dtype == np.dtype(dtype) and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_idx_header_layout(tmp_path):
    path = write_idx(tmp_path / "labels", np.array([1, 2, 3], dtype=np.int64), dtype="uint8")
    raw = path.read_bytes()
    assert struct.unpack(">II", raw[:8]) == (2049, 3) and raw[8:] == b"\x01\x02\x03"
    path = write_idx(tmp_path / "images", np.zeros((2, 3, 4), np.uint8))
    assert struct.unpack(">IIII", path.read_bytes()[:16]) == (2051, 2, 3, 4)
    with pytest.raises(ValueError, match=r"do not fit dtype=uint8"):
        write_idx(tmp_path / "x", np.array([256]), dtype="uint8")
    with pytest.raises(ValueError, match=r"no IDX type"):
        write_idx(tmp_path / "x", np.array([1], dtype=np.int64))


def _mnist_dir(root, n_train=60, n_test=20, rows=28, gz=False):
    rng = seeded_generator(5)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, (n, rows, rows)).astype(np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        rng.shuffle(labels)
        ext = ".gz" if gz else ""
        write_idx(root / f"{prefix}-images-idx3-ubyte{ext}", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte{ext}", labels)
        arrays[prefix] = (images, labels)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_roundtrip_iid(tmp_path, gz):
    arrays = _mnist_dir(tmp_path, gz=gz)
    ds = load_mnist(tmp_path, n_devices=4, seed=1)
    assert ds.name == "mnist" and ds.n_classes == 10 and ds.n_devices == 4
    images, labels = arrays["train"]
    assert ds.X_train.dtype == np.float32 and ds.X_train.shape == (60, 784)
    np.testing.assert_array_equal(ds.X_train, images.reshape(60, 784).astype(np.float32) / 255)
    assert ds.X_train.min() >= 0 and ds.X_train.max() <= 1
    np.testing.assert_array_equal(ds.y_train, labels)
    np.testing.assert_array_equal(ds.y_test, arrays["t10k"][1])
    idx = np.concatenate(ds.device_indices)
    np.testing.assert_array_equal(np.sort(idx), np.arange(60))
    assert sorted(len(i) for i in ds.device_indices) == [15, 15, 15, 15]


def test_mnist_dirichlet_and_mirror_spelling(tmp_path):
    _mnist_dir(tmp_path)
    for p in tmp_path.iterdir():  # some mirrors ship 'train-images.idx3-ubyte'
        p.rename(tmp_path / p.name.replace("-idx", ".idx"))
    ds = load_mnist(tmp_path, 3, partition="dirichlet", alpha=0.3, seed=2, min_size=5)
    assert min(len(i) for i in ds.device_indices) >= 5
    np.testing.assert_array_equal(np.sort(np.concatenate(ds.device_indices)), np.arange(60))
    again = load_mnist(tmp_path, 3, partition="dirichlet", alpha=0.3, seed=2, min_size=5)
    for a, b in zip(ds.device_indices, again.device_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"partition='shards'"):
        load_mnist(tmp_path, 3, partition="shards")


def test_mnist_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"MNIST data_dir not found"):
        load_mnist(tmp_path / "nowhere", 2)
    with pytest.raises(FileNotFoundError, match=r"'train-images-idx3-ubyte' not found .*\.gz"):
        load_mnist(tmp_path, 2)
    _mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match=r"t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path, 2)
    with pytest.raises(FileNotFoundError, match=r"IDX file not found"):
        read_idx(tmp_path / "t10k-labels-idx1-ubyte")


def test_mnist_bad_magic(tmp_path):
    _mnist_dir(tmp_path)
    labels = tmp_path / "train-labels-idx1-ubyte"
    images = tmp_path / "train-images-idx3-ubyte"
    labels.rename(tmp_path / "tmp")
    images.rename(labels)
    (tmp_path / "tmp").rename(images)  # swapped: the labels file now holds images
    with pytest.raises(IdxFormatError, match=r"train-images-idx3-ubyte: bad magic number 2049"):
        load_mnist(tmp_path, 2)
    images.write_bytes(b"\x12\x34\x08\x03" + images.read_bytes()[4:])
    with pytest.raises(IdxFormatError, match=r"bad magic number .*expected 2051"):
        load_mnist(tmp_path, 2)
    with pytest.raises(IdxFormatError, match=r"two zero bytes"):
        read_idx(images)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-1], "truncated data: dims \\(60, 28, 28\\) need 47040 bytes.*found 47039"),
        (lambda b: b[:10], "truncated header"),
        (lambda b: b[:3], "truncated header \\(3 bytes"),
        (lambda b: b + b"\x00\x00", "2 unexpected trailing bytes"),
    ],
)
def test_mnist_truncated_or_oversized(tmp_path, damage, message):
    _mnist_dir(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(IdxFormatError, match=message) as err:
        load_mnist(tmp_path, 2)
    assert "train-images-idx3-ubyte" in str(err.value)


def test_mnist_truncated_gzip(tmp_path):
    _mnist_dir(tmp_path, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(
        IdxFormatError, match=r"t10k-images-idx3-ubyte.gz: corrupt or truncated gzip"
    ):
        load_mnist(tmp_path, 2)
    path.write_bytes(b"plain bytes")
    with pytest.raises(IdxFormatError, match=r"named .gz but is not gzip"):
        load_mnist(tmp_path, 2)


def test_mnist_inconsistent_files(tmp_path):
    _mnist_dir(tmp_path)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(59, np.uint8))
    with pytest.raises(IdxFormatError, match=r"has 60 images but .*has 59 labels"):
        load_mnist(tmp_path, 2)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.full(60, 10, np.uint8))
    with pytest.raises(IdxFormatError, match=r"labels must lie in \[0, 10\), found 10"):
        load_mnist(tmp_path, 2)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(60, np.uint8))
    write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((20, 14, 14), np.uint8))
    with pytest.raises(IdxFormatError, match=r"train images are 28x28 but test images are 14x14"):
        load_mnist(tmp_path, 2)


def test_gzip_detected_by_content(tmp_path):
    a = np.arange(6, dtype=np.uint8).reshape(2, 3)
    raw = write_idx(tmp_path / "plain", a).read_bytes()
    (tmp_path / "zipped-without-suffix").write_bytes(gzip.compress(raw))
    np.testing.assert_array_equal(read_idx(tmp_path / "zipped-without-suffix"), a)


def test_registry_loads_both_from_files(tmp_path, leaf):
    from edge_fl.data import load_federated

    root = leaf[0]
    ds = load_federated("femnist", 2, seed=3, data_dir=str(root))
    assert ds.name == "femnist" and ds.n_devices == 2
    np.testing.assert_array_equal(ds.X_train, load_femnist(root, 2, seed=3).X_train)
    _mnist_dir(tmp_path / "mnist")
    ds = load_federated("mnist", 3, partition="dirichlet", alpha=1.0, data_dir=tmp_path / "mnist")
    assert ds.name == "mnist" and ds.n_devices == 3 and ds.X_train.shape == (60, 784)

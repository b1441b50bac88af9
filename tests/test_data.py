"""Datasets and partitioners: coverage, skew, reproducibility, synthetic generator, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from edge_fl.data import (
    FederatedDataset,
    known_datasets,
    load_federated,
    make_synthetic,
    partition_dirichlet,
    partition_iid,
    register_dataset,
)
from edge_fl.data.digits import load_digits_split, stratified_split
from edge_fl.data.partition import _top_up
from edge_fl.privacy.rng import seeded_generator


@pytest.fixture(scope="module")
def digits_labels() -> np.ndarray:
    return load_digits_split(0.2, seed=0)[1]


def _assert_exact_cover(parts, n):
    allidx = np.concatenate(parts)
    assert allidx.dtype == np.int64
    assert allidx.size == n and np.array_equal(np.sort(allidx), np.arange(n))
    assert all(np.all(np.diff(p) > 0) for p in parts)  # sorted, no duplicates within a device


def _mean_label_entropy(parts, labels, n_classes=10) -> float:
    ent = []
    for p in parts:
        q = np.bincount(labels[p], minlength=n_classes) / p.size
        q = q[q > 0]
        ent.append(-(q * np.log(q)).sum())
    return float(np.mean(ent))


def test_partition_iid_covers_once_balanced_and_reproducible():
    parts = partition_iid(1003, 10, seeded_generator(0))
    _assert_exact_cover(parts, 1003)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    again = partition_iid(1003, 10, seeded_generator(0))
    other = partition_iid(1003, 10, seeded_generator(1))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))
    _assert_exact_cover(partition_iid(5, 5, seeded_generator(0)), 5)


def test_partition_dirichlet_covers_once_and_is_reproducible(digits_labels):
    parts = partition_dirichlet(digits_labels, 20, 0.5, seeded_generator(0), min_size=5)
    _assert_exact_cover(parts, digits_labels.size)
    assert min(p.size for p in parts) >= 5
    again = partition_dirichlet(digits_labels, 20, 0.5, seeded_generator(0), min_size=5)
    other = partition_dirichlet(digits_labels, 20, 0.5, seeded_generator(1), min_size=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other, strict=True))


def test_partition_dirichlet_min_size_with_tiny_alpha(digits_labels):
    # alpha = 0.01 over 100 devices leaves most devices empty before the top-up.
    n = digits_labels.size
    for seed in range(3):
        parts = partition_dirichlet(digits_labels, 100, 0.01, seeded_generator(seed), min_size=10)
        _assert_exact_cover(parts, n)
        assert min(p.size for p in parts) >= 10
    # The extreme: min_size * n_devices == n forces every device to exactly min_size.
    parts = partition_dirichlet(digits_labels[:1000], 100, 0.01, seeded_generator(0), min_size=10)
    assert {p.size for p in parts} == {10}


def test_top_up_moves_only_surplus():
    owner = np.array([0] * 10 + [1] * 4 + [3] * 1, dtype=np.int64)  # device 2 empty, 3 short
    before = np.bincount(owner, minlength=4)
    _top_up(owner, 4, 3, seeded_generator(0))
    after = np.bincount(owner, minlength=4)
    assert after.sum() == before.sum() and after.min() >= 3
    assert np.array_equal(after[2:], [3, 3])
    assert after[1] >= 3  # donors never drop below min_size


def test_dirichlet_skew_grows_as_alpha_shrinks(digits_labels):
    ent = {}
    for a in (0.1, 1.0, 10.0):
        ents = [
            _mean_label_entropy(
                partition_dirichlet(digits_labels, 20, a, seeded_generator(s)), digits_labels
            )
            for s in range(3)
        ]
        ent[a] = float(np.mean(ents))
    print("mean per-device label entropy (nats):", ent, "max", np.log(10))
    # Measured: 0.91 at 0.1, 1.91 at 1, 2.26 at 10 (max log 10 = 2.30).
    assert ent[0.1] < ent[1.0] < ent[10.0]
    assert ent[0.1] < 0.5 * ent[10.0]
    assert ent[10.0] > 0.9 * np.log(10)


def test_partition_bad_arguments(digits_labels):
    rng = seeded_generator(0)
    with pytest.raises(ValueError, match="n_devices=0"):
        partition_iid(10, 0, rng)
    with pytest.raises(ValueError, match="n_devices=11 exceeds n_samples=10"):
        partition_iid(10, 11, rng)
    with pytest.raises(ValueError, match="n_samples"):
        partition_iid(0, 1, rng)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="alpha"):
            partition_dirichlet(digits_labels, 5, bad, rng)
    with pytest.raises(ValueError, match="exceeds n_samples"):
        partition_dirichlet(digits_labels[:10], 11, 1.0, rng)
    with pytest.raises(ValueError, match="min_size=5 x n_devices=3"):
        partition_dirichlet(digits_labels[:14], 3, 1.0, rng, min_size=5)
    with pytest.raises(ValueError, match="min_size"):
        partition_dirichlet(digits_labels, 3, 1.0, rng, min_size=-1)
    with pytest.raises(ValueError, match="1-D integer"):
        partition_dirichlet(digits_labels.astype(float), 3, 1.0, rng)
    with pytest.raises(ValueError, match=">= 0"):
        partition_dirichlet(digits_labels - 1, 3, 1.0, rng)


def test_digits_split_is_scaled_stratified_and_seeded():
    X_tr, y_tr, X_te, y_te = load_digits_split(0.2, seed=0)
    assert X_tr.dtype == X_te.dtype == np.float32 and y_tr.dtype == y_te.dtype == np.int64
    assert X_tr.shape[0] + X_te.shape[0] == 1797 and X_tr.shape[1] == 64
    assert X_tr.min() == 0.0 and X_tr.max() == 1.0
    counts = np.bincount(np.concatenate([y_tr, y_te]), minlength=10)
    assert np.array_equal(np.bincount(y_te, minlength=10), np.round(0.2 * counts).astype(int))
    X_te2 = load_digits_split(0.2, seed=0)[2]
    X_te3 = load_digits_split(0.2, seed=1)[2]
    assert np.array_equal(X_te, X_te2) and not np.array_equal(X_te, X_te3)
    y = np.repeat(np.arange(3), 10)
    tr, te = stratified_split(y, 0.3, seeded_generator(0))
    assert np.intersect1d(tr, te).size == 0 and np.union1d(tr, te).size == 30
    with pytest.raises(ValueError, match="test_fraction"):
        stratified_split(y, 1.0, seeded_generator(0))


def test_load_federated_digits():
    ds = load_federated("digits", 10)
    assert isinstance(ds, FederatedDataset) and ds.n_devices == 10 and ds.n_classes == 10
    _assert_exact_cover(ds.device_indices, ds.X_train.shape[0])
    X0, y0 = ds.device_data(0)
    assert X0.shape == (ds.device_indices[0].size, 64) and y0.shape == (X0.shape[0],)
    dd = load_federated("digits", 10, partition="dirichlet", alpha=0.1, seed=3, min_size=20)
    _assert_exact_cover(dd.device_indices, dd.X_train.shape[0])
    assert min(p.size for p in dd.device_indices) >= 20
    assert _mean_label_entropy(dd.device_indices, dd.y_train) < _mean_label_entropy(
        ds.device_indices, ds.y_train
    )
    with pytest.raises(ValueError, match="'iid', 'dirichlet'"):
        load_federated("digits", 10, partition="natural")
    with pytest.raises(ValueError, match=r"known datasets: \['digits', 'femnist', 'mnist'"):
        load_federated("cifar", 10)


def test_shared_options_reach_only_loaders_that_take_them():
    # A job config passes data_dir/samples_per_device to every dataset; digits ignores them.
    a = load_federated("digits", 4, partition="iid", data_dir=None, samples_per_device=50)
    b = load_federated("digits", 4)
    assert all(
        np.array_equal(x, y) for x, y in zip(a.device_indices, b.device_indices, strict=True)
    )
    s = load_federated("synthetic", 20, partition="iid", data_dir=None, samples_per_device=30)
    assert s.n_devices == 20
    with pytest.raises(
        ValueError, match=r"takes no option\(s\) \['bogus'\]; allowed: \[.*min_size"
    ):
        load_federated("digits", 4, bogus=1)
    with pytest.raises(ValueError, match="min_sample"):
        load_federated("synthetic", 4, min_size=3)
    for name in ("mnist", "femnist"):
        with pytest.raises(ValueError, match=r"set data\.data_dir .*--data-dir DIR"):
            load_federated(name, 4)
    with pytest.raises(ValueError, match="partitioned by writer"):
        load_federated("femnist", 4, partition="dirichlet", data_dir="/nonexistent")


def test_register_dataset(monkeypatch):
    from edge_fl import data

    monkeypatch.setattr(data, "_LOADERS", dict(data._LOADERS))
    seen = {}

    def loader(n_devices, *, partition, alpha, seed, **options):
        seen.update(n=n_devices, partition=partition, alpha=alpha, seed=seed, **options)
        return "ok"

    register_dataset("femnist", loader)
    assert "femnist" in known_datasets()
    assert load_federated("femnist", 3, seed=7, data_dir="/x") == "ok"
    assert seen == {"n": 3, "partition": None, "alpha": 0.5, "seed": 7, "data_dir": "/x"}


def test_synthetic_shapes_and_definition():
    ds = make_synthetic(
        400, seeded_generator(0), standardize=False, mean_samples=60, min_samples=10
    )
    assert ds.X_train.dtype == ds.X_test.dtype == np.float32
    assert ds.y_train.dtype == ds.y_test.dtype == np.int64
    assert ds.n_features == 60 and ds.n_classes == 10 and ds.n_devices == 400
    _assert_exact_cover(ds.device_indices, ds.X_train.shape[0])
    # Test share per device is floor(0.2 * n_k) and sizes respect the minimum.
    n_train = np.array([p.size for p in ds.device_indices])
    assert n_train.min() >= 8  # min_samples=10 -> 2 held out
    # Within-device covariance is diag(j^-1.2): pooled within-device variance per feature.
    resid = np.concatenate([ds.X_train[p] - ds.X_train[p].mean(0) for p in ds.device_indices])
    var = (resid.astype(np.float64) ** 2).sum(0) / (resid.shape[0] - ds.n_devices)
    expected = np.arange(1, 61) ** -1.2
    # ~19k dof -> relative sd of a variance estimate ~1%; 6% is > 5 sigma.
    np.testing.assert_allclose(var, expected, rtol=0.06)


def test_synthetic_sizes_mean_and_reproducibility():
    a = make_synthetic(2000, seeded_generator(5), mean_samples=50, min_samples=10)
    b = make_synthetic(2000, seeded_generator(5), mean_samples=50, min_samples=10)
    assert np.array_equal(a.X_train, b.X_train) and np.array_equal(a.y_test, b.y_test)
    total = a.X_train.shape[0] + a.X_test.shape[0]
    # sd of lognormal(mean 40, sigma 1) = 40*sqrt(e-1) = 52.4; se of the mean (2000 devices) 1.2.
    assert abs(total / 2000 - 50) < 6
    # Standardised on the training set.
    np.testing.assert_allclose(a.X_train.mean(0, dtype=np.float64), 0, atol=1e-4)
    np.testing.assert_allclose(a.X_train.std(0, dtype=np.float64), 1, atol=1e-3)


def test_synthetic_ten_thousand_devices_via_load_federated():
    ds = load_federated("synthetic", 10_000, seed=1, samples_per_device=50)
    assert ds.n_devices == 10_000 and ds.n_features == 60
    sizes = np.array([p.size for p in ds.device_indices])
    assert sizes.min() >= 1 and sizes.sum() == ds.X_train.shape[0] == ds.y_train.size
    assert ds.X_test.shape[0] == ds.y_test.size > 0
    n_total = ds.X_train.shape[0] + ds.X_test.shape[0]
    assert 400_000 < n_total < 600_000  # expected 500k; se ~ 5k
    # Non-degenerate labels: every class present, none dominating, in both splits.
    for y in (ds.y_train, ds.y_test):
        frac = np.bincount(y, minlength=10) / y.size
        assert frac.min() > 0.03 and frac.max() < 0.3
    # Devices are heterogeneous: a typical device sees far fewer classes than the pool.
    ent = _mean_label_entropy(ds.device_indices[:500], ds.y_train)
    assert ent < 0.8 * np.log(10)


def test_synthetic_bad_arguments():
    rng = seeded_generator(0)
    with pytest.raises(ValueError, match="n_devices"):
        make_synthetic(0, rng)
    with pytest.raises(ValueError, match="alpha"):
        make_synthetic(5, rng, alpha=-1)
    with pytest.raises(ValueError, match="beta"):
        make_synthetic(5, rng, beta=float("nan"))
    with pytest.raises(ValueError, match="mean_samples"):
        make_synthetic(5, rng, mean_samples=5, min_samples=10)
    with pytest.raises(ValueError, match="min_samples"):
        make_synthetic(5, rng, min_samples=1)
    with pytest.raises(ValueError, match="test_fraction"):
        make_synthetic(5, rng, test_fraction=0)
    with pytest.raises(ValueError, match="pooled test set empty"):
        make_synthetic(2, rng, mean_samples=2, min_samples=2, test_fraction=0.2)
    with pytest.raises(ValueError, match="only the natural partition"):
        load_federated("synthetic", 5, partition="dirichlet")
    nat = load_federated("synthetic", 5, partition="natural")
    iid = load_federated("synthetic", 5, partition="iid")  # generic default = natural
    assert nat.n_devices == 5 and np.array_equal(nat.X_train, iid.X_train)


def test_a_contiguous_share_is_a_read_only_view_and_equals_the_copy():
    from edge_fl.data.base import FederatedDataset

    X = np.arange(40, dtype=np.float32).reshape(10, 4)
    y = np.arange(10) % 3
    parts = (np.arange(0, 4), np.arange(4, 10), np.array([1, 3, 5]))
    data = FederatedDataset("t", X, y, X[:2], y[:2], 3, parts)
    Xv, yv = data.device_data(1)
    np.testing.assert_array_equal(Xv, X[4:10])
    np.testing.assert_array_equal(yv, y[4:10])
    assert not Xv.flags.writeable and np.shares_memory(Xv, X)  # a view, not a copy
    Xc, _ = data.device_data(2)  # not contiguous: a copy, as before
    np.testing.assert_array_equal(Xc, X[[1, 3, 5]])
    assert not np.shares_memory(Xc, X)


def test_synthetic_iid_labels_every_device_with_one_model():
    """synthetic-iid (FedProx's Synthetic IID, the scale example's dataset): one W, b for every
    device, so one logistic regression fitted to the pooled data labels each device's rows, and
    the device sizes still follow the lognormal of synthetic."""
    from edge_fl.models.logreg import LogisticRegression
    from edge_fl.models.training import LocalTraining, local_sgd

    data = load_federated("synthetic-iid", 300, seed=1, samples_per_device=40)
    assert data.name == "synthetic-iid" and data.n_classes == 10
    sizes = [len(data.device_data(i)[1]) for i in range(300)]
    assert min(sizes) >= 8 and len(set(sizes)) > 10
    model = LogisticRegression(data.n_features, data.n_classes)
    w = local_sgd(
        model,
        np.zeros(model.n_params, np.float32),
        data.X_train,
        data.y_train,
        LocalTraining(epochs=5, batch_size=32, lr=0.3),
        np.random.default_rng(0),
    )
    pred = (data.X_test @ w[:-10].reshape(data.n_features, 10) + w[-10:]).argmax(axis=1)
    assert (pred == data.y_test).mean() > 0.8  # one model for all (synthetic: ~0.1-0.2)
    again = load_federated("synthetic-iid", 300, seed=1, samples_per_device=40)
    assert np.array_equal(again.X_train, data.X_train)  # seeded

"""Shared small fixtures for the per-mechanism tests (broker-free, a few ms each).

Independent reference implementations (per-example logreg gradients, clipping, minibatch SGD)
live in the ``ref`` fixture so the tests never check a mechanism against its own helpers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from edge_fl.config import load_config
from edge_fl.mechanisms import JobFacts, Mechanism, build_mechanism
from edge_fl.models import make_model
from edge_fl.models.base import Model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.rng import seeded_generator
from edge_fl.protocol import (
    GlobalModel,
    PayloadRejected,
    Reject,
    Update,
    UpdateLimits,
    decode_update,
    encode_update,
)

N_FEATURES = 6
N_CLASSES = 3
N_PARAMS = N_FEATURES * N_CLASSES + N_CLASSES  # 21
N_SAMPLES = 40


def synthetic_data(
    n: int = N_SAMPLES, n_features: int = N_FEATURES, n_classes: int = N_CLASSES, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Linearly separable-ish blobs: labels from a random linear map, features float32."""
    g = np.random.default_rng(seed)
    X = g.normal(size=(n, n_features)).astype(np.float32)
    W = g.normal(size=(n_features, n_classes))
    y = np.argmax(X @ W + 0.3 * g.normal(size=(n, n_classes)), axis=1).astype(np.int64)
    return X, y


@dataclass
class FakeDevice:
    """Satisfies ``edge_fl.mechanisms.base.Device``: data, model, training settings, generator."""

    device_id: str
    X: np.ndarray
    y: np.ndarray
    model: Model
    training: LocalTraining
    rng: np.random.Generator

    @property
    def n_samples(self) -> int:
        return len(self.y)


# ---------------------------------------------------------------------------------------------
# Independent references


def _softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def ref_per_sample_grads(params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cross-entropy gradient of each example for the flat logreg layout [W (f x c), b (c)]."""
    n, f = X.shape
    c = params.size // (f + 1)
    w = np.asarray(params, np.float64)
    W, b = w[: f * c].reshape(f, c), w[f * c :]
    dz = _softmax(X.astype(np.float64) @ W + b)
    dz[np.arange(n), y] -= 1.0
    return np.concatenate([np.einsum("nf,nc->nfc", X, dz).reshape(n, f * c), dz], axis=1)


def ref_clip_rows(g: np.ndarray, bound: float, ord: int) -> np.ndarray:
    norms = np.linalg.norm(g, ord=ord, axis=1, keepdims=True)
    return g / np.maximum(1.0, norms / bound)


def ref_clip(v: np.ndarray, bound: float) -> np.ndarray:
    return v * min(1.0, bound / max(float(np.linalg.norm(v)), 1e-300))


def ref_local_sgd(
    params: np.ndarray, X: np.ndarray, y: np.ndarray, t: LocalTraining, rng: np.random.Generator
) -> np.ndarray:
    """Shuffled minibatch SGD on the mean cross-entropy, float64 (same permutation draws)."""
    w = np.asarray(params, np.float64).copy()
    for _ in range(t.epochs):
        order = rng.permutation(len(y))
        for s in range(0, len(y), t.batch_size):
            b = order[s : s + t.batch_size]
            w -= t.lr * ref_per_sample_grads(w, X[b], y[b]).mean(axis=0)
    return w


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture
def rng() -> np.random.Generator:
    return seeded_generator(2024)


@pytest.fixture
def ref() -> SimpleNamespace:
    return SimpleNamespace(
        per_sample_grads=ref_per_sample_grads,
        clip_rows=ref_clip_rows,
        clip=ref_clip,
        local_sgd=ref_local_sgd,
        data=synthetic_data,
    )


@pytest.fixture
def data() -> tuple[np.ndarray, np.ndarray]:
    return synthetic_data()


@pytest.fixture
def model() -> Model:
    return make_model("logreg", N_FEATURES, N_CLASSES)


@pytest.fixture(scope="session")
def make_facts() -> Callable[..., JobFacts]:
    def factory(**overrides: Any) -> JobFacts:
        base: dict[str, Any] = dict(
            rounds=10,
            n_devices=4,
            expected_participants=4.0,
            n_params=N_PARAMS,
            local_lr=0.1,
            local_epochs=1,
            batch_size=8,
            min_dataset_size=20,
            max_uploads=5,
            mode="sync",
            dataset_sizes=(20, 40, 40, 80),
        )
        base.update(overrides)
        return JobFacts(**base)

    return factory


@pytest.fixture
def facts(make_facts) -> JobFacts:
    return make_facts()


@pytest.fixture(scope="session")
def make_mechanism(make_facts) -> Callable[..., Mechanism]:
    """``make_mechanism(name, facts=None, **privacy_overrides)``; nested keys as ``signds__k``."""

    def factory(name: str, facts: JobFacts | None = None, **privacy: Any) -> Mechanism:
        overrides = {"privacy.mechanism": name}
        overrides.update({f"privacy.{k.replace('__', '.')}": v for k, v in privacy.items()})
        cfg = load_config(None, overrides).privacy
        return build_mechanism(cfg, facts or make_facts())

    return factory


@pytest.fixture
def make_device(data, model) -> Callable[..., FakeDevice]:
    def factory(
        seed: int = 1,
        *,
        X: np.ndarray | None = None,
        y: np.ndarray | None = None,
        model: Model = model,
        training: LocalTraining | None = None,
        device_id: str = "dev-1",
    ) -> FakeDevice:
        return FakeDevice(
            device_id,
            data[0] if X is None else X,
            data[1] if y is None else y,
            model,
            training or LocalTraining(epochs=1, batch_size=8, lr=0.1),
            seeded_generator(seed),
        )

    return factory


@pytest.fixture
def global_msg() -> Callable[..., GlobalModel]:
    def factory(params: np.ndarray, round: int = 3, **kw: Any) -> GlobalModel:
        kw.setdefault("version", round)
        return GlobalModel("job", params=np.asarray(params, np.float32), round=round, **kw)

    return factory


@pytest.fixture
def wire() -> Callable[..., Update]:
    """Encode an update, decode it under the mechanism's own kind; assert the other kind refuses."""

    def roundtrip(update: Update, mech: Mechanism, n_params: int, max_dim_out: int = 100):
        payload = encode_update(update, dim=n_params)
        own = UpdateLimits(n_params, max_dim_out, frozenset({mech.wire_kind}))
        got = decode_update(payload, own, topic_device=update.device)
        other = ({"u", "s"} - {mech.wire_kind}).pop()
        with pytest.raises(PayloadRejected) as err:
            decode_update(
                payload, UpdateLimits(n_params, max_dim_out, frozenset({other})), update.device
            )
        assert err.value.reason == Reject.WRONG_MECHANISM
        assert got.device == update.device and got.round == update.round
        assert got.base_version == update.base_version and got.n_samples == update.n_samples
        return got

    return roundtrip

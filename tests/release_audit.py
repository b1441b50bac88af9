"""Empirical DP audit of a whole release: neighbouring datasets through the REAL device rule.

Test harness (used by tests/test_release_audit.py and tools/bench_release_audit.py), not part of
the edge_fl package.

:mod:`edge_fl.privacy.audit` audits the bare noise functions on worst-case *outputs*; this module
audits what a device actually uploads: two neighbouring local datasets D0, D1 go through a
mechanism's own ``device_update`` (its local training, clipping, projection and noise), ``n`` times
each, and a distinguishing test on the uploads gives a statistical lower bound on epsilon (method:
``docs/specs/privacy.md`` section 5). A sensitivity that the local training does not actually enforce
(several local steps, a clip in the wrong place, a data-dependent normaliser) shows up here and
not in the noise-function audit.

Procedure of :func:`audit_release`:

1. *Calibration* (``calibration_runs`` runs per dataset, their own generators): the mean uploads
   a, b on D0, D1 estimate the noise-free uploads; coordinates whose difference is not significant
   (< ``snap`` standard errors) are dropped. The test statistic is fixed from a, b: the projection
   on the direction b - a (``"gaussian"``: the likelihood-ratio statistic of isotropic Gaussian
   noise) or ``sum_j |u_j - a_j| - |u_j - b_j|`` over the kept coordinates (``"laplace"``: the
   likelihood ratio of per-coordinate Laplace noise, whose top atom is the exact test of spec 5.1).
   The threshold is the one whose calibration rates, extrapolated to ``n`` runs, give the largest
   bound. None of this sees the audit runs, so the event is fixed in advance.
2. *Audit* (``n`` runs per dataset, fresh generators): count k0, k1 uploads in the event and bound
   eps with one-sided Clopper-Pearson intervals at ``alpha/2`` each
   (:func:`edge_fl.privacy.audit.eps_lower_bound`). For a mechanism that keeps its claim,
   ``epsilon_lower_bound > claimed_epsilon`` happens with probability <= ``alpha``.
3. *Claim*: the epsilon that the CLAIMING mechanism's ``release_events`` give at the audited delta'
   (tightest accountant, :func:`edge_fl.privacy.accountants.best_epsilon`). The mechanism that runs
   and the one that claims are separate arguments, so a test can run a mechanism with half the noise
   while claiming the original's epsilon and check that the audit catches it
   (:func:`noise_scaled` builds such a config).

Audit delta': 1e-3 for approximate-DP mechanisms (tails at 1e-5 need far more than 1e5 runs; the
accountant's eps at 1e-3 is the reference, for one Gaussian event within 1e-4 of the exact
``get_epsilon_gaussian``), 0 for pure-DP ones. Every run uses a seeded PCG64 stream from the
caller's generator: an audit is a test harness, production randomness is not involved.

Canaries (:func:`replace_one_canary`, :func:`add_remove_canary`) are built for softmax regression
with two classes at the all-zero broadcast model: an example with features ``x e_1`` has gradient
``[x e_1 (x) dz, dz]`` with ``dz = +-(1/2, -1/2)`` depending on its label, so swapping its label
flips the gradient exactly. Once clipped (the clip binds when L2 ``C/lr < sqrt((1 + x^2)/2)``, or
L1 ``C < 1 + |x|``) the two versions differ by the full ``2C`` and a one-step rule's uploads by
exactly its claimed sensitivity; with ``x = 0`` the difference sits on the two bias coordinates.
Runs cost ~0.1-0.2 ms each (the rule is called once per run, nothing is batched around it), so
n = 1e4 audit runs plus 2e3 calibration runs per dataset take ~3-4 s.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from edge_fl.mechanisms import JobFacts, Mechanism
from edge_fl.models.base import Model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy.audit import eps_lower_bound
from edge_fl.protocol import DenseUpdate, GlobalModel

__all__ = [
    "AuditDevice",
    "Neighbours",
    "ReleaseAudit",
    "TestStatistic",
    "add_remove_canary",
    "audit_release",
    "claimed_epsilon",
    "fit_statistic",
    "noise_free_distance",
    "noise_scaled",
    "release_facts",
    "replace_one_canary",
    "run_uploads",
]

TestKind = Literal["gaussian", "laplace"]
_ROUND = 9  # decimals the normalised statistic is rounded to, so atoms compare exactly
_CANDIDATES = 121  # thresholds tried on the calibration runs


# ------------------------------------------------------------------------------------------
# Devices and neighbouring datasets


@dataclass
class AuditDevice:
    """The smallest object the device rules accept (:class:`edge_fl.mechanisms.Device`)."""

    device_id: str
    X: np.ndarray
    y: np.ndarray
    model: Model
    training: LocalTraining
    rng: np.random.Generator

    @property
    def n_samples(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class Neighbours:
    """Two local datasets that differ in one example, and the broadcast model they start from."""

    X0: np.ndarray
    y0: np.ndarray
    X1: np.ndarray
    y1: np.ndarray
    params: np.ndarray  # the broadcast model (float32)
    relation: str  # "replace_one" | "add_or_remove_one" | "replace_special"
    description: str = ""

    def dataset(self, which: int) -> tuple[np.ndarray, np.ndarray]:
        if which not in (0, 1):
            raise ValueError(f"which must be 0 or 1, got {which!r}")
        return (self.X0, self.y0) if which == 0 else (self.X1, self.y1)


def _check_binary_logreg(model: Model) -> None:
    if getattr(model, "name", None) != "logreg" or model.n_classes != 2:
        raise ValueError(
            "the crafted canaries need softmax regression with 2 classes "
            f"(edge_fl.models.make_model('logreg', n_features, 2)), got {model.name!r} with "
            f"{getattr(model, 'n_classes', '?')} classes"
        )


BaseKind = Literal["random", "balanced", "aligned"]


def _base(
    model: Model, n: int, rng: np.random.Generator, base: BaseKind
) -> tuple[np.ndarray, np.ndarray]:
    if base == "random":
        X = rng.normal(size=(n, model.n_features))
        return X, rng.integers(0, model.n_classes, size=n).astype(np.int64)
    zeros = np.zeros((n, model.n_features))
    if base == "aligned":  # every gradient equals the label-0 one: opposite to the canary's
        return zeros, np.zeros(n, dtype=np.int64)
    if base == "balanced":  # x = 0, labels alternate: clipped gradients cancel in pairs
        return zeros, (np.arange(n) % 2).astype(np.int64)
    raise ValueError(f"base must be 'random', 'balanced' or 'aligned', got {base!r}")


def _canary(model: Model, x: float) -> np.ndarray:
    out = np.zeros((1, model.n_features))
    out[0, 0] = float(x)
    return out


def _check_m(m: int) -> None:
    if int(m) != m or m < 1:
        raise ValueError(f"m must be an integer >= 1, got {m!r}")


def replace_one_canary(
    model: Model, m: int, rng: np.random.Generator, x: float = 0.0, base: BaseKind = "random"
) -> Neighbours:
    """D0, D1 of ``m`` examples: ``m - 1`` shared ones plus a canary with features ``x e_1``,
    label 0 in D0 and 1 in D1. At the zero model the canary's two gradients ``[x e_1 (x) dz, dz]``
    are exact opposites (dz flips sign with the label), so any per-example clip that binds
    (L2 ``C/lr < |dz| sqrt(1 + x^2)``, ``|dz| = 1/sqrt 2``; L1 ``C < 1 + |x|``) makes the clipped
    gradients differ by the full 2C: the worst case of a one-step rule. ``x = 0`` (default) puts
    the whole difference on the two bias coordinates (the most powerful Laplace test); a large
    ``x`` makes an UNclipped multi-step training move far apart."""
    _check_binary_logreg(model)
    _check_m(m)
    X, y = _base(model, m - 1, rng, base)
    X0 = np.vstack([X, _canary(model, x)])
    return Neighbours(
        X0,
        np.append(y, 0),
        X0.copy(),
        np.append(y, 1),
        np.zeros(model.n_params, dtype=np.float32),
        "replace_one",
        f"{m} examples ({base} base); canary x = {x:g} e_1, label 0 (D0) / 1 (D1), zero model",
    )


def add_remove_canary(
    model: Model,
    m: int,
    rng: np.random.Generator,
    x: float = 0.0,
    base: BaseKind = "balanced",
) -> Neighbours:
    """D0 of ``m`` examples, D1 = D0 plus a canary (features ``x e_1``, label 1).

    ``base``: ``"balanced"`` (default): x = 0 with alternating labels, whose clipped gradients
    cancel in pairs, so in a full batch the canary adds exactly its clipped gradient to the sum
    (the sensitivity an add/remove accountant assumes) and nothing else differs; ``"aligned"``:
    x = 0, label 0, every gradient opposite to the canary's (where a normaliser that depends on |D|
    adds most to the canary's effect); ``"random"``: Gaussian features, random labels."""
    _check_binary_logreg(model)
    _check_m(m)
    X, y = _base(model, m, rng, base)
    return Neighbours(
        X,
        y,
        np.vstack([X, _canary(model, x)]),
        np.append(y, 1),
        np.zeros(model.n_params, dtype=np.float32),
        "add_or_remove_one",
        f"D0: {m} examples ({base}); D1 adds the canary x = {x:g} e_1, label 1; zero model",
    )


class NullSlotModel:
    """A model whose examples with label -1 are null: their per-example gradient is zero.

    DP-SGD's relation is REPLACE_SPECIAL (|D| is public; neighbours replace one example by a null
    one). The null example is a modelling device, not a value of the data domain, so the audit
    stands it in with this wrapper; the DP-SGD rule that runs on it is the real one."""

    def __init__(self, model: Model) -> None:
        self.model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def per_sample_grads(self, params: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        y = np.asarray(y)
        out = np.zeros((len(y), self.model.n_params))
        real = y >= 0
        if real.any():
            out[real] = self.model.per_sample_grads(params, X[real], y[real])
        return out


def replace_special_canary(
    model: Model,
    m: int,
    rng: np.random.Generator,
    x: float = 0.0,
    base: BaseKind = "balanced",
) -> Neighbours:
    """D0 = ``m`` examples plus a null example, D1 = the same ``m`` plus a canary (features
    ``x e_1``, label 1): |D| = m + 1 in both. Run the mechanism with ``NullSlotModel(model)``."""
    _check_binary_logreg(model)
    _check_m(m)
    X, y = _base(model, m, rng, base)
    return Neighbours(
        np.vstack([X, np.zeros((1, model.n_features))]),
        np.append(y, -1),
        np.vstack([X, _canary(model, x)]),
        np.append(y, 1),
        np.zeros(model.n_params, dtype=np.float32),
        "replace_special",
        f"D0: {m} examples ({base}) + a null example; D1: the null one replaced by the canary "
        f"x = {x:g} e_1, label 1; zero model",
    )


# ------------------------------------------------------------------------------------------
# Building the mechanism to audit


def release_facts(
    model: Model,
    m: int,
    *,
    lr: float = 1.0,
    epochs: int = 1,
    batch_size: int = 16,
    max_uploads: int = 1,
    rounds: int | None = None,
) -> JobFacts:
    """Facts of a one-device job whose smallest dataset has ``m`` examples (one release audited)."""
    t = max_uploads if rounds is None else rounds
    return JobFacts(
        rounds=t,
        n_devices=1,
        expected_participants=1.0,
        n_params=model.n_params,
        local_lr=lr,
        local_epochs=epochs,
        batch_size=batch_size,
        min_dataset_size=m,
        max_uploads=max_uploads,
        dataset_sizes=(m,),
    )


def noise_scaled(cfg: Any, factor: float) -> Any:
    """A copy of a PrivacyConfig whose mechanism adds ``factor`` times the noise (0.5 = halved).

    With ``noise_multiplier`` set it is multiplied; otherwise ``epsilon`` is divided, which scales
    the noise exactly for mechanisms whose noise is proportional to 1/eps at a fixed delta (laplace,
    nbafl). Calibrated noise (gaussian, dpsgd from epsilon) is not linear in eps: set
    ``noise_multiplier`` explicitly to scale it."""
    f = float(factor)
    if not math.isfinite(f) or f <= 0:
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    if cfg.noise_multiplier is not None:
        return cfg.model_copy(update={"noise_multiplier": cfg.noise_multiplier * f})
    if cfg.mechanism not in ("laplace", "nbafl") or cfg.epsilon is None:
        raise ValueError(
            f"cannot scale the noise of {cfg.mechanism!r} through epsilon (noise not proportional "
            "to 1/eps); set privacy.noise_multiplier"
        )
    return cfg.model_copy(update={"epsilon": cfg.epsilon / f})


# ------------------------------------------------------------------------------------------
# Running the real rule


def _message(params: np.ndarray) -> GlobalModel:
    return GlobalModel(job="audit", version=0, round=0, params=np.asarray(params, np.float32))


def run_uploads(
    mechanism: Mechanism,
    model: Model,
    X: np.ndarray,
    y: np.ndarray,
    params: np.ndarray,
    n: int,
    rng: np.random.Generator,
    exposure: int = 0,
) -> np.ndarray:
    """``n`` uploads (``delta`` of each :class:`DenseUpdate`, float64, shape (n, n_params)) of the
    mechanism's real ``device_update`` on (X, y) from ``params``. The device's generator is a fresh
    seeded stream from ``rng``; consecutive runs consume disjoint parts of it (independent runs)."""
    runs = int(n)
    if runs != n or runs < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    facts = mechanism.facts
    training = LocalTraining(
        facts.local_epochs if facts else 1,
        facts.batch_size if facts else 16,
        facts.local_lr if facts else 0.1,
    )
    device = AuditDevice("audit", X, y, model, training, _child(rng))
    msg = _message(params)
    out = np.empty((runs, model.n_params))
    for i in range(runs):
        update = mechanism.device_update(device, msg, exposure)
        if not isinstance(update, DenseUpdate):
            raise TypeError(
                f"the release audit needs dense updates; {mechanism.name!r} returned "
                f"{type(update).__name__}"
            )
        out[i] = update.delta
    return out


def noise_free_distance(
    mechanism: Mechanism,
    model: Model,
    neighbours: Neighbours,
    rng: np.random.Generator,
    ord: float = 2,
) -> float:
    """``ord``-norm distance between the uploads of D0 and D1 by a mechanism built with (almost)
    no noise: the realised sensitivity of its local training, through the real rule. Build the
    mechanism with e.g. ``epsilon = 1e12`` (noise ~1e-12). Same generator state for both."""
    seed = int(rng.integers(2**63))
    ups = [
        run_uploads(mechanism, model, *neighbours.dataset(k), neighbours.params, 1, _gen(seed))[0]
        for k in (0, 1)
    ]
    return float(np.linalg.norm(ups[1] - ups[0], ord=ord))


def _gen(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def _child(rng: np.random.Generator) -> np.random.Generator:
    """A PCG64 stream seeded from ``rng`` (any generator, including the ChaCha CSPRNG)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(rng.integers(2**63, size=4))))


# ------------------------------------------------------------------------------------------
# The claim


def claimed_epsilon(
    mechanism: Mechanism, n_samples: int, delta: float, exposure: int = 0
) -> tuple[float, str]:
    """(eps, accountant): the tightest epsilon of one release's events at ``delta``."""
    from edge_fl.privacy.accountants import best_epsilon

    events = mechanism.release_events(n_samples, exposure)
    if not events:
        return math.inf, "none"
    bound = best_epsilon(events, delta)
    return float(bound.epsilon), bound.accountant


# ------------------------------------------------------------------------------------------
# The test statistic


@dataclass(frozen=True)
class TestStatistic:
    """A scalar statistic of an upload and a threshold; the event is ``statistic >= threshold``."""

    __test__ = False  # not a pytest class

    kind: TestKind
    a: np.ndarray  # reference upload for D0 (calibration mean)
    b: np.ndarray  # reference upload for D1
    support: np.ndarray  # bool: coordinates that take part
    threshold: float = 0.0

    @property
    def distance(self) -> float:
        d = (self.b - self.a)[self.support]
        return float(np.linalg.norm(d) if self.kind == "gaussian" else np.abs(d).sum())

    def __call__(self, uploads: np.ndarray) -> np.ndarray:
        u = np.atleast_2d(np.asarray(uploads, np.float64))[:, self.support]
        a, b = self.a[self.support], self.b[self.support]
        if self.kind == "gaussian":
            s = (u - 0.5 * (a + b)) @ (b - a) / self.distance
        else:  # Laplace log-likelihood ratio (times the scale), in [-distance, distance]
            s = (np.abs(u - a) - np.abs(u - b)).sum(axis=1) / self.distance
        return np.round(s, _ROUND)

    def counts(self, u0: np.ndarray, u1: np.ndarray) -> tuple[int, int]:
        return (
            int(np.count_nonzero(self(u0) >= self.threshold)),
            int(np.count_nonzero(self(u1) >= self.threshold)),
        )


def fit_statistic(
    u0: np.ndarray,
    u1: np.ndarray,
    kind: TestKind,
    n: int,
    delta: float,
    alpha: float,
    snap: float = 4.0,
    min_count: int = 10,
) -> TestStatistic:
    """The statistic and threshold from calibration uploads ``u0``, ``u1`` (same count each).

    Reference points: the mean uploads; coordinates whose mean difference is below ``snap``
    standard errors are dropped. Threshold: among quantiles of the pooled calibration statistics,
    the one whose calibration rates (with a +1/2 pseudo-count), scaled to ``n`` audit runs, give
    the largest bound; a threshold qualifies only if, for one of the two directions of the test,
    both of its error counts on the calibration runs are >= ``min_count`` (deeper tails are too
    noisily estimated and lose power on average)."""
    if kind not in ("gaussian", "laplace"):
        raise ValueError(f"kind must be 'gaussian' or 'laplace', got {kind!r}")
    n_cal = u0.shape[0]
    if u1.shape != u0.shape or n_cal < 2:
        raise ValueError(f"calibration uploads must have equal shapes (>= 2 rows): {u0.shape}")
    a, b = u0.mean(axis=0), u1.mean(axis=0)
    se = np.sqrt((u0.var(axis=0, ddof=1) + u1.var(axis=0, ddof=1)) / n_cal)
    support = np.abs(b - a) > snap * se
    if not support.any():
        raise ValueError(
            "the calibration runs show no significant difference between D0 and D1 uploads: "
            "more calibration runs, or a canary with a larger effect, are needed"
        )
    stat = TestStatistic(kind, a, b, support)
    s0, s1 = np.sort(stat(u0)), np.sort(stat(u1))
    pooled = np.concatenate([s0, s1])
    cands = np.unique(np.quantile(pooled, np.linspace(0.0, 1.0, _CANDIDATES), method="lower"))
    cands = np.unique(np.concatenate([cands, np.unique(pooled)[-3:], np.unique(pooled)[:3]]))
    k0s = n_cal - np.searchsorted(s0, cands, side="left")  # #(s >= t)
    k1s = n_cal - np.searchsorted(s1, cands, side="left")
    best, best_t = -1.0, float(cands[0])
    for t, k0, k1 in zip(cands, k0s, k1s, strict=True):
        if min(k0, n_cal - k1) < min_count and min(n_cal - k0, k1) < min_count:
            continue
        e0 = min(n, round((k0 + 0.5) / (n_cal + 1) * n))
        e1 = min(n, round((k1 + 0.5) / (n_cal + 1) * n))
        score = eps_lower_bound(e0, e1, n, delta, alpha)
        if score > best:
            best, best_t = score, float(t)
    if best < 0:
        raise ValueError(
            f"no threshold has >= {min_count} calibration counts on both error sides: more "
            "calibration runs are needed"
        )
    return TestStatistic(kind, a, b, support, best_t)


# ------------------------------------------------------------------------------------------
# The audit


@dataclass(frozen=True)
class ReleaseAudit:
    """Result of :func:`audit_release`. ``ok``: the lower bound does not exceed the claim."""

    mechanism: str
    claimed_by: str
    relation: str
    test: str
    claimed_epsilon: float
    claim_accountant: str
    epsilon_lower_bound: float
    delta: float
    alpha: float
    n: int
    calibration_runs: int
    k0: int
    k1: int
    threshold: float
    support_size: int
    reference_distance: float
    seconds: float
    #: Laplace test only: ln of the event's probability ratio, which is exactly e^eps when the
    #: event is the top atom (or its complement the bottom one) of the likelihood ratio
    epsilon_estimate: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.epsilon_lower_bound <= self.claimed_epsilon

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def audit_release(
    mechanism: Mechanism,
    model: Model,
    neighbours: Neighbours,
    n: int,
    rng: np.random.Generator,
    *,
    claim: Mechanism | float | None = None,
    delta: float | None = None,
    alpha: float = 1e-3,
    calibration_runs: int | None = None,
    test: TestKind | None = None,
    exposure: int = 0,
) -> ReleaseAudit:
    """Audit one release of ``mechanism``'s real device rule on ``neighbours`` (see module doc).

    ``claim``: the mechanism whose ``release_events`` give the claimed eps (default: the audited
    one), or a number. ``delta``: the audited delta' (default 1e-3, or 0 for pure-DP claims).
    ``test``: statistic family (default ``"laplace"`` for pure-DP mechanisms, else
    ``"gaussian"``). ``calibration_runs`` per dataset default to max(1000, n / 5).
    """
    started = time.perf_counter()
    runs = int(n)
    if runs != n or runs < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}")
    claimer = mechanism if claim is None else claim
    pure = (
        claimer.guarantee.kind == "pure"
        if isinstance(claimer, Mechanism)
        else mechanism.guarantee.kind == "pure"
    )
    d = (0.0 if pure else 1e-3) if delta is None else float(delta)
    kind: TestKind = test or ("laplace" if mechanism.guarantee.kind == "pure" else "gaussian")
    notes: list[str] = []
    if mechanism.guarantee.relation not in ("none", neighbours.relation):
        notes.append(
            f"neighbours are {neighbours.relation} but {mechanism.name} claims "
            f"{mechanism.guarantee.relation}"
        )
    if isinstance(claimer, Mechanism):
        sizes = sorted({len(neighbours.y0), len(neighbours.y1)})
        claims = [claimed_epsilon(claimer, s, d, exposure) for s in sizes]
        claimed, accountant = min(claims)  # the stricter: every size's claim must hold
        if len({c for c, _ in claims}) > 1:
            notes.append(f"claims differ by dataset size {sizes}: {claims}; the smaller is used")
        claimed_by = claimer.name
    else:
        claimed, accountant, claimed_by = float(claimer), "given", "given"
    n_cal = max(1000, runs // 5) if calibration_runs is None else int(calibration_runs)
    seeds = [_child(rng) for _ in range(4)]

    def uploads(which: int, count: int, gen: np.random.Generator) -> np.ndarray:
        X, y = neighbours.dataset(which)
        return run_uploads(mechanism, model, X, y, neighbours.params, count, gen, exposure)

    stat = fit_statistic(
        uploads(0, n_cal, seeds[0]), uploads(1, n_cal, seeds[1]), kind, runs, d, alpha
    )
    k0, k1 = stat.counts(uploads(0, runs, seeds[2]), uploads(1, runs, seeds[3]))
    estimate = None
    if kind == "laplace":  # the top atom (k1/k0) or the bottom one ((n-k0)/(n-k1)): ratio e^eps
        ratios = [(k1, k0), (runs - k0, runs - k1)]
        logs = [math.log(a / b) for a, b in ratios if a > 0 and b > 0]
        estimate = max(logs) if logs else None
    return ReleaseAudit(
        mechanism=mechanism.name,
        claimed_by=claimed_by,
        relation=neighbours.relation,
        test=kind,
        claimed_epsilon=claimed,
        claim_accountant=accountant,
        epsilon_lower_bound=eps_lower_bound(k0, k1, runs, d, alpha),
        delta=d,
        alpha=alpha,
        n=runs,
        calibration_runs=n_cal,
        k0=k0,
        k1=k1,
        threshold=stat.threshold,
        support_size=int(stat.support.sum()),
        reference_distance=stat.distance,
        seconds=time.perf_counter() - started,
        epsilon_estimate=estimate,
        notes=notes,
    )

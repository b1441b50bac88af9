"""Sharded ingest: workers fold disjoint shares of a round, the coordinator merges them exactly.

Sans-I/O; the runtime is ``edge_fl/server/ingest.py`` (workers) and ``AggregatorService`` with
``workers`` (coordinator). The broker deals the update stream among the workers (MQTT 5 shared
subscription ``$share/<group>/<prefix>/<job>/up/+``; or a device-id hash partition, or one site
broker per worker: ``ingest.partition``). Every worker runs the single aggregator's
core (decode, validate, admit, fold) on what it is dealt, so a payload is judged by the same code
wherever it lands. One round, over ``<prefix>/<job>/ingest/...`` (msgpack maps, ``v: 1``):

1. ``open`` (ctl): the round's signed global message as devices see it (round, version,
   selection, nonce, mechanism state), plus the robust norm bound of the round (``b``) or that
   it is held (``h``: no reference yet), and its relative sample cap (``c``: a worker folds
   each update at no more samples than this, as the coordinator would). Each worker mirrors
   the round.
2. ``progress`` (worker -> coordinator, after each socket burst, before it is acknowledged):
   the devices it accepted and refused since the last one, the releases it recorded (charged at
   once: a worker lost later cannot take them along) and the updates naming a round it never
   mirrored (it started later), which the coordinator judges with its history. The coordinator admits them in arrival order: the first copy of a
   device counts, a second copy from another worker (a device's re-publish, a redelivery after a
   reconnect) is a ``duplicate``, one beyond the target is ``late``, exactly as the single
   aggregator would judge them. It decides the round on these counts, as the single one does.
3. ``freeze`` (ctl): each worker stops admitting to the round (later answers are late, still
   charged) and sends a last ``progress`` marked final.
4. ``commit`` (ctl): per worker, the devices to leave out (step 2's duplicates and late ones).
   Each worker takes them back (exactly: ``Strategy.remove``) and answers with its ``partial``:
   the strategy's partial (exact fixed-point sums, :mod:`edge_fl.mechanisms.exact_sum`) and its
   tally. Every step is idempotent: a re-sent open, freeze or commit (a coordinator that
   reconnected) gets the same answer and changes nothing.
5. The coordinator merges the partials into its core and closes the round as usual. The merged
   model and ledger are bit-for-bit those of one aggregator on the same accepted updates
   (``tests/test_sharding.py``). A worker whose partial does not come (crashed, timed out) is
   reported; every selected device of the round that is not in the ledger is charged a release
   (it may have sent one: the ledger over-counts rather than under-counts) and its accepted
   devices leave the round's count.

Trust (issue 24): every ingest message is sealed (HMAC-SHA256, a trailing ``m`` key) with a key
the coordinator issued: worker ``w``'s key is ``HMAC(secret, "edge-fl ingest key v1" || w)`` for
the coordinator's secret (fresh per aggregator process, handed to the workers it spawns in 0600
files; or ``EDGE_FL_INGEST_SECRET_FILE`` for workers run elsewhere, each given only its own key).
A worker's message is checked with the key of the worker its *topic* names and must name the same
worker; control messages carry one MAC per worker, so no worker can speak for another or for the
coordinator. Freshness: control messages carry a rising ``q``, liveness a rising ``s``, progress
and partials the instance of the worker's latest liveness. Release entries must name a round the
coordinator issued and a device it selected there; a partial must hold what the coordinator
admitted and stay within the bounds its updates passed (per-update norm bound or plausibility,
times their weight). A refused message changes nothing; it is counted (``ingest_refused`` in the
round's record) and logged once.

Secure rounds (SecAgg+; docs/protocol.md "Ingest workers", "Secure rounds"): a worker hands the
small SecAgg+ messages (``ak``, ``sh``, ``ua``) to the coordinator in its progress (``sa``),
whose round session judges them and alone writes the devices' inboxes; the coordinator's
``masked`` control message (U2, the commitments) lets each worker check and sum the masked
inputs (``mx``) it is dealt, modulo 2^b (``edge_fl.secagg.aggregator.MaskedShare``), charging
each as the single aggregator would. At the masked phase's end, freeze and commit return each
worker's modular partial sum; the coordinator adds them and merges the sum into its session
(:meth:`Coordinator.merge_masked`): exact, whatever the split. A worker lost by then fails the
round (never a sum missing inputs whose masks the unmasking removes).

Secure FedBuff cohorts (several SecAgg+ cohorts in flight, ``edge_fl.server.cohorts``): the
same, once per cohort, keyed by the cohort number (``r``): a worker keeps a
:class:`CohortShare` per cohort and reports each summed masked input with its cohort (``cx``),
the coordinator keeps a :class:`ShardedRound` per cohort (:attr:`Coordinator.cohort_rounds`)
and merges each cohort's partials alone (:meth:`Coordinator.merge_cohort`); a cohort ``open``
lists the cohorts still open (``o``: a worker drops the others' shares).

Limits: synchronous rounds with a selection, or secure FedBuff cohorts (no Poisson
self-selection, no plain async modes); a
worker acknowledges an update once folded, so a worker killed mid-round loses its share of that
round (the single aggregator's journal does not cover workers), and so does a restarted
coordinator (:attr:`Coordinator.lost_before_resume`); docs/scale.md section 4.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from edge_fl.mechanisms.exact_sum import ExactSum
from edge_fl.protocol import Reject, Update, decode_global
from edge_fl.protocol.secure import masked_head, up_kind
from edge_fl.secagg.aggregator import MaskedShare
from edge_fl.secagg.primitives import pack as ring_pack
from edge_fl.secagg.primitives import ring_mask
from edge_fl.secagg.primitives import unpack as ring_unpack

from .aggregator import DEFERRED, SECURE_RELEASE, AggregatorCore

log = logging.getLogger("edge_fl.aggregator")

VERSION = 1
#: a partial or control message larger than this is refused (a model of 4M float64 limbs fits)
MAX_MESSAGE = 1 << 28


class ShardingError(ValueError):
    """A control, progress or partial message that is not what the protocol says."""


#: environment variable naming a file with the coordinator's secret (64 hex characters), for
#: workers run elsewhere (``edge-fl ingest --key-file``); without it the secret is per process
SECRET_ENV = "EDGE_FL_INGEST_SECRET_FILE"
_KEY_LABEL = b"edge-fl ingest key v1\x00"
_SEAL_LABEL = b"edge-fl ingest seal v1\x00"
_MAC_BYTES = 32
_process_secret: list[bytes] = []  # this process's secret once drawn (or read)


def run_secret() -> bytes:
    """The coordinator's secret: read from :data:`SECRET_ENV`'s file if set, else 32 random
    bytes drawn once per process (the aggregator and the workers it spawns share it; a
    restarted aggregator draws a new one, so nothing of an earlier run verifies)."""
    if not _process_secret:
        path = os.environ.get(SECRET_ENV)
        _process_secret.append(load_key(path) if path else os.urandom(32))
    return _process_secret[0]


def worker_key(secret: bytes, worker: str) -> bytes:
    """Worker ``worker``'s key: it seals that worker's messages and checks control messages."""
    return hmac.new(secret, _KEY_LABEL + worker.encode(), hashlib.sha256).digest()


def load_key(path: str | os.PathLike[str]) -> bytes:
    """A 32-byte key from a file of 64 hex characters (ShardingError otherwise)."""
    try:
        text = Path(path).read_text().strip()
        key = bytes.fromhex(text)
    except (OSError, ValueError) as exc:
        raise ShardingError(f"ingest key file {str(path)!r}: {exc}") from None
    if len(key) != 32:
        raise ShardingError(f"ingest key file {str(path)!r}: need 64 hex characters")
    return key


def _mac(key: bytes, job: str, body: bytes) -> bytes:
    return hmac.new(key, _SEAL_LABEL + job.encode() + b"\x00" + body, hashlib.sha256).digest()


def seal(keys: bytes | dict[str, bytes], job: str, kind: str, **fields: Any) -> bytes:
    """A message whose last key ``m`` authenticates everything before it: one MAC (a worker's
    message, ``keys`` its key), or a map worker -> MAC (control, ``keys`` every worker's)."""
    obj = {"v": VERSION, "k": kind, **fields}
    packer = msgpack.Packer(use_bin_type=True)
    body = packer.pack_map_header(len(obj) + 1) + b"".join(
        packer.pack(k) + packer.pack(v) for k, v in obj.items()
    )
    if isinstance(keys, bytes):
        mac: Any = _mac(keys, job, body)
    else:
        mac = {w: _mac(k, job, body) for w, k in keys.items()}
    return body + packer.pack("m") + packer.pack(mac)


def verify(payload: bytes, obj: dict[str, Any], key: bytes, job: str, who: str) -> None:
    """Check the seal of an unpacked message with ``key`` (``who``: the MAC's entry in a
    control message's map, or "" for a worker's single MAC). ShardingError if it fails."""
    if not obj or list(obj)[-1] != "m":
        raise ShardingError("not sealed with a key of this run (no 'm')")
    mac = obj["m"]
    tail = msgpack.packb("m") + msgpack.packb(mac, use_bin_type=True)
    if who:
        mac = mac.get(who) if isinstance(mac, dict) else None
    if not isinstance(mac, bytes) or len(mac) != _MAC_BYTES or not payload.endswith(tail):
        raise ShardingError("not sealed with a key of this run (malformed 'm')")
    if not hmac.compare_digest(mac, _mac(key, job, payload[: -len(tail)])):
        raise ShardingError(
            "not sealed with a key of this run (the MAC does not verify: a forgery, or what an "
            "earlier aggregator process and its workers left)"
        )


class Clock:
    """Rising sequence numbers that survive a restart (nanoseconds since the epoch, never
    repeated in a process): a replayed older message carries a smaller one."""

    def __init__(self) -> None:
        self._last = 0

    def __call__(self, step: int = 1) -> int:
        self._last = max(time.time_ns(), self._last + step)
        return self._last


def pack(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": VERSION, "k": kind, **fields}, use_bin_type=True)


def unpack(payload: bytes, kinds: tuple[str, ...]) -> dict[str, Any]:
    if len(payload) > MAX_MESSAGE:
        raise ShardingError(f"ingest message of {len(payload)} bytes exceeds {MAX_MESSAGE}")
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ShardingError(f"ingest message is not msgpack: {exc}") from None
    if not isinstance(obj, dict) or obj.get("v") != VERSION or obj.get("k") not in kinds:
        raise ShardingError(f"expected an ingest message of kind {kinds} and version {VERSION}")
    return obj


def _int(obj: dict, key: str) -> int:
    value = obj.get(key)
    if type(value) is not int or value < 0:
        raise ShardingError(f"ingest message field {key!r} must be an int >= 0, got {value!r}")
    return value


def _name(obj: dict, key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise ShardingError(f"ingest message field {key!r} must be a string, got {value!r}")
    return value


def _names(obj: dict, key: str) -> list[str]:
    value = obj.get(key, [])
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise ShardingError(f"ingest message field {key!r} must be a list of strings")
    return value


def _releases(msg: dict[str, Any]) -> list[list[Any]]:
    releases = msg.get("rel", [])
    if not isinstance(releases, list):
        raise ShardingError("a progress message's 'rel' must be a list")
    for item in releases:
        ok = isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)
        if not ok or type(item[1]) is not int or type(item[2]) is not int:
            raise ShardingError(f"a release is [device, round, samples], got {item!r}")
    return releases


def _deferred(msg: dict[str, Any]) -> list[list[Any]]:
    items = msg.get("d", [])
    if not isinstance(items, list):
        raise ShardingError("a progress message's 'd' must be a list")
    for item in items:
        ok = isinstance(item, list) and len(item) == 5 and isinstance(item[0], str)
        ints = ok and all(type(x) is int and x >= 0 for x in item[1:4])
        if not ints or not (item[4] is None or isinstance(item[4], bytes)):
            raise ShardingError(
                f"a deferred update is [device, round, base version, samples, nonce], got {item!r}"
            )
    return items


def _forwarded(msg: dict[str, Any]) -> list[list[Any]]:
    """A progress message's ``sa``: SecAgg+ messages [device, payload] for the coordinator."""
    items = msg.get("sa", [])
    ok = isinstance(items, list) and all(
        isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], bytes)
        for x in items
    )
    if not ok:
        raise ShardingError("a progress message's 'sa' lists [device, payload] pairs")
    return items


def _cohort_pairs(msg: dict[str, Any]) -> list[list[Any]]:
    """A progress message's ``cx``: [cohort number, device] of each masked input summed."""
    items = msg.get("cx", [])
    ok = isinstance(items, list) and all(
        isinstance(x, list) and len(x) == 2 and type(x[0]) is int and isinstance(x[1], str)
        for x in items
    )
    if not ok:
        raise ShardingError("a progress message's 'cx' lists [cohort, device] pairs")
    return items


def _counts(msg: dict[str, Any], key: str) -> dict[str, int]:
    value = msg.get(key) or {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in value.items()
    ):
        raise ShardingError(f"ingest message field {key!r} maps reasons to counts")
    return value


def _tally(msg: dict[str, Any]) -> dict[str, Any]:
    """A partial's tally, checked before anything of the partial is merged."""
    t = msg.get("t", {})
    counts = ("bu", "mu", "late", "cap")
    ok = isinstance(t, dict) and all(type(t.get(k, 0)) is int and t.get(k, 0) >= 0
                                     for k in counts)  # fmt: skip
    rej, smp = (t.get("rej", {}), t.get("smp", {})) if ok else (None, None)
    ok = ok and isinstance(rej, dict) and all(type(v) is int and v >= 0 for v in rej.values())
    ok = ok and isinstance(smp, dict) and all(isinstance(v, str) for v in smp.values())
    if not ok:
        raise ShardingError(f"a partial's tally 't' is malformed: {t!r}"[:300])
    return t


def robust_round(strategy: Any) -> tuple[float | None, bool]:
    """(the round's norm bound, whether it holds its updates) of a round's strategy."""
    return getattr(strategy, "bound", None), bool(getattr(strategy, "holding", False))


def round_sample_cap(strategy: Any) -> int | None:
    """The round's relative sample cap (robust ``auto``), fixed when it opened; None: none."""
    cap = getattr(strategy, "sample_cap", None)
    return cap if type(cap) is int else None


def open_sample_cap(msg: dict[str, Any]) -> int | None:
    """An ``open`` message's sample cap ``c``: nil or an int >= 1."""
    cap = msg.get("c")
    if cap is not None and (type(cap) is not int or cap < 1):
        raise ShardingError(f"an open message's sample cap 'c' must be nil or an int >= 1, "
                            f"got {cap!r}")  # fmt: skip
    return cap


#: relative slack of the partial-sum bounds (float32 rounding of a clipped delta, grid rounding)
BOUND_SLACK = 1e-4


def check_partial(core: AggregatorCore, data: Any, devices: list[str]) -> None:
    """ValueError unless a worker's strategy partial holds ``len(devices)`` updates and stays
    within what those updates could sum to: each passed the round's norm bound (robust bound,
    central clip) or the decoder's plausibility bound ``max_abs`` per value, and weighs at most
    its device's declared sample count. Honest partials always pass (their updates passed)."""
    strategy = core.strategy
    max_abs = getattr(core.limits, "max_abs", None)
    caps = [core.devices[d].n_samples if d in core.devices else 0 for d in devices]
    sample_cap = round_sample_cap(strategy)  # a folded update weighs at most this (auto)
    max_samples = getattr(getattr(strategy, "settings", None), "max_samples", None)
    folded_caps = [min([c, *(x for x in (sample_cap, max_samples) if x is not None)]) for c in caps]
    weight_cap = sum(folded_caps) if caps and all(c > 0 for c in caps) else None
    bound, _ = robust_round(strategy)
    inner = getattr(strategy, "inner", strategy)
    central = getattr(getattr(inner, "central", None), "clip_norm", None)
    per_update = central if isinstance(central, int | float) else None
    if isinstance(data, dict) and set(data) == {"i", "h", "n", "s", "k"}:  # norm-bounded
        norms, held, samples = data["n"], data["h"] or [], data["s"]
        if not isinstance(norms, list) or not isinstance(held, list):
            raise ValueError("a robust partial's 'n' and 'h' must be lists")
        if not isinstance(samples, list) or len(samples) != len(norms):
            raise ValueError("a robust partial's 's' must list one sample count per folded norm")
        if getattr(getattr(strategy, "settings", None), "norm_bound", None) is None:
            if norms or held:  # no norm bound: everything goes straight into the inner sums
                raise ValueError("a round without a norm bound folds no norms and holds nothing")
            _check_sums(data["i"], len(devices), per_update, max_abs, weight_cap, len(core.params))
            return
        top = max(folded_caps, default=0)
        for n in samples:
            if type(n) is not int or not 0 < n <= (top if top > 0 else n):
                raise ValueError(f"a folded sample count {n!r} exceeds the round's cap {top}")
        if len(norms) + len(held) != len(devices):
            raise ValueError(f"it holds {len(norms) + len(held)} updates for {len(devices)} "
                             "devices admitted")  # fmt: skip
        limit = math.inf if bound is None else bound * (1 + BOUND_SLACK)
        for x in norms:
            if not isinstance(x, float) or not 0 <= x <= limit:
                raise ValueError(f"a folded norm {x!r} exceeds the round's bound {bound}")
        for item in held:
            _check_held(core, item, max(caps, default=0), max_abs)
        if norms:
            peak = max(norms)
            per_update = peak if per_update is None else min(peak, per_update)
        inner_weight = data["i"].get("w") if isinstance(data["i"], dict) else None
        if type(inner_weight) is int and inner_weight not in (0, sum(samples)):
            raise ValueError(f"its weight {inner_weight} is not the sum of its folded sample "
                             f"counts {sum(samples)}")  # fmt: skip
        _check_sums(data["i"], len(norms), per_update, max_abs, weight_cap, len(core.params))
    else:
        _check_sums(data, len(devices), per_update, max_abs, weight_cap, len(core.params))


def _check_held(core: AggregatorCore, item: Any, cap: int, max_abs: float | None) -> None:
    """A held update (no norm reference yet): plausible values, its stated norm, its weight."""
    from .robust import l2_norm

    ok = isinstance(item, list) and len(item) == 4 and isinstance(item[0], bytes)
    if not ok or len(item[0]) != 4 * len(core.params) or type(item[1]) is not int:
        raise ValueError("a held update is [delta bytes, samples, weight, norm]")
    delta = np.frombuffer(item[0], dtype="<f4")
    if not np.isfinite(delta).all() or (max_abs is not None and np.abs(delta).max() > max_abs):
        raise ValueError("a held delta is not finite or beyond the plausibility bound")
    if item[3] != l2_norm(delta) or not 0 < item[2] <= 1.0 or (cap > 0 and not 0 < item[1] <= cap):
        raise ValueError("a held update's norm, weight or samples are not its own")


def _check_sums(
    data: Any, count: int, per_update: float | None, max_abs: float | None,
    weight_cap: int | None, n_params: int,
) -> None:  # fmt: skip
    """The inner partial: its count, weight and sums against ``count`` updates bounded by
    ``per_update`` in L2 (if known) and ``max_abs`` per value."""
    if not isinstance(data, dict):
        raise ValueError("a partial is a map")
    slack = 1 + BOUND_SLACK
    if set(data) == {"r"} and isinstance(data["r"], bytes):  # every row (trimmed mean)
        if len(data["r"]) % (4 * n_params):
            raise ValueError("a trimmed-mean partial's rows are not whole")
        rows = np.frombuffer(data["r"], dtype="<f4").reshape(-1, n_params).astype(np.float64)
        if rows.shape[0] != count:
            raise ValueError(f"it holds {rows.shape[0]} rows for {count} updates")
        if not np.isfinite(rows).all():
            raise ValueError("a row is not finite")
        if max_abs is not None and rows.size and np.abs(rows).max() > max_abs:
            raise ValueError("a row is beyond the plausibility bound")
        norms = np.sqrt((rows * rows).sum(axis=1)) if rows.size else np.zeros(0)
        if per_update is not None and norms.size and norms.max() > per_update * slack:
            raise ValueError("a row exceeds the round's norm bound")
        return
    keys = set(data)
    if keys not in ({"s", "w", "c"}, {"s", "w", "b"}):
        return  # a strategy this check does not know: its own merge validates it
    if not isinstance(data["s"], bytes) or type(data["w"]) is not int or data["w"] < 0:
        raise ValueError("a partial sum is {s: bytes, w: int >= 0, ...}")
    votes = "b" in keys
    held = len(data["b"]) if votes and isinstance(data["b"], bytes) else data.get("c")
    if held != count:
        raise ValueError(f"it holds {held!r} updates for {count} admitted")
    weight = data["w"]
    if weight_cap is not None and weight > weight_cap:
        raise ValueError(f"its weight {weight} exceeds the {weight_cap} samples its devices "
                         "declared")  # fmt: skip
    total = ExactSum.from_bytes(data["s"], n_params).value()
    if not np.isfinite(total).all():
        raise ValueError("its sum is not finite")
    scale = weight if weight > 0 else count  # central Gaussian sums unweighted (w = 0)
    peak = float(np.abs(total).max()) if total.size else 0.0
    per_value = 1.0 if votes else max_abs  # a vote adds +-n at h indices
    if per_value is not None and peak > scale * per_value * slack + 1e-9:
        raise ValueError(f"a summed value {peak:.4g} exceeds {scale} x the per-update bound")
    if not votes and per_update is not None:
        norm = float(np.linalg.norm(total))
        if norm > scale * per_update * slack + 1e-9:
            raise ValueError(f"its sum's norm {norm:.4g} exceeds {scale} x the round's bound "
                             f"{per_update:.4g}")  # fmt: skip


@dataclass
class FixedReference:
    """A worker's stand-in for the coordinator's norm reference: the round's bound as sent."""

    value: float | None
    hold: bool
    cap: int | None = None  # the round's relative sample cap, as sent
    min_updates: int = 1

    def __len__(self) -> int:
        return 0 if self.hold else self.min_updates

    def bound(self, pending: Any = ()) -> float | None:
        return self.value

    def add(self, norm: float) -> None:  # the coordinator keeps the reference
        pass

    def sample_cap(self, pending: Any = ()) -> int | None:
        """The coordinator's cap: its median of sample counts, which the worker does not see."""
        return self.cap


def _commitments(msg: dict[str, Any]) -> dict[str, bytes]:
    """A ``masked`` control message's ``c``: device -> seed commitment (empty: no device keys)."""
    commitments = msg.get("c") or {}
    if not isinstance(commitments, dict) or not all(
        isinstance(k, str) and isinstance(v, bytes) for k, v in commitments.items()
    ):
        raise ShardingError("a 'masked' message's 'c' maps devices to commitments")
    return commitments


def _identity(msg: dict[str, Any]) -> tuple[Any, ...]:
    """What makes an ``open`` a new one: a re-sent copy has the same (a changed bound or cap
    is a new open of the round)."""
    return (msg.get("g"), msg.get("b"), msg.get("h"), msg.get("c"), msg.get("e"))


#: updates a worker keeps per round to take back (their memory: this many updates' deltas)
RECENT = 256


@dataclass
class Recording:
    """A round's strategy that lists the devices it folded and keeps the most recent updates, so
    a worker can take back what the coordinator leaves out: a duplicate another worker reported
    first, or an answer past the target; both are among the last ones a worker took. An
    exclusion older than the last :data:`RECENT` updates makes the worker's share unreliable
    (reported, and charged as a lost share)."""

    inner: Any
    devices: list[str] = field(default_factory=list)
    recent: deque[tuple[Update, float]] = field(default_factory=lambda: deque(maxlen=RECENT))
    complete: bool = True  # every folded update is still in ``recent``

    def add(self, update: Update, weight: float) -> None:
        self.inner.add(update, weight)
        self.devices.append(update.device)
        if len(self.recent) == self.recent.maxlen:
            self.complete = False
        self.recent.append((update, weight))

    def take_back(self, device: str) -> bool:
        """Remove ``device``'s update from the sums; False if it is no longer kept."""
        for i in range(len(self.recent) - 1, -1, -1):
            update, weight = self.recent[i]
            if update.device == device:
                self.inner.remove(update, weight)
                del self.recent[i]
                self.devices.remove(device)
                return True
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# ------------------------------------------------------------------------------- worker


@dataclass
class CohortShare:
    """A worker's part of one secure FedBuff cohort (several run at once, each keyed by its
    number, the ``r`` of its ``open`` and of every SecAgg+ message of it): its nonce and roster
    from its ``open``, its masked inputs held before its ``masked`` message, its running sum in
    Z_2^b from then on, what it refused, and its partial once committed (sent again if asked
    again). docs/protocol.md, "Ingest workers", "Secure FedBuff cohorts"."""

    number: int
    nonce: bytes
    selected: frozenset[str]
    identity: tuple[Any, ...]  # its ``open``'s (a re-sent copy changes nothing)
    masked: MaskedShare | None = None
    early: list[tuple[str, bytes]] = field(default_factory=list)
    early_held: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    frozen: bool = False
    partial: bytes | None = None


#: masked inputs a worker holds per device before the round's ``masked`` control message
EARLY_PER_DEVICE = 2


class IngestWorker:
    """One worker's share of the ingest: the single aggregator's core on the updates it is dealt,
    with its rounds mirrored from the coordinator's ``open`` messages."""

    def __init__(self, name: str, core: AggregatorCore, key: bytes | None = None) -> None:
        """``key``: this worker's key (:func:`worker_key`); default: derived from this process's
        :func:`run_secret` (a coordinator in the same process, e.g. a test)."""
        self.name = name
        self.core = core
        self.key = key if key is not None else worker_key(run_secret(), name)
        self.job = core.settings.job
        self._clock = Clock()
        self._last_q = 0  # the newest control message's sequence: an older one is a replay
        self._reset_pending = False  # an empty control message came (a new run, or a forgery)
        # the coordinator keeps the ledger (a worker lists releases) and judges updates naming
        # rounds from before this worker started
        core.configure_as_worker()
        self.frozen: int | None = None  # the round frozen and awaiting its commit
        self._last_partial: tuple[int, bytes] | None = None  # re-sent if asked again
        self._opened: tuple[Any, ...] | None = None  # (g, b, h, c, e) of the round mirrored
        self._reopened = False  # the mirrored round was opened again (re-folded)
        #: progress messages carry (instance, sequence): a re-delivered copy changes nothing
        self._instance, self._seq = os.urandom(8), 0
        self._reported = 0  # releases already sent in a progress message
        self._accepted: list[str] = []  # since the last progress
        self._refused: list[str] = []
        self._deferred: list[list[Any]] = []
        # secure rounds (docs/protocol.md, "Ingest workers"): SecAgg+ messages other than
        # masked inputs go to the coordinator's session; masked inputs are summed here
        self._forward: list[list[Any]] = []  # [device, payload] since the last progress
        self._summed: list[str] = []  # masked inputs summed since the last progress
        self.masked: MaskedShare | None = None  # the mirrored round's share of its masked phase
        self._masked_round: int | None = None
        self._early: list[tuple[str, bytes]] = []  # masked inputs before the round's ``masked``
        self._early_held: Counter[str] = Counter()  # of those, by device
        self.secure_rejected: Counter[str] = Counter()  # masked inputs refused (this round)
        # secure FedBuff cohorts (``core.cohorts`` set): one share per cohort in flight
        self.cohorts: dict[int, CohortShare] = {}
        self._cohort_summed: list[list[Any]] = []  # [cohort, device] summed since the last progress
        self._stray: Counter[str] = Counter()  # refused masked inputs of no cohort held here
        self._epoch: Any = None  # the ``e`` of the last cohort ``open`` taken

    def on_update(self, device: str, payload: bytes) -> Reject | None:
        core = self.core
        if core.secure is not None and up_kind(payload) is not None:
            self.on_secure(device, payload)
            return None
        refused = len(core.refused)
        reason = core.on_update(device, payload)
        if reason is None:
            self._accepted.append(device)
        elif reason == DEFERRED and core.last_deferred is not None:
            self._deferred.append(list(core.last_deferred))
        elif len(core.refused) > refused:  # answered, but refused (norm bound): need not wait
            self._refused.append(device)
        return reason

    def on_secure(self, device: str, payload: bytes) -> None:
        """A SecAgg+ message on ``up/<device>``. ``ak``, ``sh``, ``ua``: handed to the
        coordinator as they are (its session judges them). ``mx``: charged as the single
        aggregator charges it (it names a round that selected the device, with its nonce),
        then checked and summed into the round's :class:`MaskedShare`; one that comes before
        the coordinator's ``masked`` message is kept until it comes."""
        if up_kind(payload) != "mx":
            self._forward.append([device, bytes(payload)])
            return
        core = self.core
        core.tally.bytes_up += len(payload)
        core.tally.messages_up += 1
        head = masked_head(payload)
        if head is None:
            self.secure_rejected["malformed"] += 1
            return
        rnd, nonce = head
        if core.cohorts is not None:
            self._cohort_masked(device, payload, rnd, nonce)
            return
        facts = core.round_facts(rnd)
        if facts is not None and facts[0] == nonce and device in facts[1]:
            core.charge_secure(device, rnd, payload)  # listed in the next progress (``rel``)
        current = core.current
        if current is None or current.number != rnd:
            self.secure_rejected["late"] += 1  # a closed round's (charged above), or unknown
        elif self.masked is None or self._masked_round != rnd:
            # held until ``masked`` comes: at most two copies a selected device (its input and
            # one re-send), so no device's copies can crowd out another's
            held = self._early_held
            if device in current.selected and held[device] < EARLY_PER_DEVICE:
                held[device] += 1
                self._early.append((device, bytes(payload)))
            else:
                self.secure_rejected["wrong_phase"] += 1
        else:
            self._sum_masked(device, payload)

    def _cohort_masked(self, device: str, payload: bytes, rnd: int, nonce: bytes) -> None:
        """A secure FedBuff job's ``mx``, routed by its ``r`` to the cohort of that number:
        charged if the cohort selected the device and the nonce is the cohort's (as a single
        aggregator charges it), then held (before the cohort's ``masked``), summed into the
        cohort's share, or refused with the sync round's reason (``late``: the cohort is
        frozen or committed here; ``wrong_phase``: before ``masked``, beyond what is held;
        ``wrong_nonce``, ``bad_masked``, ...: the share's check). One naming a cohort this
        worker does not hold (it joined later, or no such cohort) is ``late`` here and handed
        to the coordinator (``sa``), which charges it if it names a cohort that selected the
        device, with its nonce, and sums it nowhere."""
        share = self.cohorts.get(rnd)
        if share is None:
            self._stray["late"] += 1
            self._forward.append([device, bytes(payload)])
            return
        if share.nonce == nonce and device in share.selected:
            self.core.charge_secure(device, rnd, payload)  # listed in the next progress
        if share.partial is not None:
            self._stray["late"] += 1  # its record is written: counted with the next partial
        elif share.frozen:
            share.rejected["late"] += 1
        elif share.masked is None:
            # held until ``masked`` comes: at most two copies a selected device
            if device in share.selected and share.early_held[device] < EARLY_PER_DEVICE:
                share.early_held[device] += 1
                share.early.append((device, bytes(payload)))
            else:
                share.rejected["wrong_phase"] += 1
        else:
            self._sum_cohort(share, device, payload)

    def _sum_cohort(self, share: CohortShare, device: str, payload: bytes) -> None:
        assert share.masked is not None
        rejected = share.masked.receive(device, payload)
        if rejected is None:
            self._cohort_summed.append([share.number, device])
        else:
            share.rejected[rejected.reason] += 1
            log.info("cohort %s: masked input of %r refused (%s): %s", share.number, device,
                     rejected.reason, rejected.detail)  # fmt: skip

    def _sum_masked(self, device: str, payload: bytes) -> None:
        assert self.masked is not None
        rejected = self.masked.receive(device, payload)
        if rejected is None:
            self._summed.append(device)
        else:
            self.secure_rejected[rejected.reason] += 1
            log.info("round %s: masked input of %r refused (%s): %s", self._masked_round, device,
                     rejected.reason, rejected.detail)  # fmt: skip

    def _open_masked(self, msg: dict[str, Any], rnd: int) -> None:
        """The coordinator's round entered its masked phase: U2 (``u``) and, with device keys,
        their seed commitments (``c``): this worker checks and sums the masked inputs it is
        dealt from now on (and those that came before this message)."""
        core, plan = self.core, self.core.secure
        if plan is None:
            raise ShardingError("a 'masked' control message for a job without secure rounds")
        if self._masked_round == rnd:
            return  # a re-sent copy
        forwarded = _names(msg, "u")
        commitments = _commitments(msg)
        current, facts = core.current, core.round_facts(rnd)
        if current is None or current.number != rnd or facts is None or facts[0] is None:
            log.warning("masked phase of round %d: not the round mirrored here", rnd)
            return
        if plan.device_key is not None:
            core.keep_commitments(rnd, dict(commitments))  # charges check signatures
        params = plan.params(self.job, rnd, facts[0], tuple(current.selected))
        self.masked = MaskedShare(params, forwarded, commitments, plan.device_key)
        self._masked_round = rnd
        early, self._early = self._early, []
        self._early_held.clear()
        for device, payload in early:
            if masked_head(payload) == (rnd, facts[0]):
                self._sum_masked(device, payload)

    def on_status(self, device: str, payload: bytes) -> None:
        self.core.on_status(device, payload)

    def progress(self, final: bool = False, rnd: int | None = None) -> bytes | None:
        """What was admitted since the last call, every release seen since (late answers to
        earlier rounds too: they reach the ledger at once, whatever becomes of this worker), and
        the updates left to the coordinator to judge. None if nothing, unless ``final``."""
        core = self.core
        releases = [[d, int(r), int(n)] for d, r, n in core.releases[self._reported :]]
        secure = self._forward or self._summed or self._cohort_summed
        if not (self._accepted or self._refused or releases or self._deferred or final
                or secure):  # fmt: skip
            return None
        if rnd is None:
            rnd = self.frozen if final and self.frozen is not None else core.round_number
        self._seq += 1
        extra: dict[str, Any] = {}
        if secure and core.cohorts is not None:  # cohorts: each summed input names its cohort
            extra = {"sa": self._forward, "cx": self._cohort_summed}
        elif secure:
            extra = {"sa": self._forward, "sx": self._summed}
        out = self._seal("progress", w=self.name, r=rnd, a=self._accepted, f=self._refused,
                         z=final, rel=releases, d=self._deferred, **extra, i=self._instance,
                         s=self._seq)  # fmt: skip
        self._reported = len(core.releases)
        self._accepted, self._refused, self._deferred = [], [], []
        self._forward, self._summed, self._cohort_summed = [], [], []
        return out

    def _seal(self, kind: str, **fields: Any) -> bytes:
        return seal(self.key, self.job, kind, **fields)

    def connection_liveness(self) -> tuple[bytes, bytes]:
        """(online, offline) for one connection: its retained liveness and its last will. The
        offline one is newer than the online one, and both older than the next connection's, so
        the coordinator takes them in order and refuses a replay of an earlier connection's."""
        at = self._clock(2)
        self._clock(2)
        return (
            self._seal("live", w=self.name, on=True, i=self._instance, s=at),
            self._seal("live", w=self.name, on=False, i=self._instance, s=at + 1),
        )

    def verify_control(self, payload: bytes) -> dict[str, Any]:
        """A coordinator message, checked: kind, seal (this worker's MAC) and freshness (a
        re-sent copy of the open round's ``open`` passes; any other older message is a
        replay). ShardingError if it is not the coordinator's."""
        msg = unpack(payload, ("open", "masked", "freeze", "commit", "end"))
        verify(payload, msg, self.key, self.job, self.name)
        q = msg.get("q")
        if type(q) is not int:
            raise ShardingError("a control message carries its sequence 'q'")
        if q < self._last_q and not (msg["k"] == "open" and self._same_open(msg)):
            raise ShardingError(f"control message {msg['k']!r} older than the last one: a replay")
        self._last_q = max(self._last_q, q)
        return msg

    def _same_open(self, msg: dict[str, Any]) -> bool:
        identity = _identity(msg)
        return identity == self._opened or any(
            c.identity == identity for c in self.cohorts.values()
        )

    def on_control(self, payload: bytes) -> list[tuple[str, bytes]]:
        """Check and apply a coordinator message; returns (kind, payload) messages to publish."""
        return self.apply_control(self.verify_control(payload))

    def apply_control(self, msg: dict[str, Any]) -> list[tuple[str, bytes]]:
        """Apply a message :meth:`verify_control` passed (``end`` is the service's to act on)."""
        rnd = _int(msg, "r")
        if msg["k"] == "end":
            return []
        if self.core.cohorts is not None:
            return self._cohort_control(msg, rnd)
        if msg["k"] == "open":
            self._open(msg, rnd)
            return []
        if msg["k"] == "masked":
            self._open_masked(msg, rnd)
            return []
        if msg["k"] == "freeze":
            return self._freeze(rnd)
        return self._commit(rnd, msg)

    def reset(self) -> None:
        """The retained control message was cleared: a new run of the job starts, or anyone
        who can publish there cleared it (the payload is empty: nothing to authenticate). So
        nothing is forgotten now: the next verified ``open`` forgets the earlier run's rounds
        if it comes from another coordinator process (a new epoch), else the clear was not the
        coordinator's and the round goes on."""
        self._reset_pending = True

    def _forget(self) -> None:
        """A new run of the job: rounds of the earlier run mean nothing now (their numbers come
        again)."""
        self._reset_pending = False
        self.core.forget()
        self.frozen, self._opened, self._last_partial, self._reopened = None, None, None, False
        self._reported = 0
        self._accepted, self._refused, self._deferred = [], [], []
        self._forward, self._summed = [], []
        self._drop_masked()
        self.cohorts, self._cohort_summed, self._stray = {}, [], Counter()

    def _drop_masked(self) -> None:
        self.masked, self._masked_round, self._early = None, None, []
        self._early_held.clear()
        self.secure_rejected = Counter()

    def _open(self, msg: dict[str, Any], rnd: int) -> None:
        core = self.core
        identity = _identity(msg)
        if identity == self._opened:
            return  # a re-sent open (a coordinator reconnect), mirrored, frozen or committed
        if self._reset_pending:
            epoch = self._opened[4] if self._opened is not None else None  # its e
            if self._opened is not None and msg.get("e") != epoch:
                self._forget()  # a new coordinator process after a clear: a new run
            self._reset_pending = False
        refold, lost = self._mirrored_updates(rnd)  # the same round, opened again
        blob = msg.get("g")
        g = decode_global(blob if isinstance(blob, bytes) else b"")
        if g.round != rnd or g.selected is None:
            raise ShardingError("an open message carries its round's global message with a "
                                "selection (Poisson self-selection is not sharded)")  # fmt: skip
        if core.current is not None:  # a round we never saw frozen: it is over
            self._retire()
        if self._masked_round != rnd:
            self._drop_masked()  # a secure round's share ends with its round
        bound, hold, cap = msg.get("b"), msg.get("h") is True, open_sample_cap(msg)
        mechanism = core.mechanism
        if getattr(mechanism, "reference", None) is not None:
            mechanism.reference = FixedReference(bound, hold, cap)  # type: ignore[attr-defined]
        core.mirror(g, Recording)
        recording = self._recording()
        assert recording is not None and core.current is not None  # mirrored just now
        self._opened = identity
        self._reopened = bool(refold) or lost
        self._last_partial = None  # a new round (or the same one opened anew by a restart)
        self.frozen = None
        if lost:
            recording.complete = False
        # a restarted coordinator knows nothing of them: they are reported again
        self._accepted = []
        for update, weight in refold:
            try:
                recording.add(update, weight)
                core.current.accept(update.device)
                self._accepted.append(update.device)
            except ValueError as exc:  # e.g. over the new round's norm bound
                log.warning("update of %s dropped on the round's re-open: %s", update.device, exc)

    def _mirrored_updates(self, rnd: int) -> tuple[list[tuple[Update, float]], bool]:
        """What this worker folded of round ``rnd`` if it is the one mirrored now, and whether
        some of it is no longer kept (its share of the round is then unreliable)."""
        core = self.core
        strategy = self._recording()
        if strategy is None or core.round_number != rnd or self._opened is None:
            return [], False  # nothing of it here (committed already, or never mirrored)
        log.warning("round %d opened again (a restarted coordinator): re-folding the %d "
                    "updates taken so far and reporting them again", rnd,
                    len(strategy.devices))  # fmt: skip
        return list(strategy.recent), not strategy.complete

    def _recording(self) -> Recording | None:
        """The mirrored round's strategy, which :meth:`_open` had ``core.mirror`` wrap in a
        :class:`Recording` (None between rounds)."""
        strategy = self.core.strategy
        assert strategy is None or isinstance(strategy, Recording)
        return strategy

    def _retire(self) -> None:
        self.core.retire()

    def _freeze(self, rnd: int) -> list[tuple[str, bytes]]:
        core = self.core
        if self._last_partial is not None and self._last_partial[0] == rnd:
            final = self.progress(final=True, rnd=rnd)  # asked again: committed already
            assert final is not None
            return [("progress", final)]
        if core.current is not None and core.current.number == rnd:
            self._retire()  # from now on its answers are late (and still charged)
            self.frozen = rnd
        elif self.frozen != rnd:
            self.frozen = rnd  # nothing of it here (started later): an empty share
            core.strategy = None
        final = self.progress(final=True)
        assert final is not None
        return [("progress", final)]

    def _commit(self, rnd: int, msg: dict[str, Any]) -> list[tuple[str, bytes]]:
        core = self.core
        if self.frozen != rnd and self._last_partial is not None and self._last_partial[0] == rnd:
            return [("partial", self._last_partial[1])]  # asked again (a re-run collection)
        if self.frozen != rnd:
            raise ShardingError(f"commit of round {rnd}, but round {self.frozen} is frozen here")
        left_out = set(_names(msg.get("x", {}), self.name) if isinstance(msg.get("x"), dict)
                       else ())  # fmt: skip
        if core.secure is not None:
            return self._commit_masked(rnd, left_out)
        strategy = self._recording()
        if strategy is None:  # this worker never mirrored the round: nothing folded
            partial = self._partial(rnd, None, [], None)
            self.frozen = None
            self._last_partial = (rnd, partial)
            return [("partial", partial)]
        unkept = [d for d in sorted(left_out) if not strategy.take_back(d)]
        lost = None
        if unkept or (not strategy.complete and self._reopened):
            lost = (
                f"cannot take back {unkept} (not among the last {RECENT} updates kept)"
                if unkept
                else "the round was re-opened after more updates than were kept"
            )
            log.error("round %d: this worker's share is unreliable: %s", rnd, lost)
        partial = self._partial(rnd, None if lost else strategy.partial(), strategy.devices, lost)
        core.strategy, self.frozen, self._reopened = None, None, False
        self._last_partial = (rnd, partial)
        return [("partial", partial)]

    def _commit_masked(self, rnd: int, left_out: set[str]) -> list[tuple[str, bytes]]:
        """A secure round's partial: the sum in Z_2^b (``s``: ``{"y": the ring's bytes as in
        an ``mx``, "b": bits}``, nil if this worker summed nothing) of the masked inputs it
        summed (``a``), what it must leave out taken back first; ``j``: what it refused."""
        share = self.masked if self._masked_round == rnd else None
        lost = None
        if share is not None:
            unkept = [d for d in sorted(left_out) if not share.take_back(d)]
            if unkept:
                lost = f"cannot take back {unkept} (not among the last masked inputs kept)"
                log.error("round %d: this worker's share is unreliable: %s", rnd, lost)
        summed = None
        if share is not None and share.devices and lost is None:
            summed = {"y": ring_pack(share.sum, share.params.bits), "b": share.params.bits}
        devices = list(share.devices) if share is not None else []
        rejected = dict(sorted(self.secure_rejected.items()))
        partial = self._partial(rnd, summed, devices, lost, j=rejected)
        self.core.strategy, self.frozen, self._reopened = None, None, False
        self._drop_masked()
        self._last_partial = (rnd, partial)
        return [("partial", partial)]

    # ---------------------------------------------------------- secure FedBuff cohorts

    def _cohort_control(self, msg: dict[str, Any], rnd: int) -> list[tuple[str, bytes]]:
        """A control message of a secure FedBuff job: ``r`` names a cohort."""
        kind = msg["k"]
        if kind == "open":
            self._open_cohort(msg, rnd)
            return []
        if kind == "masked":
            self._cohort_masked_phase(msg, rnd)
            return []
        if kind == "freeze":
            share = self.cohorts.get(rnd)
            if share is not None:
                share.frozen = True  # from now on its masked inputs are late (still charged)
            final = self.progress(final=True, rnd=rnd)
            assert final is not None
            return [("progress", final)]
        return self._commit_cohort(rnd, msg)

    def _open_cohort(self, msg: dict[str, Any], rnd: int) -> None:
        """A cohort dispatched: its nonce and roster (its masked inputs are charged against
        them), and ``o``, the cohorts still open at the coordinator: a cohort held here and
        not listed ended without asking for this worker's share (failed, or stopped), so what
        it summed is dropped."""
        identity = _identity(msg)
        held = self.cohorts.get(rnd)
        if held is not None and held.identity == identity:
            return  # a re-sent open (a coordinator reconnect)
        if self._reset_pending:
            if self._epoch is not None and msg.get("e") != self._epoch:
                self._forget()  # a new coordinator process after a clear: a new run
            self._reset_pending = False
        still = msg.get("o", [])
        if not isinstance(still, list) or not all(type(n) is int for n in still):
            raise ShardingError("a cohort open's 'o' lists the open cohorts' numbers")
        blob = msg.get("g")
        g = decode_global(blob if isinstance(blob, bytes) else b"")
        if g.round != rnd or g.selected is None or g.nonce is None or g.mode != "fedbuff":
            raise ShardingError("a cohort's open message carries its global message (mode "
                                "fedbuff, its number as round, a selection, a nonce)")  # fmt: skip
        for number in [n for n in self.cohorts if n not in still and n != rnd]:
            del self.cohorts[number]
        share = CohortShare(rnd, g.nonce, frozenset(g.selected), identity)
        self.cohorts[rnd] = share
        cohorts = self.core.cohorts
        assert cohorts is not None
        cohorts.remember(share)  # its facts: a late masked input for it is still charged
        self._epoch = msg.get("e")

    def _cohort_masked_phase(self, msg: dict[str, Any], rnd: int) -> None:
        """The cohort entered its masked phase: U2 and (device keys) its commitments; this
        worker checks and sums the cohort's masked inputs from now on (and those it held)."""
        plan = self.core.secure
        assert plan is not None  # a cohort job is a secure job
        share = self.cohorts.get(rnd)
        if share is None:
            log.warning("masked phase of cohort %d: not a cohort held here", rnd)
            return
        if share.masked is not None:
            return  # a re-sent copy
        forwarded = _names(msg, "u")
        commitments = _commitments(msg)
        if plan.device_key is not None:
            self.core.keep_commitments(rnd, dict(commitments))  # charges check signatures
        params = plan.params(self.job, rnd, share.nonce, tuple(share.selected))
        share.masked = MaskedShare(params, forwarded, commitments, plan.device_key)
        early, share.early = share.early, []
        share.early_held.clear()
        for device, payload in early:
            self._sum_cohort(share, device, payload)

    def _commit_cohort(self, rnd: int, msg: dict[str, Any]) -> list[tuple[str, bytes]]:
        """A cohort's partial, as a sync round's (:meth:`_commit_masked`): its sum in Z_2^b,
        its devices, what it refused (``j``, with the refusals of no cohort held here since
        the last partial); empty for a cohort this worker does not hold."""
        share = self.cohorts.get(rnd)
        if share is not None and share.partial is not None:
            return [("partial", share.partial)]  # asked again
        left_out = set(_names(msg.get("x", {}), self.name) if isinstance(msg.get("x"), dict)
                       else ())  # fmt: skip
        masked = share.masked if share is not None else None
        lost, summed, devices = None, None, []
        if masked is not None:
            unkept = [d for d in sorted(left_out) if not masked.take_back(d)]
            if unkept:
                lost = f"cannot take back {unkept} (not among the last masked inputs kept)"
                log.error("cohort %d: this worker's share is unreliable: %s", rnd, lost)
            if masked.devices and lost is None:
                summed = {"y": ring_pack(masked.sum, masked.params.bits), "b": masked.params.bits}
            devices = list(masked.devices)
        rejected = Counter(self._stray)
        if share is not None:
            rejected.update(share.rejected)
        self._stray = Counter()
        partial = self._partial(rnd, summed, devices, lost, j=dict(sorted(rejected.items())))
        if share is not None:
            share.partial, share.masked, share.frozen = partial, None, True
            share.early, share.rejected = [], Counter()
        return [("partial", partial)]

    def _partial(
        self, rnd: int, strategy: dict[str, Any] | None, devices: list[str], lost: str | None,
        **more: Any,
    ) -> bytes:  # fmt: skip
        t = self.core.take_tally()
        tally = {
            "bu": t.bytes_up,
            "mu": t.messages_up,
            "late": t.late,
            "rej": {str(k): v for k, v in t.rejected.items()},
            "cap": t.capped_samples,
            "smp": dict(t.samples),
        }
        fields: dict[str, Any] = {"s": strategy, "a": devices, "t": tally, **more}
        if lost is not None:
            fields["lost"] = lost  # the coordinator treats the share as lost (and charges)
        return self._seal("partial", w=self.name, r=rnd, i=self._instance, **fields)


# ------------------------------------------------------------------------------- coordinator


@dataclass
class ShardedRound:
    """The coordinator's view of the open round across its workers."""

    number: int
    workers: set[str]  # whose share the round has (and waits for)
    lost: set[str] = field(default_factory=set)  # went offline during the round: share lost
    owner: dict[str, str] = field(default_factory=dict)  # device -> worker whose copy counts
    left_out: dict[str, list[tuple[str, Reject]]] = field(default_factory=dict)
    frozen: set[str] = field(default_factory=set)
    partials: dict[str, dict[str, Any]] = field(default_factory=dict)
    collecting: bool = False  # freeze sent: a worker coming online now has no share of it
    masked: bool = False  # a secure round: its ``masked`` control message went out
    #: hash partition: offline when the round opened (its devices' messages reach no one)
    absent: set[str] = field(default_factory=set)

    def unfrozen(self) -> set[str]:
        return self.workers - self.frozen - self.lost

    def unmerged(self) -> set[str]:
        return self.workers - set(self.partials) - self.lost


class Coordinator:
    """The coordinator's half: admits what workers report, asks for and merges their partials."""

    def __init__(
        self, core: AggregatorCore, workers: list[str], dealt: bool = True,
        secret: bytes | None = None,
    ) -> None:  # fmt: skip
        """``dealt``: the broker deals updates among the subscribed workers (shared
        subscription), so a worker that is offline has no share; else (hash partition) every
        worker owns its devices and an offline one loses their updates. ``secret``: whence the
        workers' keys (default: :func:`run_secret`)."""
        self.core = core
        self.workers = frozenset(workers)
        secret = secret if secret is not None else run_secret()
        self.keys = {w: worker_key(secret, w) for w in sorted(self.workers)}
        self.job = core.settings.job
        self._clock = Clock()
        #: refused ingest messages by kind (never applied); ``ingest_refused`` in the records
        self.refused: Counter[str] = Counter()
        self._refused_reported = 0  # the total when the last record was made
        self._live_seq: dict[str, int] = {}  # worker -> newest liveness sequence taken
        self._instance: dict[str, bytes] = {}  # worker -> the process its liveness announced
        self.dealt = dealt
        self.online: set[str] = set()
        self.round: ShardedRound | None = None
        #: in every open: a worker that outlived an earlier coordinator process tells a round it
        #: mirrored from the same round re-opened by this one (same global message, resumed)
        self.epoch = os.urandom(8)
        self._progress_seen: dict[str, tuple[bytes, int]] = {}  # worker -> (instance, seq)
        #: SecAgg+ messages the workers handed over, for the service to pass to the round's
        #: session (:meth:`take_secure`)
        self.secure_in: list[tuple[str, bytes]] = []
        self._secure_info: dict[str, Any] = {}  # the merged secure round's record fields
        self._cohort_info: dict[int, dict[str, Any]] = {}  # merged cohorts' record fields
        #: the open round was rebuilt by a resumed coordinator: whatever its earlier workers
        #: held of it is gone (they die with the process that started them), so its merge
        #: charges every selected device as for a lost share
        self.lost_before_resume = False
        #: secure FedBuff: one sharded round per cohort in flight, by cohort number (sync
        #: rounds use :attr:`round`)
        self.cohort_rounds: dict[int, ShardedRound] = {}

    def worker_online(self, worker: str) -> None:
        if worker not in self.workers:
            return
        self.online.add(worker)
        sr = self.round
        if self.cohort_rounds:  # it mirrors the newest cohort only (the retained open)
            sr = self.cohort_rounds[max(self.cohort_rounds)]
        if sr is not None and self.dealt and not sr.collecting:
            sr.workers.add(worker)  # it mirrors the round from the retained open

    def worker_offline(self, worker: str) -> None:
        self.online.discard(worker)
        for sr in [self.round, *self.cohort_rounds.values()]:
            if sr is not None and worker in sr.workers:
                sr.lost.add(worker)  # what it folded and what was dealt to it is gone

    def open_message(self, global_payload: bytes) -> bytes:
        """The ``open`` control message of the core's just-opened round."""
        core = self.core
        assert core.current is not None
        bound, hold = robust_round(core.strategy)
        workers = set(self.workers & self.online) if self.dealt else set(self.workers)
        self.round = ShardedRound(core.current.number, workers)
        if not self.dealt:  # an offline worker's devices go unseen: its share is lost already
            self.round.lost = workers - self.online
            self.round.absent = set(self.round.lost)
        return self._control("open", r=core.current.number, g=global_payload, b=bound, h=hold,
                             c=round_sample_cap(core.strategy), e=self.epoch)  # fmt: skip

    def _control(self, kind: str, **fields: Any) -> bytes:
        """A control message sealed for every worker (one MAC each), with a rising ``q``."""
        return seal(self.keys, self.job, kind, **fields, q=self._clock())

    def freeze_message(self) -> bytes:
        assert self.round is not None
        self.round.collecting = True
        return self._control("freeze", r=self.round.number)

    def commit_message(self) -> bytes:
        assert self.round is not None
        left_out = {w: [d for d, _ in items] for w, items in self.round.left_out.items()}
        return self._control("commit", r=self.round.number, x=left_out)

    def end_message(self) -> bytes:
        """The job ended: the workers leave (retained: one that starts later learns it too)."""
        return self._control("end", r=0)

    # ---------------------------------------------------------------- from the workers

    def on_message(self, kind: str, worker: str, payload: bytes) -> None:
        """A message on ``ingest/<kind>/<worker>``: the worker is the topic's. Never raises: a
        message refused changes nothing, is counted and logged (one line)."""
        try:
            if kind == "progress":
                self.on_progress(payload, worker)
            elif kind == "partial":
                self.on_partial(payload, worker)
            elif kind == "worker":
                self.on_liveness(worker, payload)
            else:
                raise ShardingError(f"no ingest message kind {kind!r}")
        except ShardingError as exc:
            self.refuse(kind, worker, str(exc))

    def refuse(self, kind: str, worker: str, why: str) -> None:
        self.refused[kind] += 1
        log.error("ingest %s on the topic of worker %r refused: %s", kind, worker, why[:300])

    def _refusals(self) -> dict[str, int]:
        """``ingest_refused``: ingest messages refused since the last record (only if any, so
        an undisturbed run's records are what they were)."""
        total = sum(self.refused.values())
        count, self._refused_reported = total - self._refused_reported, total
        return {"ingest_refused": count} if count else {}

    def _sealed(self, payload: bytes, kinds: tuple[str, ...], topic_worker: str | None
                ) -> tuple[dict[str, Any], str]:  # fmt: skip
        """A worker's message, its fields checked, then its seal with the key of the worker
        its topic names (or, without a topic, its ``w``), which it must name itself."""
        msg = unpack(payload, kinds)
        worker = _name(msg, "w")
        if topic_worker is not None and worker != topic_worker:
            raise ShardingError(f"it names worker {worker!r} on the topic of {topic_worker!r}")
        key = self.keys.get(worker)
        if key is None:
            raise ShardingError(f"{worker!r} is not a worker of this job")
        return msg, worker

    def _check_seal(self, payload: bytes, msg: dict[str, Any], worker: str) -> None:
        verify(payload, msg, self.keys[worker], self.job, "")
        instance = self._instance.get(worker)
        if instance is not None and msg.get("i") != instance:
            raise ShardingError("from another process than the worker's latest liveness")

    def on_liveness(self, worker: str, payload: bytes) -> None:
        """``ingest/worker/<w>``: sealed ``live`` messages, taken in the order of their ``s``
        (an older one is a replay). Empty: cleared at the job's end, nothing to do."""
        if not payload:
            return
        msg, worker = self._sealed(payload, ("live",), worker)
        verify(payload, msg, self.keys[worker], self.job, "")
        seq, on, instance = msg.get("s"), msg.get("on"), msg.get("i")
        if type(seq) is not int or not isinstance(on, bool) or not isinstance(instance, bytes):
            raise ShardingError("a liveness message is {w, on: bool, i: bytes, s: int}")
        if seq <= self._live_seq.get(worker, -1):
            raise ShardingError("liveness older than the last one taken: a replay")
        self._live_seq[worker] = seq
        if on:
            self._instance[worker] = instance
            self.worker_online(worker)
        else:
            if worker in self.online:
                log.error("ingest worker %s went offline", worker)
            self.worker_offline(worker)

    def on_progress(self, payload: bytes, topic_worker: str | None = None) -> None:
        """A worker's burst: its releases go to the ledger at once (any round, also when its
        share is later lost), the updates it could not judge are judged here, and the devices
        it accepted are admitted to the open round in the order the coordinator learns of them.
        ShardingError (nothing applied) unless sealed by the worker its topic names."""
        msg, worker = self._sealed(payload, ("progress",), topic_worker)
        rnd = _int(msg, "r")
        accepted, refused = _names(msg, "a"), _names(msg, "f")
        releases, deferred = _releases(msg), _deferred(msg)
        forwarded, summed = _forwarded(msg), _names(msg, "sx")
        cohort_summed = _cohort_pairs(msg)
        self._check_seal(payload, msg, worker)
        instance, seq = msg.get("i"), msg.get("s")
        if isinstance(instance, bytes) and type(seq) is int:
            seen = self._progress_seen.get(worker)
            if seen is not None and seen[0] == instance and seq <= seen[1]:
                return  # a re-delivered copy (QoS 1 is at least once)
            self._progress_seen[worker] = (instance, seq)
        core = self.core
        bad = []
        secure = core.secure is not None
        for device, r, n in releases:
            facts = core.round_facts(r)
            masked = secure and n == SECURE_RELEASE  # a masked input (secure events)
            if facts is None or device not in facts[1] or (n < 1 and not masked):
                bad.append([device, r, n])  # not a release the coordinator asked for
            elif not core.is_released(device, r):
                core.record_release(device, r, n if masked else core.samples_cap(device, n))
        if bad:
            self.refuse("release", worker, f"{len(bad)} entries name no (round, selected "
                        f"device) the coordinator issued, e.g. {bad[0]}")  # fmt: skip
        for device, r, base, n, nonce in deferred:
            core.judge_deferred(device, r, base, n, nonce)
        if forwarded and not secure:
            self.refuse("progress", worker, "SecAgg+ messages in a job without secure rounds")
        elif forwarded:  # the round's session judges them (round, nonce, phase, sender)
            self.secure_in.extend((device, data) for device, data in forwarded)
        if core.cohorts is not None:
            self._cohort_progress(worker, rnd, cohort_summed, msg.get("z") is True)
            return
        sr = self.round
        if sr is None or rnd != sr.number or worker not in sr.workers or worker in sr.lost:
            return  # a round already merged, or a share already counted as lost
        current = core.current
        for device in accepted:
            if current is not None and device not in current.selected:
                log.error("round %d: worker %r reports an update of %r, who was not selected",
                          sr.number, worker, device)  # fmt: skip
                sr.left_out.setdefault(worker, []).append((device, Reject.NOT_SELECTED))
            elif device in sr.owner:
                sr.left_out.setdefault(worker, []).append((device, Reject.DUPLICATE))
            elif current is None or current.count >= current.target:
                sr.left_out.setdefault(worker, []).append((device, Reject.LATE))
            else:
                sr.owner[device] = worker
                current.accept(device)
        for device in summed:  # masked inputs summed (a secure round's masked phase)
            if current is None or device not in current.selected or not sr.masked:
                log.error("round %d: worker %r reports a masked input of %r, which the round "
                          "does not wait for", sr.number, worker, device)  # fmt: skip
                sr.left_out.setdefault(worker, []).append((device, Reject.NOT_SELECTED))
            elif device in sr.owner:  # a copy another worker reported first
                sr.left_out.setdefault(worker, []).append((device, Reject.DUPLICATE))
            else:
                sr.owner[device] = worker
        if current is not None:  # only the round's own devices can have answered it
            core.refused.update(d for d in refused if d in current.selected)
        if msg.get("z") is True:
            sr.frozen.add(worker)

    def _cohort_progress(self, worker: str, rnd: int, summed: list[list[Any]], final: bool
                         ) -> None:  # fmt: skip
        """A progress of a secure FedBuff job: each masked input summed names its cohort; the
        first worker to report a device's input for a cohort owns it (a copy another worker
        reports is left out with ``commit``'s ``x``, as in a sync round)."""
        for number, device in summed:
            cr = self.cohort_rounds.get(number)
            if cr is None or worker not in cr.workers or worker in cr.lost:
                continue  # a cohort already merged, or a share already counted as lost
            facts = self.core.round_facts(number)
            if facts is None or device not in facts[1] or not cr.masked:
                log.error("cohort %d: worker %r reports a masked input of %r, which the cohort "
                          "does not wait for", number, worker, device)  # fmt: skip
                cr.left_out.setdefault(worker, []).append((device, Reject.NOT_SELECTED))
            elif device in cr.owner:
                cr.left_out.setdefault(worker, []).append((device, Reject.DUPLICATE))
            else:
                cr.owner[device] = worker
        cr = self.cohort_rounds.get(rnd)
        if final and cr is not None and worker in cr.workers:
            cr.frozen.add(worker)

    def on_partial(self, payload: bytes, topic_worker: str | None = None) -> None:
        msg, worker = self._sealed(payload, ("partial",), topic_worker)
        rnd = _int(msg, "r")
        self._check_seal(payload, msg, worker)
        sr = self.round if self.core.cohorts is None else self.cohort_rounds.get(rnd)
        if sr is None or rnd != sr.number or worker not in sr.workers:
            log.warning("partial of worker %r for round %r ignored (not awaited)", worker, rnd)
            return
        sr.partials.setdefault(worker, msg)  # a re-sent copy (a re-run collection) changes nothing

    # ---------------------------------------------------------------- secure rounds

    def take_secure(self) -> list[tuple[str, bytes]]:
        """The SecAgg+ messages workers handed over since the last call (in arrival order)."""
        out, self.secure_in = self.secure_in, []
        return out

    def masked_message(self, forwarded: frozenset[str], commitments: dict[str, bytes]) -> bytes:
        """The open secure round entered its masked phase: ``masked`` tells the workers U2
        (``u``: whose masked inputs the round waits for) and, with device keys, the seed
        commitments their signatures cover (``c``). Sent before the devices' ``sf``."""
        assert self.round is not None
        self.round.masked = True
        return self._control("masked", r=self.round.number, u=sorted(forwarded),
                             c=dict(sorted(commitments.items())) or None)  # fmt: skip

    def wants_masked(self) -> bool:
        """Whether the open round's ``masked`` message is still to be sent."""
        return self.round is not None and not self.round.masked

    def masked_complete(self, forwarded: frozenset[str]) -> bool:
        """Every device of U2 has a masked input summed by some worker: the phase can end."""
        sr = self.round
        return sr is not None and sr.masked and forwarded <= set(sr.owner)

    def merge_masked(self, secure_round: Any, now: float) -> tuple[list[Any], str | None]:
        """End a secure round's masked phase with the workers' partials (after freeze and
        commit): their sums added mod 2^b into ``secure_round`` (a ``SecureRound``), whose
        unmask requests are returned. A worker of the round lost, or whose partial is missing
        or refused: nothing is merged and the reason is returned (the round fails: a sum
        without its masked inputs, whose masks the unmasking would remove, would be wrong);
        every device of U2 not yet charged for the round is charged (its masked input may have
        reached that worker: over- rather than under-counted)."""
        sr = self.round
        assert sr is not None and self.core.current is not None
        self.round = None
        return self._merge_masked(sr, secure_round, now, self.core.current.number)

    def _merge_masked(self, sr: ShardedRound, secure_round: Any, now: float, number: int
                      ) -> tuple[list[Any], str | None]:  # fmt: skip
        core = self.core
        assert core.secure is not None
        bits = core.secure.layout.bits
        dim = core.secure.layout.length
        total = np.zeros(dim, dtype=np.uint64)
        devices: list[str] = []
        # a worker offline since the round opened (hash partition) held nothing of it: its
        # devices' messages reached no one, so they are devices that dropped out
        bad: dict[str, str] = {w: "lost (went offline)" for w in sorted(sr.lost - sr.absent)}
        for worker in sorted(sr.workers - sr.lost):
            msg = sr.partials.get(worker)
            if msg is None:
                bad[worker] = "no partial"
                continue
            try:
                self._merge_tally(_tally(msg))
                rejected = _counts(msg, "j")
                if msg.get("lost"):
                    raise ShardingError(f"the worker reports its share lost: {msg['lost']}")
                mine = sorted(d for d, w in sr.owner.items() if w == worker)
                if sorted(_names(msg, "a")) != mine:
                    raise ShardingError(f"it summed {len(_names(msg, 'a'))} masked inputs, the "
                                        f"coordinator admitted {len(mine)} of its reports")  # fmt: skip
                vec = self._ring_sum(msg.get("s"), mine, bits, dim)
            except (ShardingError, ValueError, TypeError) as exc:
                self.refused["partial"] += 1
                log.error("partial of worker %r for round %d refused: %s", worker, sr.number, exc)
                bad[worker] = f"partial refused ({exc})"[:200]
                continue
            total += vec
            total &= ring_mask(bits)
            devices += mine
            secure_round.rejected.update(rejected)
            for _device, reason in sr.left_out.get(worker, ()):
                secure_round.rejected[str(reason)] += 1
        missing = sorted(set(bad) | sr.absent)
        info = {"workers": len(sr.workers), "workers_missing": missing, **self._refusals()}
        if core.cohorts is not None:
            self._cohort_info[number] = info
        else:
            self._secure_info = info
        if bad:
            for device in sorted(secure_round.forwarded):
                if not core.is_released(device, number):
                    core.record_release(device, number, SECURE_RELEASE)
            what = "; ".join(f"{w}: {why}" for w, why in bad.items())
            return [], (f"ingest worker share lost mid-round ({what}): the masked inputs it held "
                        "cannot be summed")  # fmt: skip
        try:
            return secure_round.merge_masked(devices, total, now), None
        except ValueError as exc:  # the workers' devices are not the ones the round waits for
            return [], f"the workers' masked inputs do not merge: {exc}"

    @staticmethod
    def _ring_sum(data: Any, devices: list[str], bits: int, dim: int) -> np.ndarray:
        """A worker's modular partial ``{"y": ring bytes, "b": bits}`` (nil: it summed none)."""
        if data is None:
            if devices:
                raise ShardingError(f"no sum for the {len(devices)} masked inputs it summed")
            return np.zeros(dim, dtype=np.uint64)
        if not isinstance(data, dict) or set(data) != {"y", "b"} or data["b"] != bits:
            raise ShardingError(f"a secure partial is {{y: bytes, b: {bits}}}")
        vec = ring_unpack(data["y"], dim, bits) if isinstance(data["y"], bytes) else None
        if vec is None:
            raise ShardingError(f"a secure partial's sum is not {dim} values of Z_2^{bits}")
        return vec

    def end_secure(self) -> dict[str, Any]:
        """The record fields of a secure round that closes (its workers, which were missing
        when its masked phase ended). A round that ends before its masked inputs were merged
        (it failed earlier, or a stop) takes nothing from the workers: what they summed of it
        is dropped with their next ``open``; its masked inputs were charged as they came."""
        info, self._secure_info = self._secure_info, {}
        if self.round is not None:
            info = {"workers": len(self.round.workers),
                    "workers_missing": sorted(self.round.lost), **self._refusals()}  # fmt: skip
            self.round = None
        return info

    # ---------------------------------------------------------------- secure FedBuff cohorts

    def open_cohort_message(self, number: int, global_payload: bytes) -> bytes:
        """The ``open`` control message of a cohort just dispatched (its global message as
        devices see it), with ``o``: every cohort still open (a worker drops the shares of
        cohorts no longer listed: they ended without asking for them). The cohort's sharded
        round has the workers online now."""
        workers = set(self.workers & self.online) if self.dealt else set(self.workers)
        cr = ShardedRound(number, workers)
        if not self.dealt:
            cr.lost = workers - self.online
            cr.absent = set(cr.lost)
        self.cohort_rounds[number] = cr
        return self._control("open", r=number, g=global_payload, b=None, h=False, c=None,
                             e=self.epoch, o=sorted(self.cohort_rounds))  # fmt: skip

    def cohort_masked_message(self, number: int, forwarded: frozenset[str],
                              commitments: dict[str, bytes]) -> bytes:  # fmt: skip
        """Cohort ``number`` entered its masked phase (as :meth:`masked_message`)."""
        self.cohort_rounds[number].masked = True
        return self._control("masked", r=number, u=sorted(forwarded),
                             c=dict(sorted(commitments.items())) or None)  # fmt: skip

    def cohort_wants_masked(self, number: int) -> bool:
        cr = self.cohort_rounds.get(number)
        return cr is not None and not cr.masked

    def cohort_masked_complete(self, number: int, forwarded: frozenset[str]) -> bool:
        cr = self.cohort_rounds.get(number)
        return cr is not None and cr.masked and forwarded <= set(cr.owner)

    def cohort_freeze_message(self, number: int) -> bytes:
        self.cohort_rounds[number].collecting = True
        return self._control("freeze", r=number)

    def cohort_commit_message(self, number: int) -> bytes:
        cr = self.cohort_rounds[number]
        left_out = {w: [d for d, _ in items] for w, items in cr.left_out.items()}
        return self._control("commit", r=number, x=left_out)

    def merge_cohort(self, number: int, secure_round: Any, now: float
                     ) -> tuple[list[Any], str | None]:  # fmt: skip
        """End cohort ``number``'s masked phase with the workers' partials, exactly as
        :meth:`merge_masked` ends a sync round's (a lost worker: nothing merged, the reason
        returned, every device of its U2 charged for the cohort)."""
        cr = self.cohort_rounds.pop(number, None)
        if cr is None:
            return [], "the cohort's workers were not asked (no sharded cohort)"
        return self._merge_masked(cr, secure_round, now, number)

    def end_cohort(self, number: int) -> dict[str, Any]:
        """The record fields of a cohort that closes (as :meth:`end_secure`): one that ends
        before its masked inputs were merged takes nothing from the workers (its masked inputs
        were charged as they came); they drop its share at the next ``open``."""
        info = self._cohort_info.pop(number, None)
        cr = self.cohort_rounds.pop(number, None)
        if info is None:
            workers, lost = (cr.workers, cr.lost) if cr is not None else (set(), set())
            info = {"workers": len(workers), "workers_missing": sorted(lost),
                    **self._refusals()}  # fmt: skip
        return info

    def merge(self) -> dict[str, Any]:
        """Fold every partial that came into the core's round; account for the ones that did
        not. Returns what the round's record should add (workers, lost shares)."""
        core, sr = self.core, self.round
        assert sr is not None and core.strategy is not None
        for worker in sorted(set(sr.partials) - sr.lost):
            self._merge_one(sr, sr.partials[worker])
        missing = sorted(sr.workers - set(sr.partials) | sr.lost)
        if missing:
            self._account_missing(sr, missing)
        if self.lost_before_resume:
            self.lost_before_resume = False
            log.error("round %d was reopened after a restart: the shares its earlier workers "
                      "held are lost; charging its selection", sr.number)  # fmt: skip
            self._account_missing(sr, [])
            missing = [*missing, "before-restart"]
        info = {"workers": len(sr.workers), "workers_missing": missing, **self._refusals()}
        self.round = None
        return info

    def charge_lost_before_resume(self) -> dict[str, Any]:
        """The open round of a resumed coordinator closes before it was re-opened to workers
        (stopped while it waited for them): what its earlier workers held is lost all the same,
        so the selection is charged as :meth:`merge` would."""
        if not self.lost_before_resume or self.core.current is None:
            return {}
        self.lost_before_resume = False
        sr = ShardedRound(self.core.current.number, set())
        log.error("round %d was reopened after a restart and closes before its workers took it "
                  "up: charging its selection", sr.number)  # fmt: skip
        self._account_missing(sr, [])
        return {"workers": 0, "workers_missing": ["before-restart"], **self._refusals()}

    def _merge_one(self, sr: ShardedRound, msg: dict[str, Any]) -> None:
        """Its tally always counts; its sums only if they are what the coordinator admitted, else
        its share is lost. (Its releases came with its progress messages.)"""
        core = self.core
        assert core.strategy is not None
        worker = _name(msg, "w")  # checked when the partial came (in on_partial)
        try:
            self._merge_tally(_tally(msg))
            if msg.get("lost"):
                raise ShardingError(f"the worker reports its share lost: {msg['lost']}")
            mine = {d for d, w in sr.owner.items() if w == worker}
            if set(_names(msg, "a")) != mine:  # e.g. its final progress came after the commit
                raise ShardingError(
                    f"it folded {len(_names(msg, 'a'))} devices, the coordinator admitted "
                    f"{len(mine)} of its reports: the sums cannot be reconciled"
                )
            if msg.get("s") is not None:  # None: the worker never saw the round open
                check_partial(core, msg["s"], sorted(mine))
                core.strategy.merge(msg["s"])
        except (ShardingError, ValueError, TypeError) as exc:
            self.refused["partial"] += 1
            log.error("partial of worker %r for round %d refused: %s", worker, sr.number, exc)
            sr.partials.pop(worker, None)
            self._account_missing(sr, [worker])
            return
        for _device, reason in sr.left_out.get(worker, ()):
            core.count_rejection(reason)

    def _merge_tally(self, t: dict[str, Any]) -> None:
        tally = self.core.tally
        tally.bytes_up += int(t.get("bu", 0))
        tally.messages_up += int(t.get("mu", 0))
        tally.late += int(t.get("late", 0))
        tally.capped_samples += int(t.get("cap", 0))
        for reason, count in (t.get("rej") or {}).items():
            tally.rejected[str(reason)] += int(count)
        for reason, text in (t.get("smp") or {}).items():
            tally.samples.setdefault(str(reason), str(text))

    def _account_missing(self, sr: ShardedRound, workers: list[Any]) -> None:
        """A share that never came: its accepted devices leave the round's count, and every
        selected device not in the ledger for the round is charged (it may have released)."""
        core = self.core
        rnd = core.current
        assert rnd is not None
        for worker in workers:
            log.error("round %d: no partial from ingest worker %r: its share of the round is "
                      "lost", sr.number, worker)  # fmt: skip
        gone = {d for d, w in sr.owner.items() if w in workers}
        rnd.accepted -= gone
        for device in sorted(rnd.selected):
            if not core.is_released(device, rnd.number):
                declared = core.devices.get(device)
                core.record_release(device, rnd.number, declared.n_samples if declared else 0)

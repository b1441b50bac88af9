"""The aggregator side of one SecAgg+ round, sans I/O: (device, payload) in, effects out
(:class:`Deliver` to a device's inbox, :class:`Rejected`, :class:`Finished`). All legality lives
in :meth:`AggregatorSession.receive`; :meth:`close_phase` is the runtime's deadline.

keys (U1: ``ak``) -> shares (U2: ``sh``) -> masked (U3: ``mx``) -> unmask (``ua``) -> done.
A phase closes when every device it waits for answered, or at ``close_phase``.

The session never holds a device's unmasked vector: a masked vector is added into one running sum
in Z_2^b the moment it arrives and then dropped; unmasking subtracts the survivors' self masks and
the dropped devices' pairwise masks from that sum, and, for distributed DP, the noise that
survivors beyond ``noise_floor`` revealed (their own noise, never their input).
``observer(label, vector)`` sees every vector the session materialises (tests/test_secagg.py
proves none is an individual input).
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Container, Iterable, Sequence

import numpy as np

import edge_fl.secagg.messages as M
import edge_fl.secagg.primitives as P
from edge_fl.protocol import PayloadRejected
from edge_fl.protocol.envelope import Verifies
from edge_fl.secagg.session import (
    Deliver,
    Failed,
    Finished,
    Outcome,
    Rejected,
    RoundParams,
    Summed,
)

Effect = Deliver | Rejected | Finished
#: the most t-subsets of a target's shares tried when the first t fail its check: with h shares
#: of which e are altered, a random subset is clean with probability C(h-e, t) / C(h, t)
#: (h = 12, t = 7: e = 1 gives 0.42, so the 63 draws after the first all fail with probability
#: 2e-15; e = 2 gives 0.15 and 3e-5; then the round fails as before, never with a wrong sum)
MAX_SUBSETS = 64
Observer = Callable[[str, np.ndarray], None]
PHASES = ("keys", "shares", "masked", "unmask", "done")
_KIND = {"keys": "ak", "shares": "sh", "masked": "mx", "unmask": "ua"}


class AggregatorSession:
    def __init__(
        self,
        params: RoundParams,
        *,
        observer: Observer | None = None,
        device_key: Callable[[str], Verifies | None] | None = None,
    ) -> None:
        """``device_key``: a device id -> its public signing key (None: that device is not
        checked); with one, its ``ak`` and ``mx`` must carry its valid signature."""
        self.params = params
        self._device_key = device_key
        self.phase = "keys"
        self.outcome: Outcome | None = None
        self._observe = observer
        self._graph = params.graph
        self._near = {d: params.graph.neighbours(d) for d in params.roster}
        self._waiting: set[str] = set(params.roster)
        self._adverts: dict[str, tuple[bytes, bytes, bytes, bytes | None]] = {}  # U1
        self._sealed: dict[str, dict[str, bytes]] = {}  # U2: sender -> receiver -> sealed
        self._survivors: list[str] = []  # U3, in arrival order
        self._sum = np.zeros(params.dim, dtype=np.uint64)
        self._asked: dict[str, list[int]] = {}
        # target -> [(point, share)] of its seed (survivors) or its key (dropped)
        self._shares: dict[str, list[tuple[int, int]]] = {}
        self._seen: dict[str, bytes] = {}  # device -> the payload accepted in this phase
        self._answered = 0  # unmask answers accepted
        self._reveal: frozenset[str] = frozenset()  # survivors asked for their own noise
        self._denoised: list[str] = []
        #: devices whose unmask answer held a share off its target's polynomial (a lie, or a
        #: corruption that no check before could catch): recovered around, and named here
        self.altered: set[str] = set()

    @property
    def survivors(self) -> tuple[str, ...]:
        return tuple(sorted(self._survivors))

    @property
    def waiting(self) -> frozenset[str]:
        """The devices the current phase still waits for."""
        return frozenset(self._waiting)

    @property
    def counts(self) -> dict[str, int]:
        """How many devices advertised keys (U1), sent shares (U2), delivered a masked input
        (U3) and answered the unmasking, so far: what a round's record reports."""
        return {
            "keys": len(self._adverts),
            "shares": len(self._sealed),
            "masked": len(self._survivors),
            "unmask": self._answered,
        }

    # ------------------------------------------------------------ inbox
    def receive(self, device: str, payload: bytes) -> list[Effect]:
        p = self.params
        if not isinstance(payload, bytes | bytearray | memoryview):
            return [Rejected(device, "malformed", f"payload is {type(payload).__name__}")]
        payload = bytes(payload)
        if device not in self._near:
            return [Rejected(device, "not_selected", "not in this round's roster")]
        if self.phase == "done":
            return [Rejected(device, "late", "the round is over")]
        if self._seen.get(device) == payload:
            return [Rejected(device, "duplicate", "this phase's message again")]
        try:
            msg = M.decode(payload, p.max_bytes, len(self._near[device]))
        except PayloadRejected as exc:
            return [Rejected(device, exc.reason.value, exc.detail)]
        if msg.round != p.round or msg.nonce != p.nonce:
            return [Rejected(device, "wrong_nonce", f"round {msg.round} or nonce not this round's")]
        if msg.kind != _KIND[self.phase]:
            return [
                Rejected(device, "wrong_phase", f"{msg.kind!r} while the round is in {self.phase}")
            ]
        if device in self._seen:
            return [Rejected(device, "duplicate", f"a second {msg.kind!r} in this phase")]
        if device not in self._waiting:
            return [Rejected(device, "late", f"dropped from the round before {self.phase}")]
        why = getattr(self, f"_on_{self.phase}")(device, msg)
        if why is not None:
            return [Rejected(device, "bad_" + self.phase, why)]
        self._seen[device] = bytes(payload)
        self._waiting.discard(device)
        return self.close_phase() if not self._waiting else []

    def close_phase(self) -> list[Effect]:
        """End the current phase with whoever answered (the runtime's deadline)."""
        if self.phase == "done":
            return []
        step = {"keys": self._after_keys, "shares": self._after_shares,
                "masked": self._after_masked, "unmask": self._finish}[self.phase]  # fmt: skip
        self._seen = {}
        return step()

    # ------------------------------------------------------------ per message
    def _on_keys(self, device: str, msg: M.Message) -> str | None:
        b = msg.body
        if not (P.valid_public(b["ck"]) and P.valid_public(b["sk"])):
            return "a public key is a low-order X25519 point"
        p = self.params
        why = self._check_signature(
            device, b["sig"], M.advert_body(p.job, p.round, p.nonce, device, b["ck"], b["sk"])
        )
        if why is not None:
            return why
        self._adverts[device] = (b["ck"], b["sk"], b["bh"], b["sig"])
        return None

    def _on_shares(self, device: str, msg: M.Message) -> str | None:
        sealed: dict[str, bytes] = {}
        for v, blob in zip(self._near[device], msg.body["c"], strict=True):
            if (blob is None) != (v not in self._adverts):
                return f"shares for {v} {'missing' if blob is None else 'unexpected'}"
            if blob is not None:
                sealed[v] = blob
        self._sealed[device] = sealed
        return None

    def _on_masked(self, device: str, msg: M.Message) -> str | None:
        y = open_masked(
            self.params, device, msg, self._near[device], self._sealed,
            self._adverts[device][2], self._device_key,
        )  # fmt: skip
        if isinstance(y, str):
            return y
        self._sum += y
        self._sum &= P.ring_mask(self.params.bits)
        del y  # folded: the session keeps no individual vector, masked or not
        self._survivors.append(device)
        self._notify("masked_sum", self._sum)
        return None

    def _on_unmask(self, device: str, msg: M.Message) -> str | None:
        p = self.params
        noise = None
        if (msg.body["z"] is not None) != (device in self._reveal):
            return f"noise {'not asked for' if msg.body['z'] is not None else 'missing'}"
        if msg.body["z"] is not None:
            noise = P.unpack(msg.body["z"], p.dim, p.bits)
            if noise is None:
                return f"the noise is not {p.dim} values of Z_2^{p.bits}"
        asked = self._asked[device]
        point = self._graph.point(device)
        got: list[tuple[str, int]] = []
        for v, ask, blob in zip(self._near[device], asked, msg.body["s"], strict=True):
            if (blob is None) != (ask == M.ASK_NOTHING):
                return f"share of {v} {'missing' if blob is None else 'not asked for'}"
            if blob is not None:
                value = P.share_value(blob)
                if value is None:
                    return f"the share of {v} is not a field element"
                got.append((v, value))
        for v, value in got:
            self._shares.setdefault(v, []).append((point, value))
        if noise is not None:
            self._notify("revealed_noise", noise)
            self._sum -= noise  # out of the (still masked) sum at once
            self._sum &= P.ring_mask(p.bits)
            self._denoised.append(device)
        self._answered += 1
        return None

    def commitments(self) -> dict[str, bytes]:
        """Each device whose keys were accepted: its seed commitment ``bh`` (what its signed
        ``mx`` covers)."""
        return {device: advert[2] for device, advert in self._adverts.items()}

    @property
    def forwarded(self) -> frozenset[str]:
        """U2 once the masked phase began: the devices whose shares were forwarded, whose
        masked inputs the round waits for (what a sharded ingest worker checks ``m`` against)."""
        return frozenset(self._sealed) if self.phase in ("masked", "unmask") else frozenset()

    def merge_masked(self, devices: Sequence[str], total: np.ndarray) -> list[Effect]:
        """Masked inputs checked and summed elsewhere (sharded ingest workers, each with a
        :class:`MaskedShare` of this round): ``total`` is the sum in Z_2^b of the masked inputs
        of ``devices``, added to the running sum as if each had come here. ValueError (nothing
        changed) unless the round is in its masked phase, each device is one it still waits
        for (in U2, not yet delivered), and ``total`` is a vector of the ring."""
        p = self.params
        if self.phase != "masked":
            raise ValueError(f"masked inputs merged while the round is in {self.phase}")
        names = list(devices)
        if len(set(names)) != len(names) or not set(names) <= self._waiting:
            raise ValueError("merged masked inputs name a device twice or one not waited for")
        vec = np.asarray(total)
        if vec.shape != (p.dim,) or vec.dtype != np.uint64 or (vec & ~P.ring_mask(p.bits)).any():
            raise ValueError(f"a merged masked sum is {p.dim} values of Z_2^{p.bits}")
        self._sum += vec
        self._sum &= P.ring_mask(p.bits)
        self._survivors.extend(names)
        self._waiting -= set(names)
        if names:
            self._notify("masked_sum", self._sum)
        return self.close_phase() if not self._waiting else []

    def _check_signature(self, device: str, sig: bytes | None, body: bytes) -> str | None:
        verifier = self._device_key(device) if self._device_key is not None else None
        if verifier is None:
            return None
        if sig is None or not verifier.verify(body, sig):
            return "not signed by the device's key"
        return None

    # ------------------------------------------------------------ phase ends
    def _fail(self, phase: str, reason: str) -> list[Effect]:
        self.phase = "done"
        self._sum = np.zeros(0, dtype=np.uint64)
        self.outcome = Failed(phase, reason)
        return [Finished(self.outcome)]

    def _after_keys(self) -> list[Effect]:
        p = self.params
        u1 = set(self._adverts)
        if len(u1) < p.min_survivors:
            return self._fail(
                "keys", f"{len(u1)} devices advertised keys; {p.min_survivors} needed"
            )
        out: list[Effect] = []
        for u in sorted(u1):
            keys: list[list[bytes] | None] = []
            for v in self._near[u]:
                if v not in u1:
                    keys.append(None)
                    continue
                ck, sk, _, sig = self._adverts[v]
                keys.append([ck, sk] if sig is None else [ck, sk, sig])
            out.append(Deliver(u, M.encode("nk", p.round, p.nonce, keys=keys)))
        self.phase, self._waiting = "shares", u1
        return out

    def _after_shares(self) -> list[Effect]:
        p = self.params
        u2 = set(self._sealed)
        if len(u2) < p.min_survivors:
            return self._fail("shares", f"{len(u2)} devices sent shares; {p.min_survivors} needed")
        out: list[Effect] = []
        for u in sorted(u2):
            c = [self._sealed[v].get(u) if v in u2 else None for v in self._near[u]]
            out.append(Deliver(u, M.encode("sf", p.round, p.nonce, c=c)))
        self._sealed = {u: {} for u in u2}  # forwarded: only U2 membership is kept
        self.phase, self._waiting = "masked", u2
        return out

    def _after_masked(self) -> list[Effect]:
        p = self.params
        u2, u3 = set(self._sealed), set(self._survivors)
        if len(u3) < p.min_survivors:
            return self._fail(
                "masked", f"{len(u3)} masked inputs arrived; {p.min_survivors} needed"
            )
        self._reveal = self._noise_to_remove(u3)
        out: list[Effect] = []
        for u in sorted(u3):
            asks = [
                M.ASK_SEED if v in u3 else M.ASK_KEY if v in u2 else M.ASK_NOTHING
                for v in self._near[u]
            ]
            self._asked[u] = asks
            extra = {"z": True} if u in self._reveal else {}
            out.append(Deliver(u, M.encode("uq", p.round, p.nonce, a=asks, **extra)))
        self.phase, self._waiting = "unmask", set(u3)
        return out

    def _noise_to_remove(self, u3: set[str]) -> frozenset[str]:
        """The survivors beyond the noise floor, in an order keyed by the round's nonce (so the
        extra upload falls on different devices each round): the sum keeps the noise of the
        other ``noise_floor`` (and of any asked device that does not answer)."""
        p = self.params
        if not p.noise_floor:
            return frozenset()
        order = sorted(u3, key=lambda d: hashlib.sha256(p.nonce + d.encode()).digest())
        return frozenset(order[: max(0, len(u3) - p.noise_floor)])

    def _finish(self) -> list[Effect]:
        p = self.params
        u2, u3 = set(self._sealed), set(self._survivors)
        need = p.threshold
        # the dropped devices whose pairwise masks are in the sum (a survivor neighbour masked with them)
        dropped = sorted(v for v in u2 - u3 if any(u in u3 for u in self._near[v]))
        for v in sorted(u3) + dropped:
            have = len(self._shares.get(v, ()))
            if have < need:
                what = "self mask" if v in u3 else "pairwise masks"
                return self._fail(
                    "unmask", f"{v}'s {what} need {need} shares; {have} neighbours answered"
                )
        for v in sorted(u3):
            seed = self._recover(v, "seed")
            if seed is None:
                return self._fail("unmask", f"{v}'s seed shares do not match its commitment")
            mask = P.expand(P.self_seed(seed, p.job, p.round, p.nonce, v), p.dim, p.bits)
            self._notify("self_mask", mask)
            self._sum -= mask
        for v in dropped:
            scalar = self._recover(v, "key")
            if scalar is None:
                return self._fail("unmask", f"{v}'s key shares do not match its advertised key")
            for u in self._near[v]:
                if u not in u3:
                    continue
                shared = P.agree(scalar, self._adverts[u][1])
                mask = P.expand(P.pair_seed(shared, p.job, p.round, p.nonce, u, v), p.dim, p.bits)
                self._notify("pair_mask", mask)
                if u < v:
                    self._sum -= mask
                else:
                    self._sum += mask
        self._sum &= P.ring_mask(p.bits)
        total = P.from_ring(self._sum, p.bits)
        if p.max_int and int(np.abs(total).max(initial=0)) > len(u3) * p.max_int:
            # bounded inputs cannot sum beyond this: a mask was not removed (an altered share
            # or masked vector that no check caught); never a wrong model
            return self._fail("unmask", "the unmasked sum is beyond what the inputs can reach")
        self._notify("sum", total)
        self.phase = "done"
        self.outcome = Summed(
            total,
            tuple(sorted(u3)),
            tuple(sorted(self.altered)),
            tuple(sorted(self._denoised)),
            tuple(sorted(self._reveal)),
        )
        return [Finished(self.outcome)]

    def _recover(self, target: str, kind: str) -> int | None:
        """``target``'s secret of ``kind`` (``seed`` or ``key``), checked by :meth:`_checks`
        (the seed's commitment, the key's advertised public key), from the shares its
        neighbours answered with (:func:`recover`); the holders of altered shares it could name
        join :attr:`altered`."""
        secret, off = recover(
            self._shares[target],
            self.params.threshold,
            f"{self.params.nonce.hex()}:{target}",
            lambda value: self._checks(target, kind, value),
        )
        self.altered.update(self._graph.roster[x - 1] for x in off)
        return secret

    def _checks(self, target: str, kind: str, secret: int) -> bool:
        p = self.params
        _, public_key, commitment, _ = self._adverts[target]
        if kind == "seed":
            return P.seed_commitment(p.job, p.round, p.nonce, target, secret) == commitment
        return secret < P.PRIME and P.public_bytes(secret) == public_key

    def _notify(self, label: str, vec: np.ndarray) -> None:
        if self._observe is not None:
            self._observe(label, vec.copy())


def open_masked(
    params: RoundParams,
    device: str,
    msg: M.Message,
    near: Sequence[str],
    forwarded: Container[str],
    commitment: bytes,
    device_key: Callable[[str], Verifies | None] | None,
) -> np.ndarray | str:
    """A masked input (an ``mx`` of ``device``, decoded, of this round) checked: its bit
    width, its signature (with ``device_key``: over ``commitment``, its ``ak``'s ``bh``), its
    mask set (exactly the neighbours in ``near`` whose shares were forwarded: U2), its vector.
    The vector in Z_2^b, or why it is refused. The one check of a single aggregator's session
    and of a sharded worker's :class:`MaskedShare`."""
    p = params
    b = msg.body
    if b["b"] != p.bits:
        return f"bit width {b['b']}, the round's is {p.bits}"
    verifier = device_key(device) if device_key is not None else None
    if verifier is not None:
        body = M.masked_body(p.job, p.round, p.nonce, device, commitment, b["m"], b["y"])
        if b["sig"] is None or not verifier.verify(body, b["sig"]):
            return "not signed by the device's key"
    # the device masked against exactly the neighbours whose shares it was forwarded, or
    # the pairwise masks would not cancel (a broker that dropped a forwarded share)
    if b["m"] != M.bitmap([v in forwarded for v in near]):
        return "its mask set is not the neighbours the aggregator forwarded shares from"
    y = P.unpack(b["y"], p.dim, p.bits)
    if y is None:
        return f"'y' is not {p.dim} values of Z_2^{p.bits} in {p.vector_bytes} bytes"
    return y


#: masked inputs a :class:`MaskedShare` keeps (their bytes) to take one back
RECENT = 256


class MaskedShare:
    """One sharded ingest worker's part of a round's masked phase: the masked inputs it is
    dealt, checked as the round's :class:`AggregatorSession` checks them (:func:`open_masked`)
    and summed in Z_2^b; the coordinator merges the shares' sums into its session
    (:meth:`AggregatorSession.merge_masked`). Modular addition is associative and
    commutative, so the merged sum is bit for bit the one a single session would hold.

    ``forwarded``: U2 (the devices whose shares the round forwarded), ``commitments``: each
    one's seed commitment (its ``ak``'s ``bh``: what its signed ``mx`` covers)."""

    def __init__(
        self,
        params: RoundParams,
        forwarded: Iterable[str],
        commitments: dict[str, bytes],
        device_key: Callable[[str], Verifies | None] | None = None,
    ) -> None:
        self.params = params
        self.forwarded = frozenset(forwarded)
        self.commitments = dict(commitments)
        self._device_key = device_key
        self.sum = np.zeros(params.dim, dtype=np.uint64)
        self.devices: list[str] = []  # summed, in arrival order
        self.recent: deque[tuple[str, bytes]] = deque(maxlen=RECENT)
        self.complete = True  # every summed input is still in ``recent``

    def receive(self, device: str, payload: bytes) -> Rejected | None:
        """An ``mx`` of ``device``: None if summed, else why not (nothing changed)."""
        p = self.params
        if device not in self.forwarded:
            why = "not_selected" if device not in p.roster else "late"
            return Rejected(device, why, "not a device whose shares the round forwarded")
        try:
            msg = M.decode(bytes(payload), p.max_bytes, len(p.graph.neighbours(device)))
        except PayloadRejected as exc:
            return Rejected(device, exc.reason.value, exc.detail)
        if msg.round != p.round or msg.nonce != p.nonce:
            return Rejected(device, "wrong_nonce", f"round {msg.round} or nonce not this round's")
        if msg.kind != "mx":
            return Rejected(device, "wrong_phase", f"{msg.kind!r} is not a masked input")
        if device in self.devices:
            return Rejected(device, "duplicate", "a second 'mx' in this phase")
        near = p.graph.neighbours(device)
        y = open_masked(p, device, msg, near, self.forwarded,
                        self.commitments.get(device, b""), self._device_key)  # fmt: skip
        if isinstance(y, str):
            return Rejected(device, "bad_masked", y)
        self.sum += y
        self.sum &= P.ring_mask(p.bits)
        del y
        self.devices.append(device)
        if len(self.recent) == self.recent.maxlen:
            self.complete = False
        self.recent.append((device, bytes(payload)))
        return None

    def take_back(self, device: str) -> bool:
        """Subtract ``device``'s masked input again (the coordinator counts another worker's
        copy); False if it is no longer kept."""
        p = self.params
        for i in range(len(self.recent) - 1, -1, -1):
            who, payload = self.recent[i]
            if who != device:
                continue
            msg = M.decode(payload, p.max_bytes, len(p.graph.neighbours(device)))
            y = P.unpack(msg.body["y"], p.dim, p.bits)
            assert y is not None  # it was summed
            self.sum -= y
            self.sum &= P.ring_mask(p.bits)
            del self.recent[i]
            self.devices.remove(device)
            return True
        return False


def _subsets(
    shares: Sequence[tuple[int, int]], need: int, seed: str
) -> Iterable[Sequence[tuple[int, int]]]:
    """The first ``need`` shares, then every other ``need``-subset when there are at most
    MAX_SUBSETS of them, else MAX_SUBSETS subsets drawn deterministically from ``seed``."""
    if len(shares) < need:
        return
    first = list(shares[:need])
    yield first
    if len(shares) == need:
        return
    if math.comb(len(shares), need) <= MAX_SUBSETS:
        for subset in itertools.combinations(shares, need):
            if list(subset) != first:
                yield subset
        return
    draw = random.Random(seed)  # not a secret: which honest shares recover a public commitment
    for _ in range(MAX_SUBSETS - 1):
        yield draw.sample(list(shares), need)


def recover(
    shares: Sequence[tuple[int, int]], need: int, seed: str, check: Callable[[int], bool]
) -> tuple[int | None, list[int]]:
    """The secret behind ``shares`` (``(point, value)``) that passes ``check``, and the points
    of the shares that lie off its polynomial (named only when that is certain, below).

    From the first ``need`` (t) shares, else from other t-subsets (:func:`_subsets`): a holder
    that answers with an altered share cannot fail the round while t honest shares remain.
    Points are named only when the first t failed, and only from a polynomial that passes and
    agrees with more than (h + t - 1) / 2 of the h shares: two polynomials of degree t - 1
    share at most t - 1 points, so at most one can, and it is the shares' own (altered shares
    can cancel out at 0 and pass the check through a wrong polynomial, off which honest shares
    lie). (None, []) when no subset passes."""
    found: int | None = None
    for i, subset in enumerate(_subsets(shares, need, seed)):
        try:
            secret = P.combine(subset)
        except P.ShareError:
            continue
        if not check(secret):
            continue
        if i == 0:
            return secret, []  # nothing failed: nothing to attribute
        found = secret
        off = [x for x, y in shares if P.interpolate(subset, x) != y]
        if 2 * (len(shares) - len(off)) > len(shares) + need - 1:
            return secret, off
    return found, []

"""The device side of one SecAgg+ round, sans I/O: payloads and the device's input in, effects
out (:class:`Send`, :class:`Aborted`, :class:`Rejected`). All legality lives in :meth:`receive`.

new --advertise--> advertised --nk--> shared --sf--> ready --submit--> masked --uq--> done
(``submit`` may also come first: the masked input goes out as soon as both are there.)

A payload for another round or nonce, or one that does not decode, is Rejected and changes
nothing; the same bytes again get the same answer again (QoS 1 duplicates, a re-broadcast after a
broker restart). A payload that decodes but breaks the protocol (a neighbour's keys without a
valid signature, shares that do not authenticate, a request for a share the device never held)
aborts the round: the device answers nothing more, so it never reveals both of a neighbour's
secrets and never masks against keys it cannot trust.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
from cryptography.exceptions import InvalidTag

import edge_fl.secagg.messages as M
import edge_fl.secagg.primitives as P
from edge_fl.protocol import PayloadRejected
from edge_fl.protocol.envelope import Signs, Verifies
from edge_fl.secagg.session import (
    Aborted,
    Rejected,
    RoundParams,
    Send,
)

Effect = Send | Aborted | Rejected


class DeviceSession:
    """One device's state for one round. ``randbytes``: the CSPRNG (os.urandom; tests inject a
    seeded one). ``signer``: the device's Ed25519 key, to sign its advertised keys; ``peer_key``:
    a device id -> its public signing key (None: that device's keys are taken unsigned)."""

    def __init__(
        self,
        device: str,
        params: RoundParams,
        *,
        randbytes: P.RandBytes = os.urandom,
        signer: Signs | None = None,
        peer_key: Callable[[str], Verifies | None] | None = None,
    ) -> None:
        if device not in params.roster:
            raise ValueError(f"device {device!r} is not in the round's roster")
        self.device = device
        self.params = params
        self.phase = "new"
        self._rand = randbytes
        self._signer = signer
        self._peer_key = peer_key
        self._near = params.graph.neighbours(device)
        self._keys: dict[str, tuple[bytes, bytes]] = {}  # neighbour -> (ck, sk)
        self._held: dict[str, tuple[int, int]] = {}  # neighbour -> (its key share, its seed share)
        self._input: np.ndarray | None = None
        self._noise: np.ndarray | None = None  # the distributed-DP noise inside the input
        self._replies: dict[bytes, bytes] = {}  # a payload answered -> the answer
        self._c = self._s = self._seed = 0
        self._own = b""  # this device's ck || sk
        self._bh = b""  # its seed commitment
        # per neighbour with keys: (sealing key, opening key, opening AAD, pair-mask seed)
        self._derived: dict[str, tuple[bytes, bytes, bytes, bytes]] = {}

    # ------------------------------------------------------------ phase 0
    def advertise(self) -> Send:
        """Fresh keys and self-mask seed; the ``ak`` message."""
        if self.phase != "new":
            raise RuntimeError("a device advertises its keys once per round")
        p = self.params
        self._c, self._s = P.new_key(self._rand), P.new_key(self._rand)
        self._seed = P.new_seed(self._rand)
        ck, sk = P.public_bytes(self._c), P.public_bytes(self._s)
        self._own = ck + sk
        self._bh = P.seed_commitment(p.job, p.round, p.nonce, self.device, self._seed)
        fields: dict[str, bytes] = {"ck": ck, "sk": sk, "bh": self._bh}
        if self._signer is not None:
            fields["sig"] = self._signer.sign(
                M.advert_body(p.job, p.round, p.nonce, self.device, ck, sk)
            )
        self.phase = "advertised"
        return Send(M.encode("ak", p.round, p.nonce, **fields))

    # ------------------------------------------------------------ inbox
    def receive(self, payload: bytes) -> list[Effect]:
        if not isinstance(payload, bytes | bytearray | memoryview):
            return [Rejected(None, "malformed", f"payload is {type(payload).__name__}")]
        payload = bytes(payload)
        if self.phase in ("aborted", "done") and payload not in self._replies:
            return [Rejected(None, "closed", f"the device's round is {self.phase}")]
        if payload in self._replies:
            return [Send(self._replies[payload])]
        try:
            msg = M.decode(payload, self.params.max_bytes, len(self._near))
        except PayloadRejected as exc:
            return [Rejected(None, exc.reason.value, exc.detail)]
        p = self.params
        if msg.round != p.round or msg.nonce != p.nonce:
            return [Rejected(None, "wrong_nonce", f"for round {msg.round}, not this round's")]
        expected = {"advertised": "nk", "shared": "sf", "masked": "uq"}.get(self.phase)
        if msg.kind != expected:
            return [Rejected(None, "wrong_phase", f"{msg.kind!r} while {self.phase}")]
        handler = {"nk": self._on_keys, "sf": self._on_shares, "uq": self._on_request}[msg.kind]
        effects = handler(msg)
        for effect in effects:
            if isinstance(effect, Send):
                self._replies[payload] = effect.payload
        return effects

    def submit(
        self, values: np.ndarray, *, modular: bool = False, noise: np.ndarray | None = None
    ) -> list[Effect]:
        """The device's integer vector (quantised, |value| <= max_int): masked and sent as soon
        as the neighbours' shares are in. ``modular``: values beyond max_int are taken modulo
        2^b (distributed DP's noised integers: the sum mod 2^b is a function of the true sum, so
        a wrap costs accuracy, never privacy). ``noise``: the distributed-DP noise ``values``
        include, kept so that the device can reveal it when the aggregator asks (the sum keeps
        more than the floor's noise shares: docs/specs/secagg.md section 12)."""
        p = self.params
        vec = np.asarray(values)
        if vec.shape != (p.dim,) or vec.dtype.kind not in "iu":
            raise ValueError(f"the input is {p.dim} integers, got {vec.dtype} {vec.shape}")
        if not modular and vec.size and int(np.abs(vec.astype(np.int64)).max()) > p.max_int:
            raise ValueError(f"an input value exceeds max_int = {p.max_int} (the sum could wrap)")
        if self._input is not None or self.phase in ("masked", "done"):
            raise RuntimeError("a device submits one input per round")
        if noise is not None:
            z = np.asarray(noise)
            if z.shape != (p.dim,) or z.dtype.kind not in "iu":
                raise ValueError(f"the noise is {p.dim} integers, got {z.dtype} {z.shape}")
            self._noise = z.astype(np.int64)
        self._input = vec.astype(np.int64)
        return self._masked() if self.phase == "ready" else []

    # ------------------------------------------------------------ handlers
    def _abort(self, reason: str) -> list[Effect]:
        self.phase = "aborted"
        self._input = None
        return [Aborted(reason)]

    def _on_keys(self, msg: M.Message) -> list[Effect]:
        p = self.params
        for v, entry in zip(self._near, msg.body["keys"], strict=True):
            if entry is None:
                continue
            ck, sk, sig = entry
            verifier = self._peer_key(v) if self._peer_key is not None else None
            if verifier is not None and (
                sig is None
                or not verifier.verify(M.advert_body(p.job, p.round, p.nonce, v, ck, sk), sig)
            ):
                return self._abort(f"neighbour {v}'s keys are not signed by its device key")
            try:  # one agreement per key: X25519 refuses a low-order point here
                shared, mask_shared = P.agree(self._c, ck), P.agree(self._s, sk)
            except ValueError:
                return self._abort(f"neighbour {v}'s keys are low-order X25519 points")
            aad = P.share_aad(p.job, p.round, p.nonce, v, self.device, ck + sk + self._own)
            self._keys[v] = (ck, sk)
            self._derived[v] = (
                P.share_key(shared, p.job, p.round, p.nonce, self.device, v),
                P.share_key(shared, p.job, p.round, p.nonce, v, self.device),
                aad,
                P.pair_seed(mask_shared, p.job, p.round, p.nonce, self.device, v),
            )
        if len(self._keys) < p.threshold:
            return self._abort(
                f"{len(self._keys)} neighbours advertised keys; the threshold is {p.threshold}"
            )
        owners = [v for v in self._near if v in self._keys]
        points = [p.graph.point(v) for v in owners]
        key_shares = P.split(self._s, p.threshold, points, self._rand)
        seed_shares = P.split(self._seed, p.threshold, points, self._rand)
        sealed: dict[str, bytes] = {}
        for v, ks, ss in zip(owners, key_shares, seed_shares, strict=True):
            plain = P.share_bytes(ks) + P.share_bytes(ss)
            aad = P.share_aad(
                p.job, p.round, p.nonce, self.device, v, self._own + b"".join(self._keys[v])
            )
            sealed[v] = P.seal(self._derived[v][0], plain, aad)
        self.phase = "shared"
        out = M.encode("sh", p.round, p.nonce, c=[sealed.get(v) for v in self._near])
        return [Send(out)]

    def _on_shares(self, msg: M.Message) -> list[Effect]:
        for v, blob in zip(self._near, msg.body["c"], strict=True):
            if blob is None:
                continue
            if v not in self._keys:
                return self._abort(f"shares from {v}, which advertised no keys")
            _, key, aad, _ = self._derived[v]
            try:
                plain = P.open_sealed(key, blob, aad)
            except InvalidTag:
                return self._abort(f"the shares from {v} do not authenticate")
            ks = P.share_value(plain[: P.SHARE_BYTES])
            ss = P.share_value(plain[P.SHARE_BYTES :])
            if ks is None or ss is None:
                return self._abort(f"the shares from {v} are not field elements")
            self._held[v] = (ks, ss)
        self.phase = "ready"
        return self._masked() if self._input is not None else []

    def _masked(self) -> list[Effect]:
        p = self.params
        assert self._input is not None
        y = P.to_ring(self._input, p.bits)
        self._input = None  # nothing unmasked outlives this call
        y += P.expand(P.self_seed(self._seed, p.job, p.round, p.nonce, self.device), p.dim, p.bits)
        for v in self._held:  # the neighbours that sent shares: exactly the aggregator's U2 edges
            mask = P.expand(self._derived[v][3], p.dim, p.bits)
            if self.device < v:
                y += mask
            else:
                y -= mask
        y &= P.ring_mask(p.bits)
        self.phase = "masked"
        blob = P.pack(y, p.bits)
        mask_set = M.bitmap([v in self._held for v in self._near])
        fields: dict[str, object] = {"b": p.bits, "m": mask_set, "y": blob}
        if self._signer is not None:
            fields["sig"] = self._signer.sign(
                M.masked_body(p.job, p.round, p.nonce, self.device, self._bh, mask_set, blob)
            )
        return [Send(M.encode("mx", p.round, p.nonce, **fields))]

    def _on_request(self, msg: M.Message) -> list[Effect]:
        p = self.params
        answer: list[bytes | None] = []
        for v, ask in zip(self._near, msg.body["a"], strict=True):
            if ask == M.ASK_NOTHING:
                answer.append(None)
                continue
            if v not in self._held:
                return self._abort(f"asked for a share of {v}, which sent none")
            key_share, seed_share = self._held[v]
            answer.append(P.share_bytes(seed_share if ask == M.ASK_SEED else key_share))
        fields: dict[str, object] = {"s": answer}
        if msg.body["z"]:
            if self._signer is not None:  # device keys: the aggregator may be malicious
                return self._abort("asked for its noise in a job with device keys")
            if self._noise is None:
                return self._abort("asked for noise it never added")
            fields["z"] = P.pack(P.to_ring(self._noise, p.bits), p.bits)
        self._noise = None
        self.phase = "done"
        return [Send(M.encode("ua", p.round, p.nonce, **fields))]

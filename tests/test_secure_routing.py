"""What routes and charges a SecAgg+ message (``secure_head``) reads its round and nonce in any
key order, as the session's decoder does (docs/protocol.md, encoding rule 7: key order is not
significant). A red team's device that wrote its ``mx`` as ``v k nc r ...`` had it summed by the
session and never charged: the head was read by position."""

from __future__ import annotations

import itertools

import msgpack

import edge_fl.secagg.messages as M
from edge_fl.protocol.secure import masked_head, secure_head

NONCE = bytes(range(16))


def mx_fields() -> dict:
    return {"v": 1, "k": "mx", "r": 3, "nc": NONCE, "b": 12, "m": b"\x01", "y": bytes(6)}


def test_every_key_order_of_a_masked_input_is_routed_and_charged_as_the_session_reads_it():
    fields = mx_fields()
    # v and k first: what tells a SecAgg+ message from an update (``up_kind``; docs/protocol.md)
    orders = [("v", "k", *rest) for rest in itertools.permutations(list(fields)[2:])]
    assert len(orders) == 120
    for order in orders:
        payload = msgpack.packb({k: fields[k] for k in order}, use_bin_type=True)
        message = M.decode(payload, 1 << 16)  # the session takes it: it would be summed
        assert (message.round, message.nonce) == (3, NONCE)
        assert masked_head(payload) == (3, NONCE) == secure_head(payload), order


def test_a_head_that_is_missing_repeated_or_of_the_wrong_type_routes_nowhere():
    fields = mx_fields()
    no_round = {k: v for k, v in fields.items() if k != "r"}
    assert secure_head(msgpack.packb(no_round, use_bin_type=True)) is None
    # a repeated key (encoding rule 2: malformed; the session refuses it too)
    pairs = [("v", 1), ("k", "mx"), ("nc", NONCE), ("r", 3), ("r", 4), ("b", 12)]
    packer = msgpack.Packer(use_bin_type=True)
    repeated = packer.pack_map_pairs(pairs)
    assert secure_head(repeated) is None
    bad = dict(fields, r="3")
    reordered = {"v": 1, "k": "mx", "nc": NONCE, **{k: v for k, v in bad.items() if k not in "vk"}}
    assert secure_head(msgpack.packb(reordered, use_bin_type=True)) is None
    assert secure_head(M.encode("mx", 3, NONCE, b=12, m=b"\x01", y=bytes(6))) == (3, NONCE)


def test_only_the_last_rounds_commitments_are_kept():
    import numpy as np

    from edge_fl.privacy.rng import seeded_generator
    from edge_fl.protocol import UpdateLimits
    from edge_fl.server.aggregator import (
        COMMITMENTS_KEPT,
        AggregatorCore,
        AggregatorSettings,
    )

    settings = AggregatorSettings(job="j", rounds=500, target=2, min_updates=1, deadline_s=1.0)
    core = AggregatorCore(settings, np.zeros(3, np.float32), UpdateLimits(3), seeded_generator(1))
    for r in range(1, 201):
        core.keep_commitments(r, {"d1": bytes(32)})
    assert sorted(core.secure_commitments) == list(range(201 - COMMITMENTS_KEPT, 201))

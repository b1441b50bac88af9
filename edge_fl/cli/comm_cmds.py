"""``edge-fl comm-cost``: what one update and one model broadcast cost on the wire, per mechanism.

Every number is the length of a payload produced by the real encoders (``encode_update``,
``encode_global``), never a formula: dense float32 / float16 deltas, and a SignDS vote built from the
planned h and a real selection (``edge_fl.privacy.signds.select``) on a random update. A SignDS
payload's size depends on the selected indices (the encoder sends the shorter of bit-packing and
delta-varint), so it is averaged over ``--samples`` selections and min / max are reported too.

Uplink codecs (``edge_fl.protocol.codecs``): every codec's update, encoded by the real codec and the real
update encoder, per mechanism that accepts it (``Mechanism.accepts_codec``; a refused combination
says why). The update size does not depend on the values, only on d (and top-k's fraction), except
for the mechanism's name in ``m``.

``wire``: one device's MQTT-layer bytes of one round (``edge_fl.transport.wire.mqtt_packet_bytes``):
up = the update's PUBLISH (QoS 1: topic, packet id, payload); down = the global model's PUBLISH
(signed, as a simulation and a keyed deployment send it; delivered at QoS 0, as devices subscribe:
no packet id, no PUBACK) + the PUBACK of the update. ``*_ip`` / ``*_ip_tls``: the link model's IP
bytes without / with TLS (Ethernet MSS 1448, pure ACKs, TLS 1.3 records). ``wire_session``: the
once-per-connection packets (CONNECT with the last will, CONNACK, online status, SUBSCRIBE/SUBACK,
the end-of-job model, offline status, DISCONNECT). Keep-alive PINGREQ/PINGRESP (2 + 2 bytes) only flow after ``keepalive_s`` without
traffic: none in rounds shorter than that.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, TypedDict

import click

__all__ = ["comm_cost", "comm_cost_report"]

MAX_DIM = 50_000_000  # the dense encodings are built in memory (4 bytes per parameter)


# Header values of the measured updates: the simulated fleet's device-id format and a round number
# below 128 (msgpack fixint); a round >= 128 adds one or two bytes to every update.
class UpdateHeader(TypedDict):
    device: str
    round: int
    base_version: int
    n_samples: int


class GlobalHeader(TypedDict):
    job: str
    config_digest: str
    deadline_s: float


HEADER: UpdateHeader = {"device": "d00000", "round": 1, "base_version": 0, "n_samples": 50}
GLOBAL_HEADER: GlobalHeader = {"job": "edgefl", "config_digest": "0123456789ab", "deadline_s": 30.0}
# What the wire figures assume: the topics of job "edgefl" (--job) with the default prefix, device
# d00000, QoS 1 for updates, the global model delivered at QoS 0 (devices subscribe at QoS 0,
# docs/protocol.md), MQTT 3.1.1.
WIRE_JOB = GLOBAL_HEADER["job"]


def _check_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} = {value!r} is out of domain integer [{lo}, {hi}]")
    return value


def comm_cost_report(
    dim: int,
    *,
    k: float = 0.01,
    eps: float = 100.0,
    thr: float = 0.6,
    dim_out: int = 0,
    max_dim_out: int = 100,
    samples: int = 20,
    selected: int = 0,
    rng: Any = None,
    topk_fraction: float = 0.01,
    job: str = WIRE_JOB,
    downlink: str = "f32",
) -> dict[str, Any]:
    """Payload bytes of one update of a ``dim``-parameter model under each mechanism, and of the
    global-model broadcast; the wire figures with the global model as ``downlink`` (f32, f16,
    q8). ``rng``: a numpy Generator (default: the production CSPRNG)."""
    import numpy as np

    from edge_fl.identity import device_id
    from edge_fl.privacy.magrr import MagRRState
    from edge_fl.privacy.rng import secure_generator
    from edge_fl.privacy.signds import SignDSParams, plan, select
    from edge_fl.protocol import (
        DenseUpdate,
        GlobalModel,
        SignDSUpdate,
        encode_global,
        encode_update,
    )
    from edge_fl.protocol.indices import encode_bitpack, encode_indices, index_width

    dim = _check_int("dim", dim, 1, MAX_DIM)
    samples = _check_int("samples", samples, 1, 10_000)
    selected = _check_int("selected", selected, 0, 1_000_000)
    params = SignDSParams(k=k, eps=eps, thr_ratio=thr, dim_out=dim_out, max_dim_out=max_dim_out)
    p = plan(params, dim)
    rng = secure_generator() if rng is None else rng
    hdr: UpdateHeader = {
        "device": HEADER["device"],
        "round": HEADER["round"],
        "base_version": HEADER["base_version"],
        "n_samples": HEADER["n_samples"],
    }

    delta = rng.standard_normal(dim).astype(np.float32)
    dense = {
        f"dense_{name}": len(encode_update(DenseUpdate(**hdr, delta=delta, wire_dtype=dt)))
        for name, dt in (("f32", "f4"), ("f16", "f2"))
    }

    sizes: list[int] = []
    index_bytes: list[int] = []
    tags: Counter = Counter()
    for _ in range(samples):
        sel = select(rng.standard_normal(dim), p, rng)
        vote = SignDSUpdate(**hdr, sign=sel.sign, indices=sel.indices, magrr_bit=1)
        sizes.append(len(encode_update(vote, dim=dim)))
        tag, blob = encode_indices(sel.indices, dim)
        tags[tag] += 1
        index_bytes.append(len(blob))
    mean = sum(sizes) / len(sizes)
    bitpack = len(encode_bitpack(np.arange(p.h, dtype=np.uint32), dim))

    ids = tuple(device_id(i) for i in range(selected)) or None
    weights = rng.standard_normal(dim).astype(np.float32)
    magrr = MagRRState.initial().to_dict()
    glob = {
        dt: len(
            encode_global(
                GlobalModel(
                    job=GLOBAL_HEADER["job"],
                    version=1,
                    round=1,
                    params=weights,
                    selected=ids,
                    deadline_s=GLOBAL_HEADER["deadline_s"],
                    config_digest=GLOBAL_HEADER["config_digest"],
                    wire_dtype=dt,
                    mechanism_state=magrr,
                )
            )
        )
        for dt in ("f4", "f2", "q8")
    }
    dt = {"f32": "f4", "f16": "f2", "q8": "q8"}.get(downlink)
    if dt is None:
        raise ValueError(f"downlink {downlink!r} is not one of f32, f16, q8")
    signed = _signed_global_bytes(weights, ids, magrr, job, dt)
    nonce = _nonce_bytes()
    codecs = codec_costs(dim, delta, hdr, rng, topk_fraction)
    for entry in codecs["codecs"].values():
        entry["wire"] = round_wire(entry["payload"] + nonce, signed, job=job)
    by_mech = codecs["by_mechanism"]
    wire_by_mechanism = {
        mech: {
            name: None if size is None else round_wire(size + nonce, signed, job=job)["up"]
            for name, size in sizes.items()
        }
        for mech, sizes in by_mech.items()
    }
    wire_by_mechanism["signds"] = {"signds": round_wire(round(mean) + nonce, signed, job=job)["up"]}
    return {
        "dim": dim,
        "updates": {**dense, "signds": round(mean, 1)},
        **codecs,
        "wire_up_by_mechanism": wire_by_mechanism,
        "wire_session": session_wire(job=job),
        "wire_global_payload": signed,
        "wire_downlink": downlink,
        "signds": {
            **{key: p.describe()[key] for key in ("topk", "h", "nu_th", "capped", "h_uncapped")},
            "sign_k": params.k,
            "sign_eps": params.eps,
            "index_coding": tags.most_common(1)[0][0],
            "index_codings": dict(tags),
            "index_bits": index_width(dim),
            "index_bytes_mean": round(sum(index_bytes) / len(index_bytes), 1),
            "bitpack_bytes": bitpack,
            "bytes_mean": round(mean, 1),
            "bytes_min": min(sizes),
            "bytes_max": max(sizes),
            "samples": samples,
            "averaged": min(sizes) != max(sizes),
        },
        "ratios": {
            "dense_f32_over_signds": round(dense["dense_f32"] / mean, 1),
            "dense_f16_over_signds": round(dense["dense_f16"] / mean, 1),
        },
        "global_model": {
            "f4": glob["f4"],
            "f2": glob["f2"],
            "q8": glob["q8"],
            "selected_ids": selected,
            "includes_magrr_state": True,
        },
        "header": {**hdr, **GLOBAL_HEADER},
    }


def _signed_global_bytes(
    weights: Any, ids: Any, magrr: Any, job: str = WIRE_JOB, dt: str = "f4"
) -> int:
    """The global message (``dt``: f4, f2 or q8) as a job sends it: with the round's nonce, in
    the signed envelope (simulations always sign)."""
    from edge_fl.protocol import GlobalModel, encode_global
    from edge_fl.protocol.messages import NONCE_BYTES
    from edge_fl.protocol.signing import Signer

    msg = GlobalModel(
        job=job,
        nonce=bytes(NONCE_BYTES),
        version=1,
        round=1,
        params=weights,
        selected=ids,
        deadline_s=GLOBAL_HEADER["deadline_s"],
        config_digest=GLOBAL_HEADER["config_digest"],
        wire_dtype=dt,
        mechanism_state=magrr,
    )
    return len(encode_global(msg, signer=Signer.generate()))


def _nonce_bytes() -> int:
    """What the round nonce an update echoes adds to it (the payload figures leave it out)."""
    import numpy as np

    from edge_fl.protocol import DenseUpdate, encode_update
    from edge_fl.protocol.messages import NONCE_BYTES

    delta = np.zeros(1, dtype=np.float32)
    plain = DenseUpdate(**HEADER, delta=delta)
    echoed = DenseUpdate(**HEADER, delta=delta, nonce=bytes(NONCE_BYTES))
    return len(encode_update(echoed, dim=1)) - len(encode_update(plain, dim=1))


def round_wire(
    update_payload: int,
    global_payload: int,
    *,
    job: str = WIRE_JOB,
    device: str = HEADER["device"],
    uploads: bool = True,
    link: Any = None,
) -> dict[str, int]:
    """One device's bytes of one round at the MQTT layer and the link model's IP estimates.

    ``uploads``: False for a device that is online but not selected (it only gets the model)."""
    from edge_fl.protocol import Topics
    from edge_fl.transport.wire import ip_bytes, mqtt_packet_bytes, packet_counts

    topics = Topics(job)
    # the model arrives at QoS 0 (the subscription's QoS caps the delivery): no PUBACK up for it
    model = mqtt_packet_bytes("publish", topic=topics.global_model, payload=global_payload, qos=0)
    up_packets: list[int] = []
    down_packets = [model]
    if uploads:
        up_packets.append(
            mqtt_packet_bytes("publish", topic=topics.update(device), payload=update_payload, qos=1)
        )
        down_packets.append(mqtt_packet_bytes("puback"))
    out = {"up": sum(up_packets), "down": sum(down_packets)}
    for tls, suffix in ((False, "ip"), (True, "ip_tls")):
        up, down = ip_bytes(packet_counts(up_packets, down_packets, tls, link), link)
        out[f"up_{suffix}"], out[f"down_{suffix}"] = up, down
    return out


def session_wire(
    *,
    job: str = WIRE_JOB,
    device: str = HEADER["device"],
    n_samples: int = HEADER["n_samples"],
    final_global: int = 200,
) -> dict[str, int]:
    """The MQTT bytes of one device session beside its rounds (one connect to one DISCONNECT),
    as ``edge-fl device`` makes it. ``final_global``: the end-of-job model's payload."""
    from edge_fl.protocol import Status, Topics, encode_status
    from edge_fl.transport.wire import mqtt_packet_bytes

    topics = Topics(job)
    status = len(encode_status(Status(device, True, n_samples, {})))
    offline = len(encode_status(Status(device, False, n_samples, {})))
    puback = mqtt_packet_bytes("puback")
    sub = [topics.global_model]
    up = (
        mqtt_packet_bytes(
            "connect",
            client_id=f"edgefl-{job}-{device}",
            will_topic=topics.status(device),
            will_payload=offline,
        )
        + mqtt_packet_bytes("publish", topic=topics.status(device), payload=status, qos=1)
        + mqtt_packet_bytes("subscribe", topics=sub)
        + mqtt_packet_bytes("publish", topic=topics.status(device), payload=offline, qos=1)
        + mqtt_packet_bytes("disconnect")
    )
    down = (
        mqtt_packet_bytes("connack")
        + puback
        + mqtt_packet_bytes("suback", topics=sub)
        + mqtt_packet_bytes("publish", topic=topics.global_model, payload=final_global, qos=0)
        + puback
    )
    return {"up": up, "down": down}


def wire_round_cost(
    dim: int,
    *,
    codec: str = "f32",
    selected: int = 0,
    topk_fraction: float = 0.01,
    job: str = WIRE_JOB,
    rng: Any = None,
    downlink: str = "f32",
) -> dict[str, int]:
    """One device's MQTT bytes of one round with uplink ``codec`` and the global model as
    ``downlink`` (f32, f16, q8: ``compression.downlink``), and the IP estimates."""
    import numpy as np

    from edge_fl.identity import device_id
    from edge_fl.privacy.magrr import MagRRState
    from edge_fl.protocol import DenseUpdate, encode_update
    from edge_fl.protocol.codecs import build_codec

    rng = np.random.default_rng(0) if rng is None else rng
    delta = rng.standard_normal(dim).astype(np.float32)
    options = {"fraction": topk_fraction} if codec == "topk" else {}
    c = build_codec(codec, **options)
    fields, _ = c.encode(delta, rng)
    update = DenseUpdate(**HEADER, delta=delta, wire_dtype="f4", mechanism="none")
    payload = len(encode_update(update, coded=(c.dt, fields))) + _nonce_bytes()
    ids = tuple(device_id(i) for i in range(selected)) or None
    magrr = MagRRState.initial().to_dict()
    dt = {"f32": "f4", "f16": "f2", "q8": "q8"}.get(downlink)
    if dt is None:
        raise ValueError(f"downlink {downlink!r} is not one of f32, f16, q8")
    glob = _signed_global_bytes(delta, ids, magrr, job, dt)
    return {
        **round_wire(payload, glob, job=job),
        "update_payload": payload,
        "global_payload": glob,
    }


def codec_costs(
    dim: int, delta: Any, hdr: UpdateHeader, rng: Any, topk_fraction: float
) -> dict[str, Any]:
    """Bytes of one update through each uplink codec, per mechanism that accepts it."""
    from edge_fl.mechanisms import check_combination, mechanism_names
    from edge_fl.protocol import DenseUpdate, encode_update
    from edge_fl.protocol.codecs import build_codec, codec_names

    codecs: dict[str, Any] = {}
    by_mechanism: dict[str, dict[str, int | None]] = {m: {} for m in mechanism_names()}
    refused: dict[str, dict[str, str]] = {}
    for name in codec_names():
        options = {"fraction": topk_fraction} if name == "topk" else {}
        codec = build_codec(name, **options)
        fields, _ = codec.encode(delta, rng)
        sizes = {}
        for mech in mechanism_names():
            why = check_combination(mech, name)
            if why is not None:
                refused.setdefault(mech, {})[name] = why
                by_mechanism[mech][name] = None
                continue
            update = DenseUpdate(**hdr, delta=delta, wire_dtype="f4", mechanism=mech)
            sizes[mech] = len(encode_update(update, coded=(codec.dt, fields)))
            by_mechanism[mech][name] = sizes[mech]
        codecs[name] = {
            "dt": codec.dt,
            **{k: v for k, v in codec.describe().items() if k not in ("codec", "dt")},
            "payload": sizes["none"],  # the update with m = "none"
            "codec_fields": codec.payload_bytes(dim),
            "wire": None,  # filled by comm_cost_report: one device's round (round_wire)
        }
    base = codecs["f32"]["payload"]
    for entry in codecs.values():
        entry["vs_f32"] = round(base / entry["payload"], 2)
    return {"codecs": codecs, "by_mechanism": by_mechanism, "refused": refused}


def _print_codecs(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Update payload bytes per uplink codec, d = {data['dim']:,}")
    table.add_column("codec (dt)")
    table.add_column("payload", justify="right")
    table.add_column("vs f32", justify="right")
    table.add_column("wire up / down", justify="right")
    table.add_column("unbiased")
    table.add_column("refused with")
    for name, c in data["codecs"].items():
        label = f"{name} ({c['dt']})" + (f", k = {c['fraction']:g}" if "fraction" in c else "")
        table.add_row(
            label,
            f"{c['payload']:,}",
            f"{c['vs_f32']:.2f}x",
            "-" if c["wire"] is None else f"{c['wire']['up']:,} / {c['wire']['down']:,}",
            "yes" if c["unbiased"] else "no",
            ", ".join(m for m, r in data["refused"].items() if name in r) or "",
        )
    Console().print(table)
    click.echo("payload: the update with m = 'none' (another mechanism's name changes a few bytes;")
    click.echo(
        "--json has every mechanism); wire: one device's MQTT bytes of one round (the update"
    )
    click.echo(
        f"and the signed {data['wire_downlink']} global model with topics, packet ids, PUBACKs; "
        "--json adds the"
    )
    click.echo("TLS and TCP/IP estimates and the once-per-session packets).")


def _print_table(data: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Payload bytes, d = {data['dim']:,}")
    table.add_column("payload")
    table.add_column("bytes", justify="right")
    table.add_column("vs SignDS", justify="right")
    sd = data["signds"]
    mean = data["updates"]["signds"]
    table.add_row("update, dense float32", f"{data['updates']['dense_f32']:,}", "")
    table.add_row("update, dense float16", f"{data['updates']['dense_f16']:,}", "")
    spread = f" ({sd['bytes_min']}-{sd['bytes_max']})" if sd["averaged"] else ""
    table.add_row(
        f"update, SignDS h={sd['h']} ({sd['index_coding']}){spread}",
        f"{mean:,}",
        f"{data['updates']['dense_f32'] / mean:,.0f}x smaller than f32",
    )
    table.add_row("global model, float32", f"{data['global_model']['f4']:,}", "")
    table.add_row("global model, float16", f"{data['global_model']['f2']:,}", "")
    table.add_row("global model, q8 (--downlink q8)", f"{data['global_model']['q8']:,}", "")
    Console().print(table)
    if sd["averaged"]:
        click.echo(f"SignDS size is the mean over {sd['samples']} selections (it varies).")
    _print_codecs(data)


def default_dim() -> int:
    """The number of parameters of the default job's model (``edge-fl simulate`` without
    options: mlp on digits), what ``comm-cost`` prices without ``--dim``."""
    from edge_fl.config import load_config
    from edge_fl.job import build_job

    return int(build_job(load_config(None, {})).model.n_params)


@click.command("comm-cost")
@click.option(
    "--dim",
    type=int,
    help="Model dimension (number of parameters); default: the default job's model (mlp on digits).",
)
@click.option("--k", "k", type=float, default=0.01, show_default=True, help="SignDS sign_k.")
@click.option("--eps", type=float, default=100.0, show_default=True, help="SignDS sign_eps.")
@click.option("--thr", type=float, default=0.6, show_default=True, help="SignDS sign_thr_ratio.")
@click.option("--dim-out", type=int, default=0, show_default=True, help="SignDS h; 0 = optimise.")
@click.option("--max-dim-out", type=int, default=100, show_default=True, help="Cap on h.")
@click.option("--samples", type=int, default=20, show_default=True, help="SignDS selections.")
@click.option("--selected", type=int, default=0, show_default=True, help="Ids in the broadcast.")
@click.option(
    "--downlink",
    type=click.Choice(["f32", "f16", "q8"]),
    default="f32",
    show_default=True,
    help="The global model's encoding in the wire figures (compression.downlink).",
)
@click.option(
    "--topk-fraction", type=float, default=0.01, show_default=True, help="topk codec: fraction k."
)
@click.option(
    "--job", default=WIRE_JOB, show_default=True, help="Job id (its length is in every topic)."
)
@click.option("--seed", type=int, default=None, help="Seed (reproducible, NOT secure).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def comm_cost(
    dim: int | None,
    k: float,
    eps: float,
    thr: float,
    dim_out: int,
    max_dim_out: int,
    samples: int,
    selected: int,
    topk_fraction: float,
    job: str,
    downlink: str,
    seed: int | None,
    as_json: bool,
) -> None:
    """Bytes of one update (dense f32 / f16, SignDS, every uplink codec per mechanism) and of the
    global model, by the real encoders."""
    from edge_fl.privacy.rng import seeded_generator

    flags = {
        "dim": "--dim",
        "samples": "--samples",
        "selected": "--selected",
        "signds.sign_k": "--k",
        "signds.sign_eps": "--eps",
        "signds.sign_thr_ratio": "--thr",
        "signds.sign_dim_out": "--dim-out",
        "signds.max_dim_out": "--max-dim-out",
        "model dimension d": "--dim",
        "topk fraction": "--topk-fraction",
        "job id": "--job",
    }
    if seed is not None and seed < 0:
        raise click.BadParameter(
            f"seed = {seed} is out of domain integer [0, inf)", param_hint="'--seed'"
        )
    defaulted = dim is None
    if dim is None:
        dim = default_dim()
    try:
        data = comm_cost_report(
            dim,
            k=k,
            eps=eps,
            thr=thr,
            dim_out=dim_out,
            max_dim_out=max_dim_out,
            samples=samples,
            selected=selected,
            rng=None if seed is None else seeded_generator(seed),
            topk_fraction=topk_fraction,
            job=job,
            downlink=downlink,
        )
    except ValueError as err:
        msg = str(err)
        flag = next((f for key, f in flags.items() if msg.startswith(key)), None)
        raise click.BadParameter(msg, param_hint=f"'{flag}'" if flag else None) from err
    data["rng"] = "chacha20-urandom" if seed is None else f"pcg64-seeded (seed {seed})"
    if as_json:
        click.echo(json.dumps(data))
        return
    _print_table(data)
    if defaulted:
        click.echo(f"d = {dim:,}: the default job's model (mlp on digits); --dim D for another")

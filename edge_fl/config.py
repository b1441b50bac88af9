"""One validated configuration for a job (YAML or TOML file, then command-line overrides).

Every key has a domain; a bad file fails at load time with messages that name the key, the value
and the allowed domain, never deep inside a round. Unknown keys are errors (a typo must not silently fall
back to a default).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from edge_fl.mechanisms import mechanism_class, registered
from edge_fl.mechanisms.signds_settings import MagRRSettings, SignDSSettings
from edge_fl.protocol.codecs import build_codec


class ConfigError(ValueError):
    """A configuration that cannot run, with one line per problem (one line in all when there
    is one problem: ``invalid configuration: key = value: why``)."""

    def __str__(self) -> str:
        text = super().__str__()
        head, sep, rest = text.partition("\n  ")
        return f"{head} {rest}" if sep and "\n" not in rest else text


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


PositiveInt = Annotated[int, Field(ge=1)]


class BrokerConfig(_Section):
    url: str | None = Field(None, description="mqtt[s]://[user:pass@]host:port; None = embedded")
    prefix: str = Field("edgefl", description="topic prefix: <prefix>/<job>/global, up/<id>, ...")
    embedded: Literal["auto", "mosquitto", "amqtt"] = Field(
        "auto",
        description="the broker simulate starts when url is None: a private Mosquitto on a free "
        "loopback port, or the pure-Python amqtt; auto = Mosquitto when installed",
    )
    connect_concurrency: int = Field(  # Mosquitto's listen backlog is 100
        64, ge=1, le=100, description="simulated devices connecting at once"
    )
    keepalive_s: int = Field(
        60, ge=5, le=3600, description="MQTT keep-alive: how soon a vanished device's will fires"
    )


#: a registry name (models, datasets, mechanisms, codecs): checked against its registry when the
#: job is built (``edge_fl.job.check_registered``), so names registered from Python are accepted
RegistryName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")]


class DataConfig(_Section):
    dataset: RegistryName = Field(
        "digits", description="a registered dataset: digits | synthetic | femnist | mnist | yours"
    )
    devices: PositiveInt = Field(
        50, description="N: the job's devices; ids d00000..d{N-1}, each its share of the data"
    )
    partition: Literal["iid", "dirichlet", "natural"] | None = Field(
        None, description="default: iid for digits/mnist, natural (by writer/device) otherwise"
    )
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration")
    data_dir: str | None = Field(
        None,
        description="where the files of femnist / mnist are (each process's own path; the "
        "config digest covers what the files hold, not the path)",
    )
    samples_per_device: PositiveInt = Field(
        50, description="synthetic only: the mean of each device's lognormal sample count"
    )


class ModelConfig(_Section):
    name: RegistryName = Field(
        "mlp", description="a registered model: logreg | mlp | lenet | cnn | yours"
    )
    hidden: PositiveInt = Field(64, description="mlp: units of its one hidden ReLU layer")
    wire_dtype: Literal["f4", "f2"] = Field(
        "f4",
        description="float32 or float16 on the wire, for the global model and dense updates "
        "when compression.downlink / uplink leave it open",
    )
    evaluate_with: Literal["onnxruntime", "native"] = Field(
        "onnxruntime", description="how the aggregator evaluates the global model each round"
    )


class TrainingConfig(_Section):
    # defaults measured on digits/MLP, 50 devices: 20 rounds reach ~0.93 (BENCHMARKS.md)
    epochs: PositiveInt = Field(5, description="local passes over the device's data per update")
    batch_size: PositiveInt = Field(8, description="local minibatch size")
    lr: float = Field(0.3, gt=0, le=100, description="local learning rate")


#: devices per round when the config gives none (clamped to the fleet; see fleet_problem)
DEFAULT_CLIENTS_PER_ROUND = 20


class RoundsConfig(_Section):
    mode: Literal["sync", "fedbuff", "fedasync"] = Field(
        "sync",
        description="sync rounds; fedbuff applies every buffer_size updates; fedasync each one",
    )
    rounds: PositiveInt = Field(
        20, description="rounds (async: model versions) before the job ends"
    )
    clients_per_round: float = Field(
        DEFAULT_CLIENTS_PER_ROUND,
        gt=0,
        description="devices per round; a value in (0, 1) is a fraction of the fleet; the "
        "default 20 is clamped to data.devices, any other count above it is refused",
    )
    min_updates: int | None = Field(None, ge=1, description="default: half the target, at least 1")
    deadline_s: float = Field(
        30.0, gt=0, description="a round closes at this deadline (simulated s) or when complete"
    )
    on_short_round: Literal["extend", "skip"] = Field(
        "extend",
        description="a round with fewer than min_updates at its deadline: extend once, or skip",
    )
    over_selection: float = Field(
        1.0, ge=1.0, le=3.0, description="select this many times the target, for stragglers"
    )
    period_s: float | None = Field(
        None,
        gt=0,
        description="sync: a round opens at most every period_s seconds (simulated), counted "
        "from the previous round's opening, as deployed fleets pace rounds; none: back to back",
    )
    server_lr: float = Field(1.0, gt=0, description="the server's step on the averaged update")
    wait_for_devices_s: float = Field(
        60.0, gt=0, description="how long the aggregator waits for devices to come online"
    )
    # asynchronous modes
    buffer_size: PositiveInt = Field(10, description="FedBuff: apply every K updates")
    staleness: Literal["constant", "polynomial", "hinge"] = Field(
        "polynomial", description="async: how an update's weight falls with its staleness"
    )
    staleness_a: float = Field(0.5, ge=0, description="polynomial exponent / hinge slope")
    staleness_b: int = Field(4, ge=0, description="hinge: staleness counted in full up to b")
    max_staleness: int = Field(20, ge=0, description="async: drop updates staler than this")
    concurrency: int | None = Field(
        None,
        ge=0,
        description="async: at most C devices train at once (a replacement is selected whenever "
        "one answers, times out or leaves); default: the sync round size (clients_per_round x "
        "over_selection; FedBuff: at least buffer_size); 0: no limit, every available device "
        "trains on every version",
    )
    dispatch_timeout_s: float | None = Field(
        None,
        gt=0,
        description="async with a concurrency limit: a selected device that has not answered "
        "after this many seconds gives its slot to another; default: deadline_s",
    )

    def concurrency_limit(self, n_devices: int) -> int | None:
        """C for a fleet of ``n_devices`` (None: no limit; sync mode: None)."""
        if self.mode == "sync" or self.concurrency == 0:
            return None
        if self.concurrency is not None:
            return self.concurrency
        c = math.ceil(self.target(n_devices) * self.over_selection)
        return max(c, self.buffer_size) if self.mode == "fedbuff" else c

    def target(self, n_devices: int) -> int:
        k = self.clients_per_round
        count = math.ceil(k * n_devices) if k < 1 else int(k)
        return max(1, min(count, n_devices))

    def minimum(self, target: int) -> int:
        return min(target, self.min_updates or max(1, math.ceil(target / 2)))

    @model_validator(mode="after")
    def _integral_count(self) -> RoundsConfig:
        k = self.clients_per_round
        if k >= 1 and k != int(k):
            raise ValueError(
                f"rounds.clients_per_round = {k}: use an integer count >= 1 or a fraction in (0, 1)"
            )
        if self.period_s is not None and self.mode != "sync":
            raise ValueError(
                f"rounds.period_s = {self.period_s:g} paces sync rounds; rounds.mode = "
                f"{self.mode} applies updates as they arrive (pace it with rounds.concurrency)"
            )
        c = self.concurrency
        if self.mode == "fedbuff" and c and c < self.buffer_size:
            raise ValueError(
                f"rounds.concurrency = {c} < rounds.buffer_size = {self.buffer_size}: FedBuff "
                "applies K updates at a time, so at least K devices must train at once"
            )
        return self


class PrivacyConfig(_Section):
    """Local (on-device) privacy; the ledger composes every release over all rounds.

    ``epsilon`` is the job's target: Laplace splits it over the rounds, Gaussian and DP-SGD
    calibrate their noise multiplier from it when ``noise_multiplier`` is not given.
    """

    mechanism: str = Field(
        "none",
        pattern=r"^[a-z][a-z0-9-]{0,31}$",
        description="a registered mechanism (edge-fl privacy mechanisms lists them); checked "
        "with its own needs when the job is built",
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="delta at which epsilon is reported")
    accountant: Literal["rdp", "pld"] = Field(
        "rdp", description="accountant used to CALIBRATE noise; reports use the tightest valid"
    )
    epsilon: float | None = Field(None, gt=0, description="target total epsilon")
    budget_epsilon: float | None = Field(
        None, gt=0, description="per-device budget: a device that would exceed it stops"
    )
    clip: float = Field(1.0, gt=0, description="C: L1 (laplace) or L2 (others) clipping bound")
    noise_multiplier: float | None = Field(None, gt=0, description="z (gaussian) / sigma (dpsgd)")
    sample_rate: float | None = Field(
        None, gt=0, le=1, description="dpsgd: Poisson rate q (default batch_size / |D|)"
    )
    schedule: Literal["uniform", "geometric"] = Field(
        "uniform",
        description="laplace: split epsilon over the L uploads equally, or geometrically",
    )
    schedule_decay: float = Field(
        0.9, gt=0, lt=1, description="laplace, geometric: each upload's share is this x the last"
    )
    poisson_selection: bool = Field(
        False,
        description="gaussian-central: select devices by Poisson sampling and claim amplification",
    )
    max_uploads: int | None = Field(
        None,
        ge=1,
        description="L: uploads a device's budget is split over (laplace, nbafl); default T with "
        "full participation, else the 99.9th percentile of Binomial(T, K/N)",
    )
    # SignDS's two sections are the SignDS mechanism's own types; they stay in every config (and
    # so in every job document and digest) where protocol v1 put them
    signds: SignDSSettings = Field(default_factory=SignDSSettings)
    magrr: MagRRSettings = Field(default_factory=MagRRSettings)
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of a mechanism without its own section, validated by its "
        "options model (Mechanism.options_model) when it is registered",
    )

    @model_validator(mode="after")
    def _mechanism_options(self) -> PrivacyConfig:
        """``options`` through the model of the mechanism that owns them, defaults filled (a
        mechanism registered after loading is checked when the job is built)."""
        if registered(self.mechanism):
            self.__dict__["options"] = mechanism_class(self.mechanism).validate_options(
                self.options
            )
        return self


class RobustConfig(_Section):
    """Server-side defences against poisoned updates (``edge_fl.server.robust``).

    Post-processing of what devices released: no privacy cost. Defaults apply where the mechanism
    allows them (``Mechanism.robust_support``: not with central Gaussian, whose clip already bounds
    every update; SignDS votes have no norm); an explicit setting the mechanism cannot take fails
    when the job is built. The aggregator also caps every update's sample count at the one the
    device declared in its status (always on). Clipped/refused/capped updates are counted in the
    round records (``norm_clipped``, ``norm_rejected``, ``max_samples_capped``).
    """

    norm_bound: float | Literal["auto", "off"] | None = Field(
        "auto",
        description="L2 bound on a dense update's delta: a number > 0, 'auto' (norm_multiplier x "
        "the median norm of recently folded updates, fixed per round) or 'off' (also null)",
    )
    on_excess: Literal["clip", "reject"] = Field(
        "clip", description="an update above the bound is scaled down to it, or refused"
    )
    norm_multiplier: float = Field(
        3.0, ge=1, le=1000, description="auto: the bound is this multiple of the median norm"
    )
    norm_window: int = Field(
        100, ge=1, le=1_000_000, description="auto: the median is over this many latest updates"
    )
    norm_min_updates: int = Field(
        5,
        ge=1,
        le=10_000,
        description="auto: updates needed before there is a bound; the job's first ones are "
        "held until then (at the latest until their round closes)",
    )
    aggregator: Literal["mean", "trimmed_mean", "median"] = Field(
        "mean",
        description="mean = the mechanism's own (sample-weighted FedAvg); trimmed_mean / median "
        "are coordinate-wise, unweighted, keep the round's deltas in memory (untrusted fleets)",
    )
    trim: float = Field(
        0.1, ge=0, lt=0.5, description="trimmed_mean: fraction cut at each end of each coordinate"
    )
    max_samples: int | None = Field(
        None, ge=1, description="cap on the sample count any update is weighted by; None = none"
    )

    @field_validator("norm_bound", mode="before")
    @classmethod
    def _no_bool(cls, value: Any) -> Any:
        if value is False:  # YAML 1.1 reads an unquoted ``off`` (or no/false) as False
            return "off"
        if value is True:
            raise ValueError("True is not a bound: a number > 0, 'auto' or 'off'")
        return value

    @model_validator(mode="after")
    def _finite_bound(self) -> RobustConfig:
        b = self.norm_bound
        if isinstance(b, float) and not (math.isfinite(b) and b > 0):
            raise ValueError(
                f"norm_bound = {b!r} is out of domain: a finite number > 0, 'auto' or 'off'"
            )
        return self


class CompressionConfig(_Section):
    """How devices encode their dense updates (``edge_fl.protocol.codecs``; docs/protocol.md, compressed
    dense updates). The codec runs after the privacy mechanism, on the device; the aggregator
    accepts every codec the job's mechanism allows, so devices may differ. Refused: any codec
    with SignDS (its votes have their own wire format) and, with gaussian-central, codecs that
    change a clipped delta's norm (q8, q4, rot1, topk); ``Mechanism.accepts_codec`` says why."""

    uplink: RegistryName | None = Field(
        None,
        description="f32 | f16 | q8 | q4 | topk | rot1 (edge-fl comm-cost compares them); None = "
        "model.wire_dtype, rounded to nearest; checked against the registry when the job is built",
    )
    downlink: RegistryName | None = Field(
        None,
        description="the global model as broadcast: a registered codec that can carry it (f32, "
        "f16 or q8: 8-bit levels per block of 256, nearest rounding; the aggregator keeps its "
        "model in float32 and devices train from what they received); None = model.wire_dtype; "
        "checked against the registry when the job is built",
    )
    topk_fraction: float = Field(0.01, gt=0, le=0.5, description="topk: fraction of coordinates")
    error_feedback: bool = Field(True, description="topk: carry what was not sent to next round")

    @model_validator(mode="after")
    def _topk_options(self) -> CompressionConfig:
        # by value, not by "was it set": the config's JSON dump (the job document) must validate
        fields = type(self).model_fields
        topk_only = {
            k for k in ("topk_fraction", "error_feedback") if getattr(self, k) != fields[k].default
        }
        if topk_only and self.uplink != "topk":
            raise ValueError(
                f"{', '.join(sorted(topk_only))} only apply to uplink = 'topk', not {self.uplink!r}"
            )
        return self

    def build(self) -> Any:
        """The configured uplink codec (an ``edge_fl.protocol.codecs.Codec``), or None."""
        if self.uplink is None:
            return None
        if self.uplink == "topk":
            return build_codec(
                "topk", fraction=self.topk_fraction, error_feedback=self.error_feedback
            )
        return build_codec(self.uplink)


class FleetConfig(_Section):
    """How simulated devices behave: profile, modelled time and unreliability."""

    profile: str = Field("homogeneous", description="packaged profile name or a YAML path")
    time_scale: float | None = Field(
        None, gt=0, description="real s per simulated s; None = no modelled delays"
    )
    start_hour: float = Field(8.0, ge=0, lt=24, description="UTC hour at simulated time 0")
    dropout: float | None = Field(
        None, ge=0, lt=1, description="per-round dropout probability (overrides the profile)"
    )
    train_workers: int = Field(1, ge=1, le=64, description="threads training devices")
    processes: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        "auto",
        description="processes a simulation's fleet runs in: its devices split as `edge-fl "
        "fleet --shard` splits them, the first share in the aggregator's process, the others "
        "forked from it, so training uses more than one core (every device keeps its own "
        "session and bytes); auto = one per usable core, at most 4, for a wall-clock job "
        "without secure aggregation or reproducible on Linux, else 1; never more than the "
        "devices; virtual time needs 1",
    )
    machine_samples_per_s: float | None = Field(
        None,
        gt=0,
        description="modelled compute from the real training: this machine's speed in the "
        "profile's units (compute_samples_per_s); a device's compute time is then its "
        "training's thread CPU seconds here x this / the device's compute_samples_per_s, so a "
        "model's real cost counts (not reproducible to the bit); None: from the profile alone",
    )
    clock: Literal["auto", "virtual", "wall"] = Field(
        "auto",
        description="simulated time: virtual (device durations from the profile, the aggregator "
        "and fleet in conservative lock-step over the broker; machine load cannot change a "
        "result, idle time costs nothing), wall (time_scale real s per simulated s; without "
        "a scale nothing is modelled), auto = wall with a time_scale, else virtual when a "
        "profile other than homogeneous is named, else wall (nothing modelled)",
    )

    sim_hours: float | None = Field(
        None,
        gt=0,
        description="virtual time: end the job (a clean stop: the open round decided, every "
        "file written) once this many simulated hours have passed; None = when its rounds are "
        "done",
    )

    @field_validator("processes", mode="before")
    @classmethod
    def _processes(cls, value: Any) -> Any:
        """One message for the one rule (the union's two branches each had their own)."""
        if value == "auto" or (type(value) is int and 1 <= value <= 64):
            return value
        raise ValueError("a number of processes from 1 to 64, or auto")

    @model_validator(mode="after")
    def _clock_and_scale(self) -> FleetConfig:
        if self.sim_hours is not None and not self.virtual:
            raise ValueError("sim_hours needs virtual time (clock = 'virtual')")
        if self.machine_samples_per_s is not None and not (
            self.virtual or self.time_scale is not None
        ):
            raise ValueError(
                "machine_samples_per_s models devices' compute time from their real training: "
                "it needs modelled time (a profile other than homogeneous, clock = 'virtual', "
                "or a time_scale)"
            )
        if self.virtual and isinstance(self.processes, int) and self.processes > 1:
            raise ValueError(
                f"processes = {self.processes}: virtual time keeps one fleet process in "
                "lock-step with the aggregator; use processes = 1 (or auto), or clock = 'wall'"
            )
        if self.clock == "virtual" and self.time_scale is not None:
            raise ValueError(
                "clock = 'virtual' runs as fast as events allow: drop time_scale (or use "
                "clock = 'wall' for a demonstration in real time)"
            )
        return self

    @property
    def virtual(self) -> bool:
        """Whether simulated time is virtual (see ``clock``)."""
        if self.clock == "auto":
            return self.time_scale is None and self.profile != "homogeneous"
        return self.clock == "virtual"


class PopulationConfig(_Section):
    """A modelled population (``data.devices`` of them, up to millions) of which only ``online``
    devices hold MQTT sessions (``edge_fl.fleet.population``); their data is drawn lazily."""

    online: PositiveInt | None = Field(
        None,
        description="devices holding sessions, a uniform sample of those available at "
        "fleet.start_hour; None = no population model (every device is online)",
    )
    test_devices: PositiveInt = Field(
        200, description="the pooled test set is the test shares of this many sampled devices"
    )


class SecurityConfig(_Section):
    """Who devices trust, and what the aggregator tells them (docs/protocol.md)."""

    signing_key: str | None = Field(
        None,
        description="aggregator: Ed25519 private key (PEM, mode 0600) that signs every global "
        "message; `edge-fl keygen DIR` makes one. Simulations sign with a fresh key per run",
    )
    public_key: str | None = Field(
        None,
        description="devices: the aggregator's public key (64 hex characters, PEM, or a file); "
        "when set, unsigned or badly signed global messages are ignored",
    )
    acks: Literal["off", "rejections", "all"] = Field(
        "rejections", description="per-device replies on edgefl/<job>/ack/<device>"
    )
    device_keys: str | None = Field(
        None,
        description="secure aggregation against a malicious operator: the devices' public "
        "signing keys (device-keys.json, `edge-fl keygen DIR --devices N`); every SecAgg+ key "
        "advertisement and masked input must carry its device's signature. A simulated fleet "
        "takes each device's private key from DIR/devices/<id>.key",
    )


class DeviceConfig(_Section):
    """Only for ``edge-fl device``: which device this process is."""

    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.\-]{1,64}$", description="= MQTT username")
    index: int | None = Field(None, ge=0, description="this device's share of the dataset")
    signing_key: str | None = Field(
        None,
        description="secure aggregation with security.device_keys: this device's Ed25519 "
        "private key (PEM, mode 0600); default DIR/devices/<id>.key beside the directory",
    )


class IngestConfig(_Section):
    """Sharded ingest (docs/scale.md): worker processes decode, validate and fold updates; the
    aggregator coordinates rounds and merges their partial sums exactly."""

    workers: int = Field(
        0, ge=0, le=64, description="0: the aggregator ingests updates itself; N: workers w0..wN-1"
    )
    partition: Literal["shared", "hash", "site"] = Field(
        "shared",
        description="shared: an MQTT 5 shared subscription deals updates (Mosquitto, EMQX); "
        "hash: every worker reads every update and keeps its devices' (any broker); site: each "
        "worker is a site aggregator taking every update of its own (bridged) site broker",
    )
    group: str = Field(
        "edgefl-ingest",
        pattern=r"^[A-Za-z0-9_.\-]{1,64}$",
        description="shared: the MQTT 5 shared-subscription group of the workers",
    )
    spawn: bool = Field(
        True,
        description="the aggregator starts its workers as local processes; false: run "
        "`edge-fl ingest --worker I` yourself, on this or other machines",
    )


class SecureAggregationConfig(_Section):
    """SecAgg+ over the broker (docs/specs/secagg.md; docs/protocol.md, "Secure aggregation"):
    the aggregator learns only the sum of each sync round's updates."""

    enabled: bool = Field(
        False, description="run every sync round (fedbuff: every buffer) as a SecAgg+ round"
    )
    dropout: float = Field(
        0.3,
        ge=0,
        lt=1,
        description="fraction of a round's selection the calibration tolerates "
        "vanishing at any phase",
    )
    collude: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="fraction of the selection assumed to collude with the "
        "aggregator (the threshold keeps their shares useless)",
    )
    neighbours: int | Literal["auto"] = Field(
        "auto",
        description="graph degree k; auto = calibrated (edge_fl.secagg.calibrate), a "
        "number is checked (edge_fl.secagg.check)",
    )
    threshold: int | Literal["auto"] = Field(
        "auto", description="Shamir threshold t; auto = calibrated, a number is checked"
    )
    min_survivors: int | Literal["auto"] = Field(
        "auto",
        description="fewest contributors whose sum counts; auto = ceil((1 - dropout) * selected)",
    )
    step: float | None = Field(
        None, gt=0, description="quantisation step; None = the mechanism's own"
    )
    phase_timeout_s: float = Field(
        30.0, gt=0, le=86400, description="seconds a protocol phase waits for devices"
    )

    @model_validator(mode="after")
    def _fractions(self) -> SecureAggregationConfig:
        if self.dropout + self.collude >= 1:
            raise ValueError("dropout + collude must stay below 1")
        for key in ("neighbours", "threshold", "min_survivors"):
            value = getattr(self, key)
            if value != "auto" and value < (2 if key == "min_survivors" else 1):
                raise ValueError(f"{key} = {value}: too small")
        return self


class JobConfig(_Section):
    job: str = Field(
        "edgefl",
        pattern=r"^[A-Za-z0-9_.\-]{1,64}$",
        description="the job id: topics edgefl/<job>/..., the job document, run.json",
    )
    seed: int = Field(
        0,
        description="public randomness: data split, selection, initial model (noise only with "
        "reproducible)",
    )
    reproducible: bool = Field(
        False, description="seeded (non-cryptographic) noise: tests and reproducibility runs only"
    )
    broker: BrokerConfig = BrokerConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    rounds: RoundsConfig = RoundsConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    robust: RobustConfig = RobustConfig()
    compression: CompressionConfig = CompressionConfig()
    security: SecurityConfig = SecurityConfig()
    fleet: FleetConfig = FleetConfig()
    population: PopulationConfig = PopulationConfig()
    device: DeviceConfig = DeviceConfig()
    ingest: IngestConfig = IngestConfig()
    secure_aggregation: SecureAggregationConfig = SecureAggregationConfig()

    @model_validator(mode="after")
    def _shardable(self) -> JobConfig:
        if not self.ingest.workers:
            return self
        cohorts = self.rounds.mode == "fedbuff" and self.secure_aggregation.enabled
        if self.rounds.mode != "sync" and not cohorts:
            raise ValueError(
                f"ingest.workers = {self.ingest.workers} needs rounds.mode = 'sync', or 'fedbuff' "
                f"with secure_aggregation (cohorts) (sharded ingest merges a round's partial "
                f"sums; {self.rounds.mode} has no rounds)"
            )
        if self.privacy.poisson_selection:
            raise ValueError(
                "ingest.workers needs a selection in the global message; with "
                "privacy.poisson_selection devices select themselves: use one aggregator"
            )
        if self.ingest.partition == "site" and self.ingest.spawn:
            raise ValueError(
                "ingest.partition = 'site': each site aggregator runs beside its site broker; set "
                "ingest.spawn = false and run `edge-fl ingest --worker I --broker <site broker>` "
                "per site (docs/scale.md)"
            )
        return self

    @model_validator(mode="after")
    def _device_keys_sign_secure_rounds(self) -> JobConfig:
        if self.security.device_keys is not None and not self.secure_aggregation.enabled:
            raise ValueError(
                "security.device_keys signs SecAgg+ messages: it needs "
                "secure_aggregation.enabled (--secure-aggregation)"
            )
        return self

    @model_validator(mode="after")
    def _fits_the_fleet(self) -> JobConfig:
        problem = fleet_problem(self.rounds, self.data.devices)
        if problem is not None:
            raise ValueError(problem)
        return self

    #: what ``data.data_dir`` holds, as the job built from it read it (``with_data_identity``)
    _data_identity: str | None = PrivateAttr(None)
    _data_bound: bool = PrivateAttr(False)

    def with_data_identity(self, identity: str | None) -> JobConfig:
        """This config, its digest covering ``data.data_dir`` by ``identity``: a fingerprint of
        what the directory gave the devices to train on (``edge_fl.job.build_job`` computes it),
        or None where the directory changes nothing (the bundled and generated datasets)."""
        out = self.model_copy()
        out.bind_data_identity(identity)
        return out

    def bind_data_identity(self, identity: str | None) -> None:
        """Make this config's digest cover ``data.data_dir`` by ``identity`` (see
        ``with_data_identity``, which leaves the original as it was)."""
        self._data_identity, self._data_bound = identity, True

    def digest(self) -> str:
        """Short hash of the settings devices must agree on (model, data, training, privacy).

        ``data.data_dir`` counts by what it holds, never by its path: two machines with the same
        files agree wherever they keep them, and the same path with other files disagrees. A
        config no job was built from (no identity yet) still hashes the path as written."""
        shared = self._digested()
        if self._data_bound:
            shared["data"]["data_dir"] = self._data_identity
        raw = json.dumps(shared, sort_keys=True, default=str).encode()
        return hashlib.sha256(raw).hexdigest()[:12]

    def _digested(self) -> dict[str, Any]:
        """The sections :meth:`digest` covers, as written."""
        whole = self.model_dump()
        return {k: whole[k] for k in digest_sections(whole)}

    def digest_changes(self, earlier: dict[str, Any]) -> list[str]:
        """What differs, among the settings the digest covers, from ``earlier`` (a whole config
        as run.json keeps it), as ``key: old -> new``: what a refused resume names.
        ``data.data_dir`` is never named (the digest covers what it holds, not its path); empty
        when only what cannot be seen here differs (those files)."""
        sections = digest_sections(self.model_dump()) | digest_sections(earlier)
        mine = json.loads(json.dumps(self.model_dump(include=sections), default=str))
        theirs = {k: earlier.get(k) for k in sections}
        return changed_keys(theirs, mine, skip={"data.data_dir"})


def digest_sections(config: Mapping[str, Any]) -> set[str]:
    """The sections of a whole config (as a mapping) that its digest covers: what devices must
    agree on. ``population`` only when drawn lazily (other data); ``secure_aggregation`` only
    when enabled (configs without it keep their digest)."""
    sections = {"job", "model", "data", "training", "privacy"}
    population, secure = config.get("population"), config.get("secure_aggregation")
    if isinstance(population, Mapping) and population.get("online") is not None:
        sections.add("population")
    if isinstance(secure, Mapping) and secure.get("enabled"):
        sections.add("secure_aggregation")
    return sections


def _dotted(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` as ``{"a.b": 1}`` (lists are values)."""
    if not isinstance(tree, dict) or (prefix and not tree):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_dotted(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def changed_keys(old: Any, new: Any, skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Every dotted key whose value differs between two nested mappings, as ``key: old ->
    new`` (values as JSON, cut at 40 characters): what a refusal names."""
    was, now = _dotted(old), _dotted(new)
    keys = sorted((set(was) | set(now)) - set(skip))
    return [f"{k}: {_short(was.get(k))} -> {_short(now.get(k))}"
            for k in keys if was.get(k) != now.get(k)]  # fmt: skip


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def fleet_problem(rounds: RoundsConfig, devices: int) -> str | None:
    """Why ``rounds`` cannot run on ``devices`` devices, or None: the one rule, on values only.

    A rule that asked whether a key was *set* would differ between the aggregator (its file) and
    a device (the job document, which writes every default): the default count 20 is clamped to
    the fleet wherever it comes from, any other count above the fleet is refused."""
    k, n = rounds.clients_per_round, devices
    if k >= 1 and k > n and k != DEFAULT_CLIENTS_PER_ROUND:
        return (
            f"rounds.clients_per_round = {k:g} exceeds data.devices = {n}: at most {n} "
            "devices can take part in a round (or give a fraction in (0, 1))"
        )
    target, need = rounds.target(n), rounds.min_updates
    if rounds.mode == "sync" and need is not None and need > target:
        return (
            f"rounds.min_updates = {need} exceeds the {target} updates a round asks for "
            f"(rounds.clients_per_round with data.devices = {n}): a round cannot wait for "
            "more than it selects"
        )
    return None


def _describe(err: Mapping[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        near = difflib.get_close_matches(str(err["loc"][-1]), _keys_at(err["loc"][:-1]), n=1)
        hint = f"; did you mean {'.'.join([*map(str, err['loc'][:-1]), near[0]])}?" if near else ""
        return f"{key}: unknown key (value {value!r}){hint}"
    if err["type"] == "missing":
        return f"{key}: required key is missing"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"].startswith(("less", "greater", "literal", "string_pattern", "int", "float")):
        return f"{key} = {value!r}: {msg}"
    return f"{key}: {msg}"


def _keys_at(loc: Sequence[Any]) -> list[str]:
    """The keys the config section at ``loc`` (a path of section names) knows; none when the
    path does not lead to a section (what a typo is compared with)."""
    section: Any = JobConfig
    for part in loc:
        field = section.model_fields.get(part) if isinstance(part, str) else None
        section = field.annotation if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return []
    return list(section.model_fields)


def validate_config(data: dict[str, Any], source: str = "config") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe(e) for e in exc.errors()]
        raise ConfigError(f"invalid {source}:\n  " + "\n  ".join(lines)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    else:
        import yaml  # only here: a job configured without a YAML file does not pay for it

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping, got {type(data)}")
    return data


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Apply a command-line override ``a.b.c = value`` onto raw config data."""
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot override {dotted}: {part} is not a section")
        node = child
    node[last] = value


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> JobConfig:
    """File (optional) first, then overrides (``{"rounds.rounds": 5}``) on top, then validation."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise TypeError(
            f"overrides = {type(overrides).__name__}; a mapping of dotted keys to values, "
            'e.g. {"rounds.rounds": 5}'
        )
    data = read_config_file(path) if path else {}
    for key, value in (overrides or {}).items():
        if value is not None:
            set_path(data, key, value)
    return validate_config(data, source=f"config {path}" if path else "configuration")

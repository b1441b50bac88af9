"""Assemble a job's parts (data, model, device agents, aggregator core) from its config.

Shared by ``simulate``, ``aggregator``, ``fleet`` and ``device`` so that every entry point builds the
same thing from the same config; no I/O besides reading local dataset files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from edge_fl.config import ConfigError, JobConfig, set_path, validate_config
from edge_fl.data import known_datasets, load_federated, reads_files
from edge_fl.data.base import FederatedDataset
from edge_fl.device.agent import DeviceAgent, DeviceBudget
from edge_fl.fleet.clock import SimClock, VirtualClock
from edge_fl.identity import (
    STREAM_DEVICE,
    STREAM_INIT,
    STREAM_NOISE,
    STREAM_PROFILE,
    STREAM_SELECT,
    device_id,
)
from edge_fl.mechanisms import (
    GuaranteeMismatch,
    JobFacts,
    Mechanism,
    UnknownMechanismError,
    build_mechanism,
)
from edge_fl.models import evaluate, known_models, make_model, onnx_exporter
from edge_fl.models.base import Model
from edge_fl.models.training import LocalTraining
from edge_fl.privacy import accounting_available, calibration
from edge_fl.privacy.rng import RngInfo, make_generator
from edge_fl.protocol import Topics, UpdateLimits
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings, PrivacyAccounting
from edge_fl.server.robust import RobustAggregation, RobustSettings, resolve
from edge_fl.server.staleness import Staleness

log = logging.getLogger("edge_fl.job")


#: config sections that belong to one process, never to the job a device joins
DEVICE_LOCAL_SECTIONS = {"broker", "security", "fleet", "device", "ingest"}
#: config sections a job document carries only when enabled (an existing job's document, and
#: its config digest, stay what they were)
OPTIONAL_SECTIONS = {"secure_aggregation"}
#: config keys ("section.key") a job document carries only when set (not None), for the same
#: reason: the aggregator's own settings added after documents were first published
OPTIONAL_KEYS = {"rounds.period_s"}


#: ``device_factory(job, index) -> DeviceAgent``: the agent of device ``index`` (e.g. an attacker
#: for a robustness study); ``job.default_agent(index)`` is the honest one it may wrap
DeviceFactory = Callable[["Job", int], DeviceAgent]


#: guards the building of a job's evaluation session (the preload thread and the event loop)
_SESSION_LOCK = threading.Lock()


@dataclass
class Job:
    cfg: JobConfig
    dataset: FederatedDataset
    model: Model
    warnings: list[str] = field(default_factory=list)
    device_factory: DeviceFactory | None = None
    #: the calibration keys this job's mechanism looked up: its job document's ``cal`` rows
    calibrations: set[Any] = field(default_factory=set)
    _evaluation: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    @cached_property
    def mechanism(self) -> Mechanism:
        """The privacy mechanism, built and calibrated once for the job (from the registry)."""
        with calibration.scope(self.calibrations):
            return build_mechanism(self.cfg.privacy, self.facts)

    @cached_property
    def robust(self) -> RobustSettings:
        """The robust-aggregation options in effect (the config resolved against the mechanism)."""
        return resolve(self.cfg.robust, self.mechanism)

    @property
    def private(self) -> bool:
        return self.mechanism.accounts

    @cached_property
    def facts(self) -> JobFacts:
        sizes = dataset_sizes(self.dataset)
        r = self.cfg.rounds
        return JobFacts(
            rounds=r.rounds,
            # a population's rounds select among the devices online, not the whole population
            n_devices=self.expected_devices,
            expected_participants=float(self.target),
            n_params=self.model.n_params,
            local_lr=self.cfg.training.lr,
            local_epochs=self.cfg.training.epochs,
            batch_size=self.cfg.training.batch_size,
            min_dataset_size=int(np.min(sizes)),
            max_uploads=self.cfg.privacy.max_uploads
            or default_max_uploads(r.rounds, self.target, self.expected_devices, r.mode),
            mode=r.mode,
            dataset_sizes=sizes,
        )

    @property
    def topics(self) -> Topics:
        return Topics(self.cfg.job, self.cfg.broker.prefix)

    @property
    def expected_devices(self) -> int:
        """The devices that hold sessions and report a status: ``population.online`` when the
        job models a population, else ``data.devices``."""
        return self.cfg.population.online or self.cfg.data.devices

    @property
    def target(self) -> int:
        return self.cfg.rounds.target(self.cfg.data.devices)

    def rng(self, *stream: int) -> tuple[np.random.Generator, RngInfo]:
        return make_generator(self.cfg.seed, *stream, reproducible=self.cfg.reproducible)

    def initial_params(self) -> np.ndarray:
        # model initialisation is public, not private: always seeded, so runs are comparable
        return self.model.init_params(np.random.default_rng([self.cfg.seed, STREAM_INIT]))

    def agent(self, index: int) -> DeviceAgent:
        """Device ``index``'s agent: the job's ``device_factory``'s, else the honest one."""
        agent = (
            self.device_factory(self, index)
            if self.device_factory is not None
            else self.default_agent(index)
        )
        keys = self.device_keys
        if keys is not None and agent.secure is not None and self.cfg.device.id is None:
            # a simulated device: its minted key (``edge-fl device`` is given its own)
            from edge_fl.protocol.device_keys import private_key_path
            from edge_fl.protocol.signing import Signer

            directory = Path(self.cfg.security.device_keys or "").parent
            signer = Signer.load(private_key_path(directory, agent.device_id))
            agent.secure = agent.secure.signed(agent.device_id, signer, keys)
        return agent

    def check_device_keys(self, indices: range | None = None) -> None:
        """A simulated fleet's devices each have their minted private key, the one the
        directory lists (``security.device_keys``); ConfigError in one line otherwise."""
        keys = self.device_keys
        if keys is None:
            return
        from edge_fl.protocol.device_keys import private_key_path
        from edge_fl.protocol.signing import Signer

        directory = Path(self.cfg.security.device_keys or "").parent
        for index in indices or range(self.cfg.data.devices):
            device = device_id(index)
            path = private_key_path(directory, device)
            try:
                own = Signer.load(path).verifier.hex()
            except ValueError as exc:
                raise ConfigError(f"security.device_keys: {device}: {exc}") from None
            if device not in keys or keys.key_of(device).hex() != own:
                raise ConfigError(
                    f"security.device_keys: {path} is not the key the directory lists for "
                    f"{device} (mint the keys and the directory together: edge-fl keygen DIR "
                    "--devices N)"
                )

    @cached_property
    def device_keys(self) -> Any:
        """The devices' public signing keys (``security.device_keys``:
        ``edge_fl.protocol.device_keys.DeviceKeys``), or None: SecAgg+ messages unsigned."""
        path = self.cfg.security.device_keys
        if path is None:
            return None
        from edge_fl.protocol.device_keys import DeviceKeys

        return DeviceKeys.load(path)

    def default_agent(self, index: int) -> DeviceAgent:
        """The honest agent of device ``index``: its share of the data, the job's model,
        training, mechanism, budget and codec, and its own generator stream."""
        X, y = self.dataset.device_data(index)
        t = self.cfg.training
        rng, _ = self.rng(STREAM_DEVICE, index)
        p = self.cfg.privacy
        # the device's own ledger exists only to enforce a budget (it needs dp-accounting)
        enforce = self.private and p.budget_epsilon is not None
        budget = DeviceBudget(self.mechanism, p.budget_epsilon, p.delta) if enforce else None
        return DeviceAgent(
            device_id(index),
            X,
            y,
            self.model,
            LocalTraining(t.epochs, t.batch_size, t.lr),
            rng,
            mechanism=self.mechanism,
            budget=budget,
            codec=self.cfg.compression.build(),
            secure=self.secure_device,
        )

    @cached_property
    def secure_device(self) -> Any:
        """What a device needs for secure rounds (``edge_fl.device.agent.SecureDevice``): the
        mechanism's secure side and the job's facts; the round's parameters come signed in
        each global message. None without secure aggregation."""
        plan = self.secure_plan
        if plan is None:
            return None
        from edge_fl.device.agent import SecureDevice

        return SecureDevice(plan.mechanism, plan.job, plan.layout,
                            reproducible=self.cfg.reproducible, seed=self.cfg.seed,
                            neighbours=plan.neighbours, threshold=plan.threshold,
                            min_survivors=plan.min_survivors)  # fmt: skip

    def agents(self, indices: range | None = None) -> list[DeviceAgent]:
        return [self.agent(i) for i in indices or range(self.cfg.data.devices)]

    @property
    def global_dtype(self) -> str:
        """The global message's ``dt``: ``compression.downlink`` if set, else model.wire_dtype."""
        from edge_fl.protocol.codecs import downlink_tag

        downlink = self.cfg.compression.downlink
        if downlink is None:
            return self.cfg.model.wire_dtype
        return downlink_tag(downlink)

    def aggregator_core(self) -> AggregatorCore:
        r = self.cfg.rounds
        target = self.target
        settings = AggregatorSettings(
            job=self.cfg.job,
            rounds=r.rounds,
            target=target,
            # async windows apply whatever arrived by the deadline: one device is enough
            min_updates=r.minimum(target) if r.mode == "sync" else 1,
            deadline_s=self.clock.to_wall(r.deadline_s),  # the deadline is in simulated time
            period_s=None if r.period_s is None else self.clock.to_wall(r.period_s),
            extend_when_short=r.on_short_round == "extend",
            over_selection=r.over_selection,
            server_lr=r.server_lr,
            wire_dtype=self.global_dtype,
            config_digest=self.cfg.digest(),
            mechanism=self.cfg.privacy.mechanism,
            sample_rate=self.mechanism.selection_rate(),
            mode=r.mode,
            buffer_size=r.buffer_size,
            max_staleness=r.max_staleness,
            staleness=Staleness(r.staleness, r.staleness_a, r.staleness_b),
            # statuses of devices outside 0..N-1 (another job's, on a shared broker) are ignored
            population=self.cfg.data.devices,
        )
        rng, _ = self.rng(STREAM_SELECT)
        p = self.cfg.privacy
        m = self.mechanism
        limits = UpdateLimits(
            self.model.n_params,
            p.signds.max_dim_out,
            frozenset({m.wire_kind}),
            mechanism=m.name,
            signds_h=m.vote_size(),
        )
        privacy = PrivacyAccounting(self.mechanism, p.delta) if self.private else None
        # the mechanism with every strategy wrapped by the robust options (one norm reference per
        # core); the ledger above accounts with the mechanism itself
        mechanism: Any = (
            RobustAggregation(self.mechanism, self.robust) if self.robust.active else self.mechanism
        )
        extra: dict[str, Any] = {}
        if r.mode != "sync":  # the concurrency limit and its timeout, on the core's clock
            timeout = r.dispatch_timeout_s
            extra["concurrency"] = r.concurrency_limit(self.cfg.data.devices)
            extra["dispatch_timeout_s"] = None if timeout is None else self.clock.to_wall(timeout)
        plan = self.secure_plan
        if plan is not None:  # a round opens only with enough devices for its sum to count
            settings = replace(settings, min_updates=max(settings.min_updates, plan.min_survivors))
        if plan is not None and r.mode == "fedbuff":  # each buffer a SecAgg+ cohort
            extra = {"policy": self._cohort_policy(plan)}
        core = AggregatorCore(
            settings,
            self.initial_params(),
            limits,
            rng,
            evaluate=self._evaluator(),
            mechanism=mechanism,
            noise_rng=self.noise_rng,
            privacy=privacy,
            **extra,
        )
        core.secure = plan
        if self.cfg.reproducible:  # seeds only behind --reproducible (docs/protocol.md, nonce)
            seed = f"edge-fl round nonces {self.cfg.job} {self.cfg.seed}".encode()
            core.nonce_key = hashlib.sha256(seed).digest()
        return core

    def _cohort_policy(self, plan: Any) -> Callable[[Any], Any]:
        """Secure FedBuff: cohorts of the plan's ``selected`` devices, as many in flight as
        the concurrency limit holds (at least one; no limit: as many as the fleet holds)."""
        from edge_fl.server.cohorts import CohortPolicy

        c = self.cfg.rounds.concurrency_limit(self.cfg.data.devices) or self.cfg.data.devices
        in_flight = max(1, c // plan.selected)
        return lambda core: CohortPolicy(core, in_flight, plan.selected)

    @cached_property
    def secure_selected(self) -> int:
        """How many devices one secure round selects, the n its layout and noise are calibrated
        for: ceil(target x over_selection) in sync rounds, a FedBuff cohort's K' = ceil(K / (1 -
        dropout)); at most data.devices. The one rule: the engine's plan and ``edge-fl privacy
        plan`` both take it from here."""
        r = self.cfg.rounds
        selected = math.ceil(self.target * r.over_selection)
        if r.mode == "fedbuff":
            from edge_fl.server.cohorts import cohort_size

            selected = cohort_size(r.buffer_size, self.cfg.secure_aggregation.dropout)
        return min(selected, self.cfg.data.devices)

    @cached_property
    def secure_plan(self) -> Any:
        """The job's secure aggregation (``edge_fl.server.secure.SecurePlan``), or None."""
        sa = self.cfg.secure_aggregation
        if not sa.enabled:
            return None
        from edge_fl.mechanisms.secure import secure_sum
        from edge_fl.server.secure import plan_secure

        mech = secure_sum(self.mechanism)
        assert mech is not None  # build_job refused the combination
        # the mechanism calibrates its secure layout here (distributed-gaussian's sigma^2): in
        # the job's scope, so its row reaches the job document for devices without dp-accounting
        keys = self.device_keys  # a malicious operator: calibrated so that 2t > k
        with calibration.scope(self.calibrations):
            plan = plan_secure(sa, mech, self.model.n_params, self.secure_selected,
                               against_lying=keys is not None)  # fmt: skip
        return plan if keys is None else dataclasses.replace(plan, device_keys=keys)

    @cached_property
    def onnx(self) -> Callable[[np.ndarray], bytes] | None:
        """The model's ONNX export (``params -> bytes``), or None: a model without one is
        evaluated natively and leaves no model.onnx (``edge_fl.models.onnx_exporter``)."""
        return onnx_exporter(self.model)

    def _evaluator(self):
        """Held-out accuracy and loss of the global model, by default through onnxruntime: the
        model that is evaluated is exactly the ONNX file a device would run."""
        X_test, y_test = self.dataset.X_test, self.dataset.y_test
        to_onnx = self.onnx
        if self.cfg.model.evaluate_with == "native" or to_onnx is None:
            return lambda w: evaluate(self.model, w, X_test, y_test)
        model = self.model

        def with_onnxruntime(w: np.ndarray) -> tuple[float, float]:
            from edge_fl.models.onnx_layout import onnx_weights
            from edge_fl.models.onnx_runtime import OnnxClassifier

            session = self.evaluation_session()
            if session is None:
                return OnnxClassifier(to_onnx(w)).evaluate(X_test, y_test)
            session.set_weights(onnx_weights(model, w))
            return session.evaluate(X_test, y_test)

        return with_onnxruntime

    def evaluation_session(self) -> Any:
        """The one onnxruntime session that evaluates every round's weights, built once (None:
        a model whose graph is exported per round, a model's own ``onnx_bytes`` or torch).
        Thread-safe: ``simulate`` builds it on its preload thread while the broker starts and
        devices connect (about 10 ms of the first round otherwise)."""
        with _SESSION_LOCK:
            if "session" not in self._evaluation:
                from edge_fl.models.onnx_runtime import OnnxClassifier
                from edge_fl.models.onnx_template import template

                graph = None
                if not callable(getattr(self.model, "onnx_bytes", None)):
                    made = template(self.model)  # the numpy models, without importing onnx
                    if made is not None:
                        graph = made.with_weight_inputs
                    else:
                        from edge_fl.models.onnx_export import onnx_with_weight_inputs

                        graph = onnx_with_weight_inputs(self.model)
                self._evaluation["session"] = None if graph is None else OnnxClassifier(graph)
            return self._evaluation["session"]

    def export_model(self, params: np.ndarray, path: Any) -> bool:
        """Write the model with ``params`` to ``path`` as ONNX; False if it has no export."""
        if self.onnx is None:
            return False
        from pathlib import Path

        Path(path).write_bytes(self.onnx(params))
        return True

    @cached_property
    def clock(self) -> SimClock | VirtualClock:
        """Simulated time shared by the fleet and the aggregator's deadlines and records: the
        fleet's virtual clock under ``fleet.clock`` virtual (edge_fl.fleet.clock)."""
        f = self.cfg.fleet
        if f.virtual:
            return VirtualClock(start_s=f.start_hour * 3600.0)
        return SimClock(f.time_scale, start_s=f.start_hour * 3600.0)

    def profiles(self, indices: range | None = None) -> dict:
        """Each device's sampled profile (public modelling randomness: seeded)."""
        from edge_fl.fleet.profiles import load_profile

        fleet = load_profile(self.cfg.fleet.profile)
        rng = np.random.default_rng([self.cfg.seed, STREAM_PROFILE])
        sampled = fleet.sample(self.cfg.data.devices, rng)
        chosen = indices or range(self.cfg.data.devices)
        return {device_id(i): sampled[i] for i in chosen}

    @cached_property
    def signer(self) -> Any:
        """The aggregator's Ed25519 signer (``security.signing_key``), or None: unsigned."""
        if not self.cfg.security.signing_key:
            return None
        from edge_fl.protocol.signing import load_signer

        return load_signer(self.cfg.security.signing_key)

    def trust(self, verifier: Any = None) -> Any:
        """What devices accept as the aggregator's word: its signature (``verifier``, else
        ``security.public_key``, else none), the model size and a round window capped at the
        job's rounds (a version never exceeds them either)."""
        from edge_fl.device.runtime import Trust
        from edge_fl.protocol import GlobalWindow

        if verifier is None and self.cfg.security.public_key:
            from edge_fl.protocol.signing import load_verifier

            verifier = load_verifier(self.cfg.security.public_key)
        rounds = self.cfg.rounds.rounds
        return Trust(
            verifier=verifier,
            window=GlobalWindow(max_round=rounds, max_version=rounds),
            secure=self.cfg.secure_aggregation.enabled,
        )

    def fleet_runtime(
        self,
        spec: Any,
        indices: range | None = None,
        prefix: str | None = None,
        trust: Any = None,
    ):
        from edge_fl.fleet.runtime import Fleet

        if self.cfg.population.online is not None:
            from edge_fl.fleet.population import population_fleet

            return population_fleet(self, spec, indices, prefix=prefix, trust=trust)
        return Fleet(
            self.agents(indices),
            spec,
            self.topics,
            connect_concurrency=self.cfg.broker.connect_concurrency,
            keepalive_s=self.cfg.broker.keepalive_s,
            client_prefix=prefix,
            profiles=self.profiles(indices),
            clock=self.clock,
            dropout=self.cfg.fleet.dropout,
            train_workers=self.cfg.fleet.train_workers,
            machine_samples_per_s=self.cfg.fleet.machine_samples_per_s,
            digest=self.cfg.digest(),
            trust=trust or self.trust(),
        )

    def job_document(self) -> Any:
        """What a device needs to join (``edge_fl.protocol.jobdoc``): the job's settings without
        the aggregator's own (broker, keys, simulated-fleet behaviour, local paths) and every
        noise multiplier it calibrated, so a device without dp-accounting uses the same ones."""
        from edge_fl.protocol.jobdoc import JobDocument

        with calibration.scope(self.calibrations):
            self.mechanism.describe()  # calibrates every dataset size the job has (DP-SGD)
        local = set(DEVICE_LOCAL_SECTIONS)
        if not self.cfg.secure_aggregation.enabled:
            local |= OPTIONAL_SECTIONS  # an existing job's document stays as it was
        config = self.cfg.model_dump(mode="json", exclude=local)
        for key in OPTIONAL_KEYS:
            section, name = key.split(".")
            if config[section][name] is None:
                del config[section][name]
        config["data"]["data_dir"] = None  # where the data lives is each device's own business
        cal = calibration.table(self.calibrations)  # this job's rows, not the process's
        return JobDocument(self.cfg.job, self.cfg.digest(), config, cal)

    @cached_property
    def noise_rng(self) -> np.random.Generator:
        """The aggregator's noise (central Gaussian, NbAFL downlink): one stream for the job."""
        return self.rng(STREAM_NOISE)[0]

    def _public_config(self) -> dict:
        """The config as run.json and trackers keep it: the broker URL without its password."""
        config = self.cfg.model_dump()
        url = config["broker"].get("url")
        if url:
            from edge_fl.transport.url import parse_broker_url

            try:
                config["broker"]["url"] = parse_broker_url(url).redacted()
            except ValueError:
                config["broker"]["url"] = "<unparsable URL, not shown>"
        return config

    def metadata(self) -> dict:
        _, info = self.rng(0)
        return {
            "job": self.cfg.job,
            "config": self._public_config(),
            "config_digest": self.cfg.digest(),
            "model": {"name": self.model.name, "n_params": self.model.n_params},
            "dataset": {
                "name": self.dataset.name,
                "devices": self.dataset.n_devices,
                "train": getattr(self.dataset, "n_train", None) or len(self.dataset.y_train),
                "test": len(self.dataset.y_test),
            },
            "randomness": {"generator": info.kind, "secure": info.secure, "seed": info.seed},
            "privacy": self.mechanism.describe(),
            "robust": self.robust.describe(),
            "started_at": time.time(),
            "warnings": self.warnings,
        }


def dataset_sizes(dataset: Any) -> Any:
    """Every device's training-set size: a lazily drawn population's int32 array (never its
    rows), else a tuple from the partition."""
    sizes = getattr(dataset, "train_sizes", None)
    return sizes if sizes is not None else tuple(len(ix) for ix in dataset.device_indices)


def build_job(
    cfg: JobConfig,
    *,
    dataset: FederatedDataset | None = None,
    model: Model | None = None,
    device_factory: DeviceFactory | None = None,
    noise_must_fit: bool = True,
    evaluates: bool = True,
) -> Job:
    """The job ``cfg`` describes, every part built and checked before anything runs.

    ``dataset`` / ``model``: objects to use instead of the registered ``data.dataset`` /
    ``model.name`` (the config then takes their names and the dataset's device count, unless it
    sets another count: an error). ``device_factory``: see :data:`DeviceFactory`. Every name the
    config gives (model, dataset, mechanism, codec) must be registered: ConfigError lists the
    known ones. ``noise_must_fit=False`` builds a job whose local noise the decoder would refuse
    (to observe how refused releases are charged); every other check still holds.
    ``evaluates=False``: a device's build, which never evaluates the global model, so the
    aggregator's evaluation settings do not concern it (``edge-fl device``)."""
    if dataset is not None or model is not None:
        cfg = _adopt(cfg, dataset, model)
    check_registered(cfg, dataset=dataset is None, model=model is None)
    d = cfg.data
    data: Any = dataset  # a FederatedDataset, or a population's lazily drawn one
    if cfg.population.online is not None:
        from edge_fl.data.lazy_synthetic import lazy_dataset

        if dataset is not None or device_factory is not None:
            what = "a dataset object" if dataset is not None else "a device_factory"
            raise ConfigError(
                f"invalid configuration:\n  population: {what} does not apply to a modelled "
                "population (its devices draw their data lazily)"
            )
        try:
            data = lazy_dataset(cfg)
        except ValueError as exc:
            raise ConfigError(f"invalid configuration:\n  population: {exc}") from None
    elif data is None:
        try:
            data = load_federated(
                d.dataset,
                d.devices,
                partition=d.partition,
                alpha=d.alpha,
                seed=cfg.seed,
                data_dir=d.data_dir,
                samples_per_device=d.samples_per_device,
            )
        except ValueError as exc:  # a fleet the data cannot cover, say: one line, not a traceback
            raise ConfigError(f"invalid configuration:\n  data: {exc}") from None
    if model is None:
        options = {"hidden": cfg.model.hidden} if cfg.model.name == "mlp" else {}
        model = make_model(cfg.model.name, data.n_features, data.n_classes, **options)
    _check_fit(model, data)
    cfg = cfg.with_data_identity(_data_identity(cfg, data, given=dataset is not None))
    job = Job(cfg, data, model, device_factory=device_factory)
    try:
        mechanism = job.mechanism  # built now, so a bad privacy setting fails before anything runs
    except (UnknownMechanismError, ValueError) as exc:
        raise ConfigError(f"invalid configuration:\n  privacy: {exc}") from None
    problems = [_unenforceable_budget(cfg, mechanism)]
    if noise_must_fit:
        problems.append(_noise_beyond_limit(job, mechanism))
    for problem in problems:
        if problem is not None:
            raise ConfigError(f"invalid configuration:\n  privacy: {problem}")
    if cfg.security.device_keys is not None:
        try:
            job.device_keys  # noqa: B018 (read now: a bad directory fails before anything runs)
        except ValueError as exc:
            raise ConfigError(f"invalid configuration:\n  security.device_keys: {exc}") from None
    refusal = secure_refusal(cfg, mechanism)
    if refusal is None and cfg.secure_aggregation.enabled:
        try:
            job.secure_plan  # noqa: B018 (calibrated or checked now: an unsound one fails here)
        except ValueError as exc:
            refusal = str(exc).removeprefix("secure_aggregation: ")
    if refusal is not None:
        raise ConfigError(f"invalid configuration:\n  secure_aggregation: {refusal}")
    # the events it would charge, against its guarantee: a mislabelled epsilon fails here. Not
    # on a device of the base install (no dp-accounting): it composes no epsilon, and the
    # aggregator's ledger checks every event it charges
    if mechanism.accounts and accounting_available():
        try:
            plan = job.secure_plan if cfg.secure_aggregation.enabled else None
            mechanism.check_guarantee(plan.job if plan is not None else None)
        except GuaranteeMismatch as exc:
            raise ConfigError(f"invalid configuration:\n  privacy: {exc}") from None
    try:
        job.robust  # noqa: B018 (resolved now: a setting the mechanism cannot take fails here)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration:\n  robust: {exc}") from None
    if evaluates and job.onnx is None and cfg.model.evaluate_with == "onnxruntime":
        if "evaluate_with" in cfg.model.model_fields_set:
            raise ConfigError(
                f"invalid configuration:\n  model.evaluate_with = 'onnxruntime': model "
                f"{model.name!r} has no ONNX export (give it onnx_bytes(params), or use 'native')"
            )
        job.warnings.append(
            f"model {model.name!r} has no ONNX export: the aggregator evaluates it natively and "
            "writes no model.onnx"
        )
    for warning in mechanism.warnings():
        job.warnings.append(warning)
    for warning in job.warnings:
        log.warning("%s", warning)
    return job


def _data_identity(cfg: JobConfig, data: Any, *, given: bool) -> str | None:
    """What ``data.data_dir`` means for the config digest: the fingerprint of what the job read
    from it, or None where it changes nothing (a bundled or generated dataset, a dataset object,
    a lazily drawn population)."""
    d = cfg.data
    if given or d.data_dir is None or cfg.population.online is not None:
        return None
    if not reads_files(d.dataset):
        return None
    return data.fingerprint()


def secure_refusal(cfg: JobConfig, mechanism: Mechanism) -> str | None:
    """Why the job cannot run secure aggregation (one line), or None."""
    if not cfg.secure_aggregation.enabled:
        return None
    from edge_fl.mechanisms.secure import secure_sum

    if secure_sum(mechanism) is None:
        return (
            f"privacy.mechanism = {cfg.privacy.mechanism!r} cannot run under secure aggregation "
            "(it does not implement SecureSum, edge_fl/mechanisms/secure.py)"
        )
    if cfg.rounds.mode == "fedasync":
        return (
            "rounds.mode = 'fedasync': a buffer of one update is a cohort of one, whose sum is "
            "that device's update (no secrecy); use fedbuff (buffer_size >= 2) or sync"
        )
    if cfg.rounds.mode == "fedbuff":
        problem = _cohort_refusal(cfg)
        if problem is not None:
            return problem
    if cfg.privacy.poisson_selection:
        return "privacy.poisson_selection: a secure round needs its roster in the global message"
    if cfg.ingest.workers and cfg.ingest.partition == "site":
        # workers sum the masked inputs (shared or hash partition: docs/protocol.md, "Ingest
        # workers"); site brokers would also need every device's inbox bridged down to them
        return (
            "ingest.partition = 'site': secure rounds are sharded over one broker (shared or "
            "hash partition)"
        )
    if cfg.compression.uplink is not None:
        return (
            f"compression.uplink = {cfg.compression.uplink!r}: a masked input has its own "
            "encoding; drop the uplink codec"
        )
    if cfg.population.online is not None:
        return "population.online: secure rounds need every device to hold a session"
    return None


def _cohort_refusal(cfg: JobConfig) -> str | None:
    """Why a secure FedBuff job (cohorts, edge_fl/server/cohorts.py) cannot run, or None."""
    r, sa = cfg.rounds, cfg.secure_aggregation
    if r.buffer_size < 2:
        return "rounds.buffer_size = 1: a cohort of one has no secrecy (its sum is its update)"
    from edge_fl.server.cohorts import cohort_size

    size = cohort_size(r.buffer_size, sa.dropout)
    if size > cfg.data.devices:
        return (
            f"a cohort of K' = ceil(buffer_size {r.buffer_size} / (1 - dropout {sa.dropout:g})) "
            f"= {size} devices exceeds data.devices = {cfg.data.devices}"
        )
    return None


def budget_refusal(mechanism: Mechanism) -> str | None:
    """Why ``privacy.budget_epsilon`` is refused with ``mechanism``, or None (it is enforced).

    A per-device budget is enforced by each device from its own releases' events; a mechanism
    whose cost is charged per applied round (central noise) leaves the device nothing to count,
    so the budget would be reported but never kept: such a job is refused before it starts
    (``edge-fl privacy plan`` says so)."""
    if not mechanism.accounts or not mechanism.round_events():
        return None
    return (
        f"privacy.budget_epsilon cannot be enforced with privacy.mechanism = "
        f"{mechanism.name!r} (its noise is added by the aggregator, so a device cannot count "
        "what it spent): drop the budget and bound the job with privacy.epsilon or rounds.rounds"
    )


def _unenforceable_budget(cfg: JobConfig, mechanism: Mechanism) -> str | None:
    why = budget_refusal(mechanism)
    if cfg.privacy.budget_epsilon is None or why is None:
        return None
    return why.replace(
        "privacy.budget_epsilon", f"privacy.budget_epsilon = {cfg.privacy.budget_epsilon:g}", 1
    )


#: an honest job is refused when its noise alone would make more than this share of honest
#: updates implausible to the decoder
REFUSED_SHARE = 0.01


def _noise_beyond_limit(job: Job, mechanism: Mechanism) -> str | None:
    """Local Gaussian noise N(0, sigma^2) on each of d coordinates against the decoder's
    plausibility limit M (UpdateLimits.max_abs): an update with any |value| > M is refused.

    The rule: refuse the job when P(max_i |N(0, sigma^2)| > M) over the d coordinates exceeds
    REFUSED_SHARE, i.e. when the 99th percentile of the largest |noise| of an update is beyond
    M. The noise alone is a lower bound on the refusal probability (by Anderson's inequality
    adding the clipped delta, symmetric noise only moves more mass beyond M), so a job refused
    here would see at least 1% of its honest updates refused."""
    if mechanism.name != "gaussian":
        return None
    limit = UpdateLimits(job.model.n_params).max_abs
    if limit is None:
        return None
    params = mechanism.describe()
    sigma = float(params["noise_multiplier"]) * float(params["clip_l2"])
    d = job.model.n_params
    p_one = math.erfc(limit / (sigma * math.sqrt(2.0)))  # P(|N(0, sigma^2)| > M), one coordinate
    p_any = -math.expm1(d * math.log1p(-p_one)) if p_one < 1.0 else 1.0
    if p_any <= REFUSED_SHARE:
        return None
    from statistics import NormalDist

    tail = -math.expm1(math.log1p(-REFUSED_SHARE) / d)  # per-coordinate tail of the 99th pct
    peak = sigma * NormalDist().inv_cdf(1.0 - tail / 2.0)
    return (
        f"the gaussian noise (sigma = z {params['noise_multiplier']:.4g} x clip "
        f"{params['clip_l2']:g} = {sigma:.4g} per coordinate) reaches |x| = {peak:.4g} over "
        f"{d} coordinates (99th percentile), beyond the decoder's plausibility limit "
        f"{limit:g}: {p_any:.0%} of honest updates would be refused; lower privacy.clip or "
        "raise privacy.epsilon / lower privacy.noise_multiplier"
    )


def check_registered(cfg: JobConfig, *, dataset: bool = True, model: bool = True) -> None:
    """Every registry name in ``cfg`` is registered in this process, and the uplink codec is
    sound with the mechanism; ConfigError has one line per problem, listing the known names.

    Names are checked here, when the job is built, rather than by the config's schema, so that a
    model, dataset, mechanism or codec registered from Python is a valid name."""
    from edge_fl.mechanisms import check_combination, mechanism_class, mechanism_names
    from edge_fl.protocol.codecs import codec_names, downlink_names

    checks = [
        ("privacy.mechanism", cfg.privacy.mechanism, mechanism_names(), "privacy mechanism"),
        ("compression.uplink", cfg.compression.uplink, codec_names(), "codec"),
        ("compression.downlink", cfg.compression.downlink, downlink_names(), "downlink codec"),
    ]
    if model:
        checks.append(("model.name", cfg.model.name, tuple(known_models()), "model"))
    if dataset and cfg.population.online is None:
        checks.append(("data.dataset", cfg.data.dataset, tuple(known_datasets()), "dataset"))
    problems = [
        f"{key} = {value!r}: unknown {kind} {value!r}; one of: {', '.join(known)}"
        for key, value, known, kind in checks
        if value is not None and value not in known
    ]
    codec, mechanism = cfg.compression.uplink, cfg.privacy.mechanism
    if not problems and codec is not None:
        why = check_combination(mechanism, codec)
        if why is not None:
            problems.append(
                f"compression.uplink = {codec!r} is not sound with privacy.mechanism = "
                f"{mechanism!r}: {why}"
            )
    if not problems:  # a mechanism registered after the config was loaded: its options now
        try:
            options = mechanism_class(mechanism).validate_options(cfg.privacy.options)
        except ValueError as exc:
            problems.append(f"privacy.{exc}")
        else:
            if options != cfg.privacy.options:  # its defaults written in, as a load would
                cfg.privacy.options = options
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def _adopt(cfg: JobConfig, dataset: FederatedDataset | None, model: Model | None) -> JobConfig:
    """``cfg`` naming the given objects: their names, and the dataset's device count (a count
    the config sets explicitly must agree)."""
    data = cfg.model_dump(exclude_unset=True)  # what was set stays set (e.g. clients_per_round)
    if dataset is not None:
        n = dataset.n_devices
        if "devices" in cfg.data.model_fields_set and cfg.data.devices != n:
            raise ConfigError(
                f"invalid configuration:\n  data.devices = {cfg.data.devices}: the dataset "
                f"{dataset.name!r} given is split over {n} devices"
            )
        set_path(data, "data.devices", n)
        set_path(data, "data.dataset", dataset.name)
    if model is not None:
        set_path(data, "model.name", model.name)
    return validate_config(data, source="configuration (with the objects given)")


def _check_fit(model: Model, dataset: Any) -> None:
    """The model takes the dataset's rows and labels."""
    if model.n_features != dataset.n_features or model.n_classes < dataset.n_classes:
        raise ConfigError(
            f"invalid configuration:\n  model {model.name!r} takes {model.n_features} features "
            f"and {model.n_classes} classes; dataset {dataset.name!r} has {dataset.n_features} "
            f"and {dataset.n_classes}"
        )


def default_max_uploads(rounds: int, target: int, devices: int, mode: str) -> int:
    """L when not configured: T with full participation; else the 99.9th percentile of the
    Binomial(T, K/N) number of times uniform selection picks one device (async: T)."""
    if mode != "sync" or target >= devices:
        return rounds
    p = target / devices
    # the PMF in log space: comb(T, k) p^k overflows a float from T ~ 1,030 on
    log_p, log_q, log_t = math.log(p), math.log1p(-p), math.lgamma(rounds + 1)
    total = 0.0
    for k in range(rounds + 1):
        log_c = log_t - math.lgamma(k + 1) - math.lgamma(rounds - k + 1)
        total += math.exp(log_c + k * log_p + (rounds - k) * log_q)
        if total >= 0.999:
            return max(1, k)
    return rounds

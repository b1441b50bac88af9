"""Assemble a job's parts (data, model, device agents, aggregator core) from its config.

Shared by ``simulate``, ``aggregator``, ``fleet`` and ``device`` so that every entry point builds the
same thing from the same config; no I/O besides reading local dataset files.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from edge_fl.config import JobConfig
from edge_fl.data import load_federated
from edge_fl.data.base import FederatedDataset
from edge_fl.device.agent import DeviceAgent, DeviceBudget
from edge_fl.device.trainer import LocalTraining
from edge_fl.fleet.clock import SimClock
from edge_fl.models import evaluate, make_model
from edge_fl.models.base import Model
from edge_fl.privacy.rng import RngInfo, make_generator
from edge_fl.protocol import Topics, UpdateLimits
from edge_fl.server.aggregator import AggregatorCore, AggregatorSettings, PrivacyAccounting
from edge_fl.server.asynchronous import AsyncAggregatorCore
from edge_fl.server.staleness import Staleness
from edge_fl.server.strategy import FedAvg, Strategy

log = logging.getLogger("edge_fl.job")

# generator streams, so that the aggregator and each device draw independent randomness
STREAM_INIT, STREAM_SELECT, STREAM_DEVICE, STREAM_NOISE, STREAM_PROFILE = 1, 2, 3, 4, 5


def device_id(index: int) -> str:
    return f"d{index:05d}"


@dataclass
class Job:
    cfg: JobConfig
    dataset: FederatedDataset
    model: Model
    warnings: list[str] = field(default_factory=list)

    @property
    def private(self) -> bool:
        return self.cfg.privacy.mechanism != "none"

    @cached_property
    def mechanisms(self) -> Any:
        """The privacy mechanisms (None without privacy: no dp-accounting import, no cost)."""
        if not self.private:
            return None
        from edge_fl.privacy.release import JobFacts, build_mechanisms

        sizes = [len(ix) for ix in self.dataset.device_indices]
        facts = JobFacts(
            rounds=self.cfg.rounds.rounds,
            n_devices=self.cfg.data.devices,
            expected_participants=float(self.target),
            local_lr=self.cfg.training.lr,
            local_epochs=self.cfg.training.epochs,
            batch_size=self.cfg.training.batch_size,
            min_dataset_size=min(sizes),
        )
        return build_mechanisms(self.cfg.privacy, facts)

    @property
    def topics(self) -> Topics:
        return Topics(self.cfg.job, self.cfg.broker.prefix)

    @property
    def target(self) -> int:
        return self.cfg.rounds.target(self.cfg.data.devices)

    def rng(self, *stream: int) -> tuple[np.random.Generator, RngInfo]:
        return make_generator(self.cfg.seed, *stream, reproducible=self.cfg.reproducible)

    def initial_params(self) -> np.ndarray:
        # model initialisation is public, not private: always seeded, so runs are comparable
        return self.model.init_params(np.random.default_rng([self.cfg.seed, STREAM_INIT]))

    def agent(self, index: int) -> DeviceAgent:
        X, y = self.dataset.device_data(index)
        t = self.cfg.training
        rng, _ = self.rng(STREAM_DEVICE, index)
        rule = budget = None
        if self.private:
            from edge_fl.device.rules import rule_for

            p = self.cfg.privacy
            rule = rule_for(self.mechanisms)
            budget = DeviceBudget(self.mechanisms, p.budget_epsilon, p.delta, p.accountant)
        return DeviceAgent(
            device_id(index),
            X,
            y,
            self.model,
            LocalTraining(t.epochs, t.batch_size, t.lr),
            rng,
            rule=rule,
            budget=budget,
        )

    def agents(self, indices: range | None = None) -> list[DeviceAgent]:
        return [self.agent(i) for i in indices or range(self.cfg.data.devices)]

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
            extend_when_short=r.on_short_round == "extend",
            over_selection=r.over_selection,
            server_lr=r.server_lr,
            wire_dtype=self.cfg.model.wire_dtype,
            config_digest=self.cfg.digest(),
            mechanism=self.cfg.privacy.mechanism,
            sample_rate=self._poisson_rate(),
            mode=r.mode,
            buffer_size=r.buffer_size,
            max_staleness=r.max_staleness,
            staleness=Staleness(r.staleness, r.staleness_a, r.staleness_b),
        )
        rng, _ = self.rng(STREAM_SELECT)
        p = self.cfg.privacy
        kinds = frozenset({"s"}) if p.mechanism == "signds" else frozenset({"u"})
        limits = UpdateLimits(self.model.n_params, p.signds.max_dim_out, kinds)
        privacy = (
            PrivacyAccounting(self.mechanisms, p.delta, p.accountant) if self.private else None
        )
        core_class = AggregatorCore if r.mode == "sync" else AsyncAggregatorCore
        core = core_class(
            settings,
            self.initial_params(),
            limits,
            rng,
            evaluate=self._evaluator(),
            strategy_factory=lambda _r: self._strategy(core),
            privacy=privacy,
        )
        if p.mechanism == "signds":
            from edge_fl.privacy.magrr import MagRRState

            core.signds_state = MagRRState.initial(self.mechanisms.magrr).to_dict()
        return core

    def _evaluator(self):
        """Held-out accuracy and loss of the global model, by default through onnxruntime: the
        model that is evaluated is exactly the ONNX file a device would run."""
        X_test, y_test = self.dataset.X_test, self.dataset.y_test
        if self.cfg.model.evaluate_with == "native":
            return lambda w: evaluate(self.model, w, X_test, y_test)

        def with_onnxruntime(w: np.ndarray) -> tuple[float, float]:
            from edge_fl.models.onnx_export import onnx_bytes
            from edge_fl.models.onnx_runtime import OnnxClassifier

            return OnnxClassifier(onnx_bytes(self.model, w)).evaluate(X_test, y_test)

        return with_onnxruntime

    def export_model(self, params: np.ndarray, path: Any) -> None:
        from edge_fl.models.onnx_export import export_onnx

        export_onnx(self.model, params, path)

    @cached_property
    def clock(self) -> SimClock:
        """Simulated time shared by the fleet and the aggregator's deadlines and records."""
        f = self.cfg.fleet
        return SimClock(f.time_scale, start_s=f.start_hour * 3600.0)

    def profiles(self, indices: range | None = None) -> dict:
        """Each device's sampled profile (public modelling randomness: seeded)."""
        from edge_fl.fleet.profiles import load_profile

        fleet = load_profile(self.cfg.fleet.profile)
        rng = np.random.default_rng([self.cfg.seed, STREAM_PROFILE])
        sampled = fleet.sample(self.cfg.data.devices, rng)
        chosen = indices or range(self.cfg.data.devices)
        return {device_id(i): sampled[i] for i in chosen}

    def fleet_runtime(self, spec: Any, indices: range | None = None, prefix: str | None = None):
        from edge_fl.fleet.runtime import Fleet

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
            digest=self.cfg.digest(),
        )

    @cached_property
    def noise_rng(self) -> np.random.Generator:
        """The aggregator's noise (central Gaussian, NbAFL downlink): one stream for the job."""
        return self.rng(STREAM_NOISE)[0]

    def _poisson_rate(self) -> float | None:
        p = self.cfg.privacy
        if p.mechanism == "gaussian-central" and p.poisson_selection:
            return self.mechanisms.central_gaussian.sampling_rate
        return None

    def _strategy(self, core: AggregatorCore) -> Strategy:
        """A fresh aggregation strategy for one round, per mechanism."""
        from edge_fl.server import strategy as st

        n, lr, m = self.model.n_params, self.cfg.rounds.server_lr, self.mechanisms
        name = self.cfg.privacy.mechanism
        if name == "gaussian-central":
            return st.CentralGaussianSum(n, m.central_gaussian, self.noise_rng, lr)
        if name == "nbafl":
            return st.NbAflFedAvg(n, lr, nbafl=m.nbafl, rng=self.noise_rng)
        if name == "signds":
            from edge_fl.privacy.magrr import MagRRState

            return st.SignDSAggregate(
                n,
                MagRRState.from_dict(core.signds_state),
                m.magrr,
                m.signds.global_lr,
                expected_n=self.target,
            )
        return FedAvg(n, lr)

    def metadata(self) -> dict:
        _, info = self.rng(0)
        return {
            "job": self.cfg.job,
            "config": self.cfg.model_dump(),
            "config_digest": self.cfg.digest(),
            "model": {"name": self.model.name, "n_params": self.model.n_params},
            "dataset": {
                "name": self.dataset.name,
                "devices": self.dataset.n_devices,
                "train": len(self.dataset.y_train),
                "test": len(self.dataset.y_test),
            },
            "randomness": {"generator": info.kind, "secure": info.secure, "seed": info.seed},
            "privacy": self.mechanisms.describe() if self.private else {"mechanism": "none"},
            "started_at": time.time(),
            "warnings": self.warnings,
        }


def build_job(cfg: JobConfig) -> Job:
    d = cfg.data
    dataset = load_federated(
        d.dataset,
        d.devices,
        partition=d.partition,
        alpha=d.alpha,
        seed=cfg.seed,
        data_dir=d.data_dir,
        samples_per_device=d.samples_per_device,
    )
    options = {"hidden": cfg.model.hidden} if cfg.model.name == "mlp" else {}
    model = make_model(cfg.model.name, dataset.n_features, dataset.n_classes, **options)
    job = Job(cfg, dataset, model)
    if cfg.privacy.mechanism == "signds":
        from edge_fl.privacy.signds import check_dimension

        for warning in check_dimension(job.mechanisms.signds, model.n_params):
            log.warning("%s", warning)
            job.warnings.append(warning)
    return job

"""Assemble a job's parts (data, model, device agents, aggregator core) from its config.

Shared by ``simulate``, ``aggregator``, ``fleet`` and ``device`` so that every entry point builds the
same thing from the same config; no I/O besides reading local dataset files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edge_fl.config import JobConfig
from edge_fl.data import load_federated
from edge_fl.data.base import FederatedDataset
from edge_fl.device.agent import DeviceAgent
from edge_fl.device.trainer import LocalTraining
from edge_fl.models import evaluate, make_model
from edge_fl.models.base import Model
from edge_fl.privacy.rng import RngInfo, make_generator
from edge_fl.protocol import Topics, UpdateLimits
from edge_fl.server.aggregator import AggregatorCore, SyncSettings

# generator streams, so that the aggregator and each device draw independent randomness
STREAM_INIT, STREAM_SELECT, STREAM_DEVICE = 1, 2, 3


def device_id(index: int) -> str:
    return f"d{index:05d}"


@dataclass
class Job:
    cfg: JobConfig
    dataset: FederatedDataset
    model: Model

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
        return DeviceAgent(
            device_id(index), X, y, self.model, LocalTraining(t.epochs, t.batch_size, t.lr), rng
        )

    def agents(self, indices: range | None = None) -> list[DeviceAgent]:
        return [self.agent(i) for i in indices or range(self.cfg.data.devices)]

    def aggregator_core(self) -> AggregatorCore:
        r = self.cfg.rounds
        target = self.target
        settings = SyncSettings(
            job=self.cfg.job,
            rounds=r.rounds,
            target=target,
            min_updates=r.minimum(target),
            deadline_s=r.deadline_s,
            extend_when_short=r.on_short_round == "extend",
            over_selection=r.over_selection,
            server_lr=r.server_lr,
            wire_dtype=self.cfg.model.wire_dtype,
            config_digest=self.cfg.digest(),
            mechanism=self.cfg.privacy.mechanism,
        )
        rng, _ = self.rng(STREAM_SELECT)
        X_test, y_test = self.dataset.X_test, self.dataset.y_test
        return AggregatorCore(
            settings,
            self.initial_params(),
            UpdateLimits(self.model.n_params),
            rng,
            evaluate=lambda w: evaluate(self.model, w, X_test, y_test),
        )

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
            "started_at": time.time(),
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
    model = make_model(
        cfg.model.name, dataset.n_features, dataset.n_classes, hidden=cfg.model.hidden
    )
    return Job(cfg, dataset, model)

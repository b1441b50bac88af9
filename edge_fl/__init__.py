"""edge-fl: private, bandwidth-frugal asynchronous federated learning over MQTT.

The public Python API (docs/api.md). Every name is imported on first use, so ``import edge_fl``
stays cheap and works on the device-only install (no server extra, no torch)::

    import edge_fl

    cfg = edge_fl.load_config("job.yaml", {"rounds.rounds": 5})
    result = edge_fl.run_simulation(cfg)  # in a notebook: await edge_fl.run_simulation_async(cfg)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "ConfigError": "edge_fl.config",
    "JobConfig": "edge_fl.config",
    "load_config": "edge_fl.config",
    "FederatedDataset": "edge_fl.data.base",
    "register_dataset": "edge_fl.data",
    "known_datasets": "edge_fl.data",
    "Model": "edge_fl.models.base",
    "register_model": "edge_fl.models",
    "known_models": "edge_fl.models",
    "TorchModule": "edge_fl.models.torch_module",
    "LocalTraining": "edge_fl.models.training",
    "local_sgd": "edge_fl.models.training",
    "evaluate": "edge_fl.models",
    "DeviceAgent": "edge_fl.device.agent",
    "register_mechanism": "edge_fl.mechanisms",
    "register_codec": "edge_fl.protocol.codecs",
    "Job": "edge_fl.job",
    "build_job": "edge_fl.job",
    "AggregatorRun": "edge_fl.simulation",
    "SimulationResult": "edge_fl.simulation",
    "run_simulation": "edge_fl.simulation",
    "run_simulation_async": "edge_fl.simulation",
}

__all__ = [
    "AggregatorRun",
    "ConfigError",
    "DeviceAgent",
    "FederatedDataset",
    "Job",
    "JobConfig",
    "LocalTraining",
    "Model",
    "SimulationResult",
    "TorchModule",
    "__version__",
    "build_job",
    "evaluate",
    "known_datasets",
    "known_models",
    "load_config",
    "local_sgd",
    "register_codec",
    "register_dataset",
    "register_mechanism",
    "register_model",
    "run_simulation",
    "run_simulation_async",
]

if TYPE_CHECKING:
    from edge_fl.config import ConfigError, JobConfig, load_config
    from edge_fl.data import known_datasets, register_dataset
    from edge_fl.data.base import FederatedDataset
    from edge_fl.device.agent import DeviceAgent
    from edge_fl.job import Job, build_job
    from edge_fl.mechanisms import register_mechanism
    from edge_fl.models import evaluate, known_models, register_model
    from edge_fl.models.base import Model
    from edge_fl.models.torch_module import TorchModule
    from edge_fl.models.training import LocalTraining, local_sgd
    from edge_fl.protocol.codecs import register_codec
    from edge_fl.simulation import (
        AggregatorRun,
        SimulationResult,
        run_simulation,
        run_simulation_async,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'edge_fl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

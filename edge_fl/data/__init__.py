"""Federated datasets by name.

Every loader has the uniform signature
``loader(n_devices, *, partition, alpha, seed, **options) -> FederatedDataset``
and is registered under a name. Data generation and splitting use seeded numpy generators: they
decide the experiment, not privacy, and must be reproducible across runs and machines.

Partitions: ``partition=None`` means the dataset's own default. digits and mnist take "iid"
(default) | "dirichlet" (with ``alpha`` and option ``min_size``). synthetic, synthetic-iid and
femnist have a natural partition (one distribution / one writer per device; synthetic-iid one
distribution for every device): they take "natural" (default) and also "iid", the generic default
of job configs, meaning "no re-partitioning"; "dirichlet" is rejected.

Options: the job-level knobs in :data:`SHARED_OPTIONS` (``data_dir``, ``samples_per_device``) are
passed only to loaders that take them, so one job config can drive every dataset; any other option a
loader does not take is an error. mnist and femnist need ``data_dir``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from edge_fl.data.base import FederatedDataset
from edge_fl.data.digits import load_digits_federated
from edge_fl.data.partition import TooManyDevicesError, partition_dirichlet, partition_iid
from edge_fl.data.synthetic import (
    load_synthetic_federated,
    load_synthetic_iid_federated,
    make_synthetic,
)

__all__ = [
    "SHARED_OPTIONS",
    "FederatedDataset",
    "known_datasets",
    "load_federated",
    "make_synthetic",
    "partition_dirichlet",
    "partition_iid",
    "reads_files",
    "register_dataset",
]

DatasetLoader = Callable[..., FederatedDataset]

SHARED_OPTIONS = frozenset({"data_dir", "samples_per_device"})


def _need_data_dir(name: str, data_dir: str | None) -> str:
    if data_dir is None:
        raise ValueError(
            f"dataset {name!r} reads local files: set data.data_dir to their directory "
            "(--data-dir DIR on the command line)"
        )
    return data_dir


def _load_mnist(
    n_devices: int,
    *,
    partition: str | None = None,
    alpha: float = 0.5,
    seed: int = 0,
    data_dir: str | None = None,
    min_size: int = 1,
) -> FederatedDataset:
    from edge_fl.data.mnist import load_mnist  # lazy: keeps this package importable on its own

    where = _need_data_dir("mnist", data_dir)
    return load_mnist(where, n_devices, partition or "iid", alpha, seed, min_size=min_size)


def _load_femnist(
    n_devices: int,
    *,
    partition: str | None = None,
    alpha: float = 0.5,
    seed: int = 0,
    data_dir: str | None = None,
) -> FederatedDataset:
    from edge_fl.data.femnist import load_femnist

    del alpha
    if partition not in (None, "natural", "iid"):
        raise ValueError(
            f"partition={partition!r} for femnist; it is partitioned by writer only "
            "(pass 'natural' or omit it)"
        )
    return load_femnist(_need_data_dir("femnist", data_dir), n_devices, seed)


_LOADERS: dict[str, DatasetLoader] = {
    "digits": load_digits_federated,
    "synthetic": load_synthetic_federated,
    "synthetic-iid": load_synthetic_iid_federated,
    "mnist": _load_mnist,
    "femnist": _load_femnist,
}


def register_dataset(name: str, loader: DatasetLoader) -> None:
    """Register (or replace) the loader for ``name``."""
    if not name or not isinstance(name, str):
        raise ValueError(f"dataset name={name!r}; must be a non-empty string")
    _LOADERS[name] = loader


def known_datasets() -> list[str]:
    return sorted(_LOADERS)


def reads_files(name: str) -> bool:
    """Whether dataset ``name``'s loader reads ``data_dir`` (a loader taking ``**kwargs`` may)."""
    loader = _LOADERS.get(name)
    if loader is None:
        return False
    accepted = _accepted_options(loader)
    return accepted is None or "data_dir" in accepted


def _accepted_options(loader: DatasetLoader) -> set[str] | None:
    """Keyword names the loader takes, or None if it takes ``**kwargs``."""
    params = inspect.signature(loader).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {p.name for p in params if p.kind in kinds}


def load_federated(
    name: str,
    n_devices: int,
    *,
    partition: str | None = None,
    alpha: float = 0.5,
    seed: int = 0,
    **options,
) -> FederatedDataset:
    """Load dataset ``name`` split over ``n_devices``; see the module docstring for partitions."""
    try:
        loader = _LOADERS[name]
    except KeyError:
        raise ValueError(
            f"dataset={name!r} is unknown; known datasets: {known_datasets()}"
        ) from None
    accepted = _accepted_options(loader)
    if accepted is not None:
        options = {k: v for k, v in options.items() if k in accepted or k not in SHARED_OPTIONS}
        unknown = sorted(set(options) - accepted)
        if unknown:
            allowed = sorted(accepted - {"n_devices", "partition", "alpha", "seed"})
            raise ValueError(f"dataset {name!r} takes no option(s) {unknown}; allowed: {allowed}")
    try:
        return loader(n_devices, partition=partition, alpha=alpha, seed=seed, **options)
    except TooManyDevicesError as exc:  # in the config's words, not the partitioner's
        raise ValueError(
            f"data.devices = {exc.n_devices} exceeds the {exc.n_samples} training samples of "
            f"{name}: every device needs at least one"
        ) from None

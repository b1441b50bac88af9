"""FEMNIST from local LEAF JSON files, partitioned naturally: one device per writer.

LEAF (Caldas et al. 2018) stores each split as one or more JSON files
``{"users": [...], "num_samples": [...], "user_data": {user: {"x": [[784 floats]], "y": [int]}}}``
under ``DIR/train/*.json`` and ``DIR/test/*.json``. Nothing is downloaded: the files must exist.

Why writers are devices: the writer split is what makes FEMNIST a realistic non-IID benchmark
(per-writer styles and class mixes), so no synthetic partitioner is applied. The test set holds the
test samples of the selected writers when the split was made per sample (LEAF ``-t sample``: the
same users appear in train and test); when it was made per user (``-t user``: disjoint users), all
test users are kept.

Every file is validated before use and errors name the file: missing directories or files,
malformed JSON, missing keys, ``num_samples`` that disagree with the data, wrong row lengths, labels
out of range.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from edge_fl.data.base import FederatedDataset

__all__ = [
    "FEMNIST_CLASSES",
    "FEMNIST_FEATURES",
    "LeafFormatError",
    "load_femnist",
    "read_leaf_json",
    "read_leaf_split",
    "write_leaf_dir",
    "write_leaf_json",
]

FEMNIST_CLASSES = 62  # digits, upper- and lower-case letters
FEMNIST_FEATURES = 28 * 28

UserData = dict[str, tuple[np.ndarray, np.ndarray]]


class LeafFormatError(ValueError):
    """A LEAF JSON file that does not have the expected structure or content."""


def read_leaf_json(
    path: str | Path, n_features: int = FEMNIST_FEATURES, n_classes: int = FEMNIST_CLASSES
) -> UserData:
    """One LEAF file as {user: (X float32 (n, n_features), y int64 (n,))}, in file order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"LEAF JSON file not found: {path}")
    try:
        with path.open("rb") as fh:
            doc = json.load(fh)
    except json.JSONDecodeError as exc:
        raise LeafFormatError(
            f"{path}: malformed JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except UnicodeDecodeError as exc:
        raise LeafFormatError(f"{path}: not UTF-8 text ({exc.reason})") from None

    if not isinstance(doc, dict):
        raise LeafFormatError(f"{path}: top level must be an object, got {type(doc).__name__}")
    for key, kind in (("users", list), ("num_samples", list), ("user_data", dict)):
        if key not in doc:
            raise LeafFormatError(f"{path}: missing key {key!r}")
        if not isinstance(doc[key], kind):
            raise LeafFormatError(
                f"{path}: {key!r} must be a JSON {'array' if kind is list else 'object'}"
            )
    users, counts, user_data = doc["users"], doc["num_samples"], doc["user_data"]
    if len(users) != len(counts):
        raise LeafFormatError(
            f"{path}: inconsistent num_samples: {len(users)} users but {len(counts)} counts"
        )
    if len(set(users)) != len(users):
        raise LeafFormatError(f"{path}: duplicate user ids in 'users'")
    if set(user_data) != set(users):
        extra = sorted(set(user_data) - set(users))[:3]
        missing = sorted(set(users) - set(user_data))[:3]
        raise LeafFormatError(
            f"{path}: 'user_data' keys do not match 'users' (missing {missing}, extra {extra})"
        )

    out: UserData = {}
    for user, declared in zip(users, counts, strict=True):
        entry = user_data.pop(user)  # release the Python lists as we convert
        where = f"{path}: user {user!r}"
        if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
            raise LeafFormatError(f"{where}: entry must be an object with 'x' and 'y'")
        xs, ys = entry["x"], entry["y"]
        if not isinstance(xs, list) or not isinstance(ys, list):
            raise LeafFormatError(f"{where}: 'x' and 'y' must be arrays")
        if not isinstance(declared, int) or isinstance(declared, bool):
            raise LeafFormatError(f"{where}: num_samples entry {declared!r} is not an integer")
        if not len(xs) == len(ys) == declared:
            raise LeafFormatError(
                f"{where}: inconsistent num_samples: declared {declared}, "
                f"found {len(xs)} x rows and {len(ys)} y labels"
            )
        out[str(user)] = (
            _features(xs, n_features, where),
            _labels(ys, n_classes, where),
        )
    return out


def _features(xs: list, n_features: int, where: str) -> np.ndarray:
    if not xs:
        return np.zeros((0, n_features), dtype=np.float32)
    try:
        X = np.asarray(xs, dtype=np.float32)
    except (ValueError, TypeError):
        lengths = sorted({len(r) if isinstance(r, list) else -1 for r in xs})
        raise LeafFormatError(
            f"{where}: wrong shape: 'x' rows must be lists of {n_features} numbers "
            f"(found row lengths {lengths[:5]}, -1 = not a list)"
        ) from None
    if X.ndim != 2 or X.shape[1] != n_features:
        raise LeafFormatError(f"{where}: wrong shape: 'x' must be (n, {n_features}), got {X.shape}")
    if not np.all(np.isfinite(X)):
        raise LeafFormatError(f"{where}: 'x' contains NaN or infinity")
    return X


def _labels(ys: list, n_classes: int, where: str) -> np.ndarray:
    if not ys:
        return np.zeros(0, dtype=np.int64)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ys):
        raise LeafFormatError(f"{where}: 'y' must hold integer labels")
    y = np.asarray(ys, dtype=np.int64)
    if y.min() < 0 or y.max() >= n_classes:
        raise LeafFormatError(
            f"{where}: labels must lie in [0, {n_classes}), got range [{y.min()}, {y.max()}]"
        )
    return y


def read_leaf_split(
    split_dir: str | Path, n_features: int = FEMNIST_FEATURES, n_classes: int = FEMNIST_CLASSES
) -> UserData:
    """All ``*.json`` files of one split directory (sorted by name), merged by user."""
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        raise FileNotFoundError(f"LEAF split directory not found: {split_dir}")
    files = sorted(split_dir.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no LEAF *.json files in {split_dir}")
    merged: UserData = {}
    origin: dict[str, Path] = {}
    for f in files:
        for user, data in read_leaf_json(f, n_features, n_classes).items():
            if user in merged:
                raise LeafFormatError(f"user {user!r} appears in both {origin[user]} and {f}")
            merged[user] = data
            origin[user] = f
    return merged


def load_femnist(
    data_dir: str | Path,
    n_devices: int | None = None,
    seed: int = 0,
    *,
    n_features: int = FEMNIST_FEATURES,
    n_classes: int = FEMNIST_CLASSES,
) -> FederatedDataset:
    """FEMNIST from ``data_dir/train/*.json`` and ``data_dir/test/*.json``, one device per writer.

    ``n_devices=None`` uses every writer with training data; a smaller number takes a subset of
    writers chosen by ``seed`` (kept in file order); a larger number is an error, since writers
    cannot be split without destroying the natural partition.
    """
    if n_devices is not None and (
        isinstance(n_devices, bool) or not isinstance(n_devices, int | np.integer) or n_devices < 1
    ):
        raise ValueError(f"n_devices={n_devices!r}; must be an integer >= 1 or None")
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"FEMNIST data_dir not found: {root}")
    train_dir, test_dir = root / "train", root / "test"
    train = read_leaf_split(train_dir, n_features, n_classes)
    writers = [u for u, (_, y) in train.items() if y.size > 0]
    if not writers:
        raise LeafFormatError(f"{train_dir}: no writer has any training sample")
    if n_devices is None:
        n_devices = len(writers)
    if n_devices > len(writers):
        raise ValueError(
            f"n_devices={n_devices} exceeds the {len(writers)} writers with training data in "
            f"{train_dir}; FEMNIST is partitioned by writer, so use n_devices <= {len(writers)}"
        )
    if n_devices < len(writers):
        rng = np.random.default_rng(np.random.SeedSequence([seed, 2]))
        keep = np.sort(rng.choice(len(writers), size=n_devices, replace=False))
        writers = [writers[i] for i in keep]

    X_train, y_train, bounds = _stack([train[u] for u in writers], n_features)
    train_users = set(train)
    del train
    device_indices = tuple(np.arange(a, b, dtype=np.int64) for a, b in itertools.pairwise(bounds))

    test = read_leaf_split(test_dir, n_features, n_classes)
    per_sample_split = not train_users.isdisjoint(test)  # LEAF -t sample vs -t user
    test_users = [u for u in writers if u in test] if per_sample_split else list(test)
    X_test, y_test, _ = _stack([test[u] for u in test_users], n_features)
    if y_test.size == 0:
        raise ValueError(
            f"the {len(writers)} selected writers have no samples in {test_dir}; "
            "cannot build a held-out set"
        )
    return FederatedDataset(
        name="femnist",
        X_train=X_train,
        y_train=y_train,
        X_test=X_test,
        y_test=y_test,
        n_classes=n_classes,
        device_indices=device_indices,
    )


def _stack(
    parts: Sequence[tuple[np.ndarray, np.ndarray]], n_features: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Concatenate into preallocated arrays (one copy, not two, for the full 800k-image set)."""
    sizes = [y.size for _, y in parts]
    bounds = [0, *np.cumsum(sizes, dtype=np.int64).tolist()]
    X = np.empty((bounds[-1], n_features), dtype=np.float32)
    y = np.empty(bounds[-1], dtype=np.int64)
    for (Xu, yu), a, b in zip(parts, bounds[:-1], bounds[1:], strict=True):
        X[a:b] = Xu
        y[a:b] = yu
    return X, y, bounds


def write_leaf_json(
    path: str | Path, user_data: Mapping[str, tuple[np.ndarray, np.ndarray]]
) -> Path:
    """Write {user: (X, y)} as one LEAF JSON file (for fixtures and for converting own data)."""
    path = Path(path)
    users, counts, data = [], [], {}
    for user, (X, y) in user_data.items():
        X, y = np.asarray(X, dtype=np.float32), np.asarray(y)
        if X.ndim != 2 or y.shape != (X.shape[0],):
            raise ValueError(
                f"user {user!r}: X must be 2-D and y 1-D of equal length, got {X.shape}, {y.shape}"
            )
        users.append(str(user))
        counts.append(int(X.shape[0]))
        data[str(user)] = {"x": X.tolist(), "y": [int(v) for v in y]}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        json.dump({"users": users, "num_samples": counts, "user_data": data}, fh)
    return path


def write_leaf_dir(
    data_dir: str | Path,
    train: Mapping[str, tuple[np.ndarray, np.ndarray]],
    test: Mapping[str, tuple[np.ndarray, np.ndarray]],
    files_per_split: int = 1,
) -> Path:
    """Write a LEAF directory ``data_dir/{train,test}/part_{i}.json``, users spread over files."""
    if files_per_split < 1:
        raise ValueError(f"files_per_split={files_per_split!r}; must be >= 1")
    root = Path(data_dir)
    for split, users in (("train", train), ("test", test)):
        names = list(users)
        per_file = max(1, math.ceil(len(names) / files_per_split))
        for i in range(files_per_split):
            chunk = names[i * per_file : (i + 1) * per_file]
            write_leaf_json(root / split / f"part_{i}.json", {u: users[u] for u in chunk})
    return root

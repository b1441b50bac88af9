"""MNIST from local IDX files (optionally gzipped), spread over devices by a partitioner.

IDX (LeCun's format): two zero bytes, a type code, the number of dimensions, each dimension as a
big-endian uint32, then the data in row-major order. The magic number (bytes 0-3 read as a
big-endian int) is 2051 for MNIST images (uint8, 3 dims) and 2049 for labels (uint8, 1 dim).
Nothing is downloaded: the four files must be in ``data_dir`` (``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each possibly
with ``.gz``; the ``train-images.idx3-ubyte`` spelling of some mirrors is accepted too).
Fashion-MNIST uses the same files and loads the same way.

Headers and sizes are validated before any data is used, and errors name the file: a wrong magic
number, a truncated or oversized payload, counts that differ between images and labels.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from edge_fl.data.base import FederatedDataset
from edge_fl.data.partition import partition_dirichlet, partition_iid

__all__ = [
    "IDX_IMAGES_MAGIC",
    "IDX_LABELS_MAGIC",
    "MNIST_CLASSES",
    "IdxFormatError",
    "find_mnist_file",
    "load_mnist",
    "load_mnist_arrays",
    "read_idx",
    "write_idx",
]

MNIST_CLASSES = 10
IDX_IMAGES_MAGIC = 2051  # 0x00000803: uint8, 3 dims
IDX_LABELS_MAGIC = 2049  # 0x00000801: uint8, 1 dim

# IDX type code -> big-endian numpy dtype
_CODES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


class IdxFormatError(ValueError):
    """An IDX file whose header or size is not what it should be."""


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped if it is gzip (by content, not only by name)."""
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    raw = path.read_bytes()
    if raw[:2] != _GZIP_MAGIC:
        if path.suffix == ".gz":
            raise IdxFormatError(f"{path}: named .gz but is not gzip data")
        return raw
    try:
        return gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise IdxFormatError(f"{path}: corrupt or truncated gzip data ({exc})") from None


def read_idx(path: str | Path, expected_magic: int | None = None) -> np.ndarray:
    """An IDX file as a native-endian array of its declared shape."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4:
        raise IdxFormatError(f"{path}: truncated header ({len(data)} bytes, need at least 4)")
    magic = int.from_bytes(data[:4], "big")
    if expected_magic is not None and magic != expected_magic:
        raise IdxFormatError(
            f"{path}: bad magic number {magic} (0x{magic:08x}); expected {expected_magic} "
            f"(0x{expected_magic:08x})"
        )
    if data[0] != 0 or data[1] != 0 or data[2] not in _CODES or data[3] == 0:
        raise IdxFormatError(
            f"{path}: bad magic number {magic} (0x{magic:08x}); an IDX file starts with two zero "
            f"bytes, a type code in {{{', '.join(f'0x{c:02x}' for c in _CODES)}}} and ndim >= 1"
        )
    dtype, ndim = _CODES[data[2]], data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxFormatError(
            f"{path}: truncated header ({len(data)} bytes, {ndim} dims need {header})"
        )
    dims = struct.unpack(f">{ndim}I", data[4:header])
    expected = math.prod(dims) * dtype.itemsize
    found = len(data) - header
    if found < expected:
        raise IdxFormatError(
            f"{path}: truncated data: dims {dims} need {expected} bytes after the header, "
            f"found {found}"
        )
    if found > expected:
        raise IdxFormatError(
            f"{path}: {found - expected} unexpected trailing bytes after {expected} bytes of data "
            f"for dims {dims}"
        )
    arr = np.frombuffer(data, dtype=dtype, count=math.prod(dims), offset=header)
    return arr.reshape(dims).astype(dtype.newbyteorder("="))


def write_idx(path: str | Path, array: np.ndarray, dtype: str | np.dtype | None = None) -> Path:
    """Write ``array`` as IDX (gzipped if the name ends in .gz); for fixtures and conversions.

    ``dtype`` (e.g. "uint8" for MNIST labels held as int64) converts first; integer values outside
    the target range are an error rather than silently wrapped.
    """
    path = Path(path)
    a = np.asarray(array)
    if dtype is not None:
        target = np.dtype(dtype)
        if target.kind in "iu" and a.size:
            info = np.iinfo(target)
            if a.min() < info.min or a.max() > info.max:
                raise ValueError(
                    f"array values [{a.min()}, {a.max()}] do not fit dtype={target} "
                    f"[{info.min}, {info.max}]"
                )
        a = a.astype(target)
    code = next(
        (
            c
            for c, dt in _CODES.items()
            if (dt.kind, dt.itemsize) == (a.dtype.kind, a.dtype.itemsize)
        ),
        None,
    )
    if code is None:
        raise ValueError(
            f"array dtype {a.dtype} has no IDX type; allowed: uint8, int8, int16, int32, "
            "float32, float64 (pass dtype= to convert)"
        )
    if not 1 <= a.ndim <= 255 or any(d >= 2**32 for d in a.shape):
        raise ValueError(f"array shape {a.shape}: IDX needs 1..255 dims, each < 2**32")
    payload = (
        bytes([0, 0, code, a.ndim])
        + struct.pack(f">{a.ndim}I", *a.shape)
        + np.ascontiguousarray(a, dtype=_CODES[code]).tobytes()
    )
    if path.suffix == ".gz":
        payload = gzip.compress(payload, mtime=0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    return path


def find_mnist_file(data_dir: str | Path, stem: str) -> Path:
    """``data_dir/stem`` in any accepted spelling (plain, .gz, '.idx' instead of '-idx')."""
    root = Path(data_dir)
    names = [stem, stem.replace("-idx", ".idx")]
    candidates = [root / f"{n}{ext}" for n in names for ext in ("", ".gz")]
    for c in candidates:
        if c.is_file():
            return c
    raise FileNotFoundError(
        f"MNIST file {stem!r} not found in {root} "
        f"(looked for {', '.join(c.name for c in candidates)})"
    )


def _load_pair(
    data_dir: Path, prefix: str, n_classes: int
) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    img_path = find_mnist_file(data_dir, f"{prefix}-images-idx3-ubyte")
    lab_path = find_mnist_file(data_dir, f"{prefix}-labels-idx1-ubyte")
    images = read_idx(img_path, IDX_IMAGES_MAGIC)
    labels = read_idx(lab_path, IDX_LABELS_MAGIC)
    if images.shape[0] != labels.shape[0]:
        raise IdxFormatError(
            f"{img_path} has {images.shape[0]} images but {lab_path} has {labels.shape[0]} labels"
        )
    if images.shape[0] == 0:
        raise IdxFormatError(f"{img_path}: holds no images")
    if labels.max() >= n_classes:
        raise IdxFormatError(
            f"{lab_path}: labels must lie in [0, {n_classes}), found {int(labels.max())}"
        )
    n, rows, cols = images.shape
    X = images.reshape(n, rows * cols).astype(np.float32)
    X /= np.float32(255.0)
    return X, labels.astype(np.int64), (rows, cols)


def load_mnist_arrays(
    data_dir: str | Path, n_classes: int = MNIST_CLASSES
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(X_train, y_train, X_test, y_test): pixels scaled to [0, 1] float32, images flattened."""
    root = Path(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"MNIST data_dir not found: {root}")
    X_tr, y_tr, shape_tr = _load_pair(root, "train", n_classes)
    X_te, y_te, shape_te = _load_pair(root, "t10k", n_classes)
    if shape_tr != shape_te:
        raise IdxFormatError(
            f"{root}: train images are {shape_tr[0]}x{shape_tr[1]} but test images are "
            f"{shape_te[0]}x{shape_te[1]}"
        )
    return X_tr, y_tr, X_te, y_te


def load_mnist(
    data_dir: str | Path,
    n_devices: int,
    partition: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    *,
    min_size: int = 1,
    n_classes: int = MNIST_CLASSES,
) -> FederatedDataset:
    """MNIST with its training set spread over ``n_devices`` ("iid" or "dirichlet"(alpha))."""
    if partition not in ("iid", "dirichlet"):
        raise ValueError(f"partition={partition!r} for mnist; allowed: 'iid', 'dirichlet'")
    X_tr, y_tr, X_te, y_te = load_mnist_arrays(data_dir, n_classes)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 1]))
    if partition == "iid":
        parts = partition_iid(y_tr.size, n_devices, rng)
    else:
        parts = partition_dirichlet(y_tr, n_devices, alpha, rng, min_size=min_size)
    return FederatedDataset(
        name="mnist",
        X_train=X_tr,
        y_train=y_tr,
        X_test=X_te,
        y_test=y_te,
        n_classes=n_classes,
        device_indices=tuple(parts),
    )

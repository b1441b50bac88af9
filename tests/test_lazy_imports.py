"""The default job imports only what it uses: built-in mechanisms, SecAgg+ (cryptography),
randomgen and yaml are imported on first use, not when ``edge_fl.simulation`` is.

Each check runs in a fresh interpreter: this process has imported everything already."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# what `import edge_fl.simulation` and the default job's config must not import (each is used by
# some jobs only: SecAgg+, the other mechanisms, a YAML file, accounting, the ONNX preload)
NOT_FOR_THE_DEFAULT_JOB = (
    "cryptography",
    "randomgen",
    "yaml",
    "scipy",
    "dp_accounting",
    "onnx",
    "onnxruntime",
    "edge_fl.secagg.aggregator",
    "edge_fl.secagg.device",
    "edge_fl.secagg.driver",
    "edge_fl.secagg.graph",
    "edge_fl.secagg.primitives",
    "edge_fl.secagg.ddg",
    "edge_fl.mechanisms.signds",
    "edge_fl.mechanisms.distributed_gaussian",
    "edge_fl.mechanisms.dpsgd",
    "edge_fl.mechanisms.gaussian",
    "edge_fl.mechanisms.gaussian_central",
    "edge_fl.mechanisms.laplace",
    "edge_fl.mechanisms.nbafl",
    "edge_fl.privacy.events",
)


def fresh(code: str) -> object:
    """Run ``code`` in a new interpreter; it prints one JSON value, returned."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def imported(names: tuple[str, ...]) -> list[str]:
    return fresh(
        f"""
        import json, sys
        import edge_fl.simulation
        from edge_fl.config import load_config
        from edge_fl.mechanisms import mechanism_class

        cfg = load_config()
        mechanism_class(cfg.privacy.mechanism)
        names = {names!r}
        print(json.dumps(sorted(m for m in sys.modules if m in names or m.startswith(
            tuple(n + "." for n in names)))))
        """
    )  # type: ignore[return-value]


def test_the_default_job_imports_only_what_it_uses() -> None:
    assert imported(NOT_FOR_THE_DEFAULT_JOB) == []
    # the check sees what is imported: the default job's own modules are listed
    used = ("edge_fl.config", "edge_fl.mechanisms.none", "edge_fl.mechanisms.signds_settings")
    assert imported(used) == sorted(used)


def test_a_builtin_is_imported_on_first_lookup_and_listed_before() -> None:
    out = fresh(
        """
        import json, sys
        from edge_fl.mechanisms import mechanism_class, mechanism_names, registered

        before = "edge_fl.mechanisms.laplace" in sys.modules
        listed = "laplace" in mechanism_names() and registered("laplace")
        listed_only = "edge_fl.mechanisms.laplace" in sys.modules
        cls = mechanism_class("laplace")
        print(json.dumps([before, listed, listed_only, cls.__module__]))
        """
    )
    assert out == [False, True, False, "edge_fl.mechanisms.laplace"]


def test_the_wire_layer_validates_mp_of_a_builtin_not_imported_yet() -> None:
    """A device that receives a global message for a built-in it has not imported validates its
    ``mp`` through that built-in's schema (the registry hands the wire layer a resolver)."""
    out = fresh(
        """
        import json, sys
        import edge_fl.mechanisms
        from edge_fl.protocol import PayloadRejected, check_mechanism_params

        before = "edge_fl.mechanisms.signds" in sys.modules
        try:
            check_mechanism_params({"m": "signds", "lr": 0.1, "ep": 1, "bs": 8, "zz": 1})
            reason = None
        except PayloadRejected as exc:
            reason = exc.reason.value
        print(json.dumps([before, reason, "edge_fl.mechanisms.signds" in sys.modules]))
        """
    )
    assert out[0] is False and out[2] is True
    assert out[1] == "unknown_field"


def test_a_builtin_name_is_taken_before_the_builtin_is_imported() -> None:
    out = fresh(
        """
        import json
        from edge_fl.mechanisms import register_mechanism
        from edge_fl.mechanisms.base import Mechanism

        class Own(Mechanism):
            name = "nbafl"

        try:
            register_mechanism("nbafl", Own)
            error = None
        except ValueError as exc:
            error = str(exc)
        print(json.dumps(error))
        """
    )
    assert out == "mechanism 'nbafl' is already registered (NbAfl)"

#!/usr/bin/env bash
# The project's test command (README, CI). On a fresh machine it installs what the tests need:
# Mosquitto (apt-get, when missing), the package with its dev extras in .venv, and torch (pinned;
# from the default index, which serves the CUDA build to most machines: install the CPU build first
# from PyTorch's CPU index, see README) for the torch tests. Tests start their own brokers on free
# ports.
#   tools/test.sh              # CI subset: everything not marked slow/bench
#   EDGE_FL_SLOW=1 tools/test.sh   # also the slow tests
#   EDGE_FL_TORCH=0 tools/test.sh  # skip installing torch (torch tests then skip)
#   EDGE_FL_WORKERS=0 tools/test.sh  # one pytest process (default: 2 xdist workers)
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! command -v mosquitto >/dev/null 2>&1 && [ ! -x /usr/sbin/mosquitto ]; then
    echo "== installing mosquitto (apt-get)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mosquitto mosquitto-clients openssl >/dev/null
fi
# The dashboard's browser test (tests/test_dashboard_browser.py) drives Debian's headless Chromium
# through its chromedriver (the test skips, naming the missing binary, only where they are absent).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    echo "== installing chromium chromium-driver (apt-get)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null
fi
# The broker matrix (tests/test_broker_matrix.py) also runs on NATS and RabbitMQ: the tests start
# private nodes on free ports (never the packages' own services) and skip, naming the missing
# binary, when one is absent; so a failed install here is a warning, not an error.
ENGINES=""
if ! command -v nats-server >/dev/null 2>&1 && [ ! -x /usr/sbin/nats-server ]; then
    ENGINES="nats-server"
fi
if [ ! -x /usr/lib/rabbitmq/bin/rabbitmq-server ]; then
    ENGINES="$ENGINES rabbitmq-server"
fi
if [ -n "$ENGINES" ]; then
    echo "== installing $ENGINES (apt-get)"
    { $SUDO apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $ENGINES >/dev/null; } \
        || echo "== could not install $ENGINES: the broker-matrix tests for them skip"
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "== creating .venv"
    "$PY" -m venv .venv
fi
echo "== installing edge-fl[dev]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import edge_fl, aiomqtt, dp_accounting, onnxruntime" # fail loudly if the install did not
if [ "${EDGE_FL_TORCH:-1}" != "0" ] && ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "== installing torch==2.13.0 from the default index (progress below; can be GB)"
    .venv/bin/python -m pip install --progress-bar on --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "is ignored" | grep -E "Collecting|Downloading|Successfully|ERROR" || true
fi

.venv/bin/python -c "import torch; print('== torch', torch.__version__, 'CUDA' if torch.version.cuda else 'CPU', 'build')" 2>/dev/null || echo "== torch not installed (torch tests skip)"

echo "== ruff"
.venv/bin/ruff check edge_fl tests tools examples
.venv/bin/ruff format --check edge_fl tests tools examples

echo "== import contracts (.importlinter)"
.venv/bin/lint-imports --config .importlinter

echo "== mypy (mypy.ini)"
.venv/bin/python -m mypy

echo "== pytest"
# Byte-compile the package once, as pip does when it installs a wheel: with PYTHONDONTWRITEBYTECODE
# set (as on the CI machines) every edge-fl process a test starts would otherwise compile ~110
# modules from source (0.2-0.7 s of CPU each; BENCHMARKS.md section 1).
.venv/bin/python -m compileall -q edge_fl >/dev/null
MARKS="not slow and not bench"
[ "${EDGE_FL_SLOW:-0}" = "1" ] && MARKS="not bench"
# Two pytest-xdist workers (most tests wait on brokers and subprocesses, so two nearly halve the
# wall time on 2 cores); tests that must not run beside each other share an xdist_group.
# EDGE_FL_WORKERS=0 runs in one process; a later -n in "$@" wins.
exec .venv/bin/python -m pytest -m "$MARKS" -n "${EDGE_FL_WORKERS:-2}" --dist loadgroup \
    --durations=25 "$@"

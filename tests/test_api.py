"""The public Python API (docs/api.md): what a Flower user brings (model, data, attacker) and
how a job runs from a script, a notebook's event loop, and after a crash."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest
from helpers import mechanisms_registered

import edge_fl
from edge_fl.config import ConfigError
from edge_fl.models.logreg import LogisticRegression
from edge_fl.simulation import RunDirError


def small(**overrides):
    base = {
        "job": f"api-{uuid.uuid4().hex[:8]}",
        "model.name": "logreg",
        "data.devices": 6,
        "rounds.rounds": 3,
        "rounds.clients_per_round": 6,
    }
    return edge_fl.load_config(None, {**base, **overrides})


def blobs(n=300, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    x = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])[y] + rng.normal(size=(n, 2))
    return x[: n - 60], y[: n - 60], x[n - 60 :], y[n - 60 :]


class OwnLogreg(LogisticRegression):
    """A model of one's own (the packaged logreg's math under another name and class)."""

    name = "own-logreg"


# --------------------------------------------------------------------------- the package


def test_import_is_cheap_and_every_public_name_resolves():
    code = (
        "import sys, edge_fl; heavy = {'numpy', 'pydantic', 'torch', 'rich', 'onnx', 'aiomqtt'};"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    for name in edge_fl.__all__:
        if name == "TorchModule" and not _has_torch():
            continue
        assert getattr(edge_fl, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        edge_fl.nope  # noqa: B018


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------- registries


REGISTERED = """
import numpy as np
import edge_fl
from edge_fl.models.logreg import LogisticRegression

class OwnLogreg(LogisticRegression):
    name = "own-logreg"

rng = np.random.default_rng(0)
y = rng.integers(0, 3, size=300)
x = np.array([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])[y] + rng.normal(size=(300, 2))

def blobs(n_devices, *, partition=None, alpha=0.5, seed=0):
    return edge_fl.FederatedDataset.from_arrays(
        x[:240], y[:240], x[240:], y[240:], devices=n_devices, seed=seed)

edge_fl.register_model("mynet", OwnLogreg)
edge_fl.register_dataset("mydata", blobs)
cfg = edge_fl.load_config(None, {"model.name": "mynet", "data.dataset": "mydata",
                                 "data.devices": 6, "rounds.clients_per_round": 6})
job = edge_fl.build_job(cfg)
assert isinstance(job.model, OwnLogreg), job.model
print(job.dataset.n_devices, job.dataset.n_features, job.model.n_classes)
"""


def test_a_registered_model_and_dataset_are_valid_names():
    """register_model('mynet', ...) then model.name = 'mynet' (refused by a Literal before).
    In its own interpreter: a registration lasts as long as the process."""
    done = subprocess.run(
        [sys.executable, "-c", REGISTERED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["6", "2", "3"]


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        ({"model.name": "mynet"}, "model.name = 'mynet': unknown model 'mynet'; one of: "),
        ({"data.dataset": "mydata"}, "data.dataset = 'mydata': unknown dataset 'mydata'; one of: "),
        ({"privacy.mechanism": "mine"}, "privacy.mechanism = 'mine': unknown privacy mechanism"),
        (
            {"compression.uplink": "zip"},
            "compression.uplink = 'zip': unknown codec 'zip'; one of: ",
        ),
    ],
)
def test_an_unregistered_name_fails_at_build_with_the_known_names(overrides, line):
    cfg = small(**overrides)  # a well-formed name loads: it may be registered later
    with pytest.raises(ConfigError) as info:
        edge_fl.build_job(cfg)
    text = str(info.value)
    assert line in text
    key = next(iter(overrides))
    known = {
        "model.name": edge_fl.known_models(),
        "data.dataset": edge_fl.known_datasets(),
    }.get(key, [])
    assert all(name in text for name in known)  # every registered name is listed
    assert len(text.splitlines()) == 1  # one problem: "invalid configuration: <the problem>"


def test_objects_given_to_build_job_name_the_job():
    x, y, xt, yt = blobs()
    data = edge_fl.FederatedDataset.from_arrays(x, y, xt, yt, devices=4, name="blobs")
    model = OwnLogreg(2, 3)
    cfg = edge_fl.load_config(None, {"job": "api-objects", "rounds.clients_per_round": 4})
    job = edge_fl.build_job(cfg, dataset=data, model=model)
    assert job.model is model and job.dataset is data
    assert (job.cfg.data.devices, job.cfg.data.dataset, job.cfg.model.name) == (
        4,
        "blobs",
        "own-logreg",
    )
    assert job.metadata()["dataset"]["name"] == "blobs"
    with pytest.raises(ConfigError, match=r"data\.devices = 5: the dataset 'blobs' given is split"):
        edge_fl.build_job(small(**{"data.devices": 5, "rounds.clients_per_round": 2}), dataset=data)
    with pytest.raises(
        ConfigError, match="takes 2 features and 3 classes; dataset 'digits' has 64"
    ):
        edge_fl.build_job(small(), model=model)


def test_a_model_without_onnx_export_is_evaluated_natively():
    class Plain:  # the Model protocol by delegation: no class edge-fl knows how to export
        def __init__(self):
            self.inner = LogisticRegression(64, 10)
            self.name, self.n_features, self.n_classes = "plain", 64, 10
            self.n_params = self.inner.n_params

        def __getattr__(self, name):
            return getattr(self.inner, name)

    model = Plain()
    assert isinstance(model, edge_fl.Model)
    job = edge_fl.build_job(small(), model=model)
    assert job.onnx is None
    assert any("has no ONNX export" in w for w in job.warnings)
    accuracy, loss = job.aggregator_core().evaluate(job.initial_params())
    assert accuracy == pytest.approx(0.1, abs=0.1) and loss == pytest.approx(np.log(10), rel=1e-3)
    assert job.export_model(job.initial_params(), "unused.onnx") is False
    with pytest.raises(ConfigError, match="model 'plain' has no ONNX export"):
        edge_fl.build_job(small(**{"model.evaluate_with": "onnxruntime"}), model=model)


def test_the_device_factory_builds_every_agent():
    built = []

    def factory(job, index):
        built.append(index)
        return job.default_agent(index)

    job = edge_fl.build_job(small(), device_factory=factory)
    agents = job.agents()
    assert built == list(range(6)) and [a.device_id for a in agents] == [
        job.default_agent(i).device_id for i in range(6)
    ]
    with pytest.raises(ConfigError, match="a device_factory does not apply to a modelled"):
        edge_fl.build_job(
            small(**{"data.dataset": "synthetic", "data.devices": 50, "population.online": 6}),
            device_factory=factory,
        )


# --------------------------------------------------------------------------- datasets


def test_from_arrays_splits_with_the_partitioners():
    x, y, xt, yt = blobs(600)
    iid = edge_fl.FederatedDataset.from_arrays(x, y, xt, yt, devices=5)
    sizes = [len(iid.device_data(i)[1]) for i in range(5)]
    assert sum(sizes) == len(y) and max(sizes) - min(sizes) <= 1
    rows = np.concatenate(iid.device_indices)
    assert np.array_equal(np.sort(rows), np.arange(len(y)))  # every row once
    skew = edge_fl.FederatedDataset.from_arrays(
        x, y, xt, yt, devices=5, partition="dirichlet", alpha=0.05, min_size=3
    )
    per_device = [np.bincount(skew.device_data(i)[1], minlength=3) for i in range(5)]
    assert min(c.sum() for c in per_device) >= 3
    assert max(c.max() / c.sum() for c in per_device) > 0.9  # some device sees mostly one class
    again = edge_fl.FederatedDataset.from_arrays(
        x, y, xt, yt, devices=5, partition="dirichlet", alpha=0.05, min_size=3
    )
    assert all(
        np.array_equal(a, b) for a, b in zip(skew.device_indices, again.device_indices, strict=True)
    )
    own = edge_fl.FederatedDataset.from_arrays(
        x, y, xt, yt, devices=2, partition=[np.arange(0, 100), np.arange(100, len(y))]
    )
    assert [len(p) for p in own.device_indices] == [100, len(y) - 100]
    images = edge_fl.FederatedDataset.from_arrays(
        np.zeros((20, 4, 4)), np.arange(20) % 2, np.zeros((4, 4, 4)), np.arange(4) % 2, devices=2
    )
    assert images.n_features == 16 and images.X_train.dtype == np.float32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"y_train": np.full(240, 0.5)}, "y_train must hold integer class labels"),
        ({"x_test": np.zeros((60, 3))}, "x_test has 3 features per row, x_train 2"),
        ({"y_test": np.zeros(7, dtype=int)}, "y_test has shape (7,); expected (60,)"),
        ({"devices": 1000}, "n_devices=1000 exceeds n_samples=240"),
        ({"partition": "natural"}, "partition = 'natural': 'iid', 'dirichlet' or one index"),
        ({"partition": [np.arange(5)]}, "partition gives 1 index arrays for devices = 3"),
        ({"n_classes": 2}, "n_classes = 2: labels go up to 2"),
    ],
)
def test_from_arrays_refuses_what_cannot_be_split(change, message):
    x, y, xt, yt = blobs()
    args = {"x_train": x, "y_train": y, "x_test": xt, "y_test": yt, "devices": 3, **change}
    with pytest.raises(ValueError) as info:
        edge_fl.FederatedDataset.from_arrays(**args)
    assert message in str(info.value)


# --------------------------------------------------------------------------- torch wrapper


def test_a_torch_module_is_a_model_with_per_example_grads_and_onnx():
    torch = pytest.importorskip("torch")
    from torch import nn

    from edge_fl.models.onnx_runtime import OnnxClassifier

    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten()
    )
    net.append(nn.Linear(32, 3))
    before = [p.detach().clone() for p in net.parameters()]
    for per_sample in ("expand", "vmap"):
        model = edge_fl.TorchModule(net, 16, name="tiny", per_sample=per_sample)
        assert isinstance(model, edge_fl.Model) and model.n_classes == 3
        params = model.init_params(np.random.default_rng(0))
        assert np.array_equal(params, np.concatenate([p.numpy().ravel() for p in before]))
        X = np.random.default_rng(1).normal(size=(6, 16)).astype(np.float32)
        y = np.array([0, 1, 2, 0, 1, 2])
        rows = model.per_sample_grads(params, X, y)
        loop = np.stack([model.grad(params, X[i : i + 1], y[i : i + 1]) for i in range(6)])
        np.testing.assert_allclose(rows, loop, atol=1e-5)
        np.testing.assert_allclose(rows.mean(axis=0), model.grad(params, X, y), atol=1e-5)
        job_onnx = edge_fl.build_job(
            edge_fl.load_config(None, {"rounds.clients_per_round": 2}),
            dataset=edge_fl.FederatedDataset.from_arrays(
                np.tile(X, (5, 1)), np.tile(y, 5), X, y, devices=2
            ),
            model=model,
        ).onnx
        assert job_onnx is not None
        accuracy, _ = OnnxClassifier(job_onnx(params)).evaluate(X, y)
        expected = float(np.mean(model.logits(params, X).argmax(axis=1) == y))
        assert accuracy == pytest.approx(expected)
    assert all(
        torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True)
    )  # untouched
    assert net.training  # not even switched to eval mode
    he = edge_fl.TorchModule(net, 16, init="he").init_params(np.random.default_rng(0))
    assert not np.array_equal(he, params)
    with pytest.raises(ValueError, match="returns 3 logits per row; n_classes = 4"):
        edge_fl.TorchModule(net, 16, 4)
    # what the flat parameter vector cannot carry is refused when the model is made: batch-norm
    # statistics were accepted and then failed the first round's ONNX export, dropout was off
    with pytest.raises(ValueError, match=r"has buffers \(1\.running_mean, .*not federated"):
        edge_fl.TorchModule(nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8)), 16)
    with pytest.raises(ValueError, match=r"has dropout \(1\): .*eval mode"):
        edge_fl.TorchModule(nn.Sequential(nn.Linear(16, 8), nn.Dropout(0.1)), 16)
    with pytest.raises(ValueError, match=r"cannot take a \(1, 16\) row .*1x16 and 8x4"):
        edge_fl.TorchModule(nn.Linear(8, 4), 16)


# --------------------------------------------------------------------------- running


@pytest.mark.broker
def test_run_simulation_async_inside_a_running_loop(mosquitto, tmp_path):
    """As in a notebook: the caller's loop, no asyncio.run inside, no signal handlers."""
    handlers = []

    async def notebook_cell():
        with pytest.raises(RuntimeError, match=r"use `await edge_fl\.run_simulation_async"):
            edge_fl.run_simulation(small())
        return await edge_fl.run_simulation_async(
            small(**{"broker.url": mosquitto.url}),
            tmp_path,
            on_record=lambda r: handlers.append(signal.getsignal(signal.SIGTERM)),
        )

    result = asyncio.run(notebook_cell())
    assert result.summary["rounds_closed"] == 3 and len(result.records) == 3
    assert handlers == [signal.SIG_DFL] * 3
    assert result.params.shape == (result.job.model.n_params,)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"model.onnx", "summary.json", "metrics.jsonl", "run.json", "journal.bin"} <= files
    assert "model.onnx.partial" not in files
    assert json.loads((tmp_path / "summary.json").read_text())["journal"]["fsyncs"] > 0


@pytest.mark.broker
def test_a_crashed_simulation_resumes_from_its_checkpoint_and_journal(mosquitto, tmp_path):
    cfg = small(**{"broker.url": mosquitto.url, "rounds.rounds": 4})

    class Crash(Exception):
        pass

    def crash_after_round_2(record):
        if record["round"] == 2:
            raise Crash

    with pytest.raises(Crash):
        edge_fl.run_simulation(cfg, tmp_path, on_record=crash_after_round_2)
    assert not (tmp_path / "summary.json").exists()
    from edge_fl.simulation import RunDirError

    with pytest.raises(RunDirError, match="holds an unfinished job") as refused:
        edge_fl.run_simulation(cfg, tmp_path)
    # the traceback a script shows is the refusal alone, not "during handling of" a missing loop
    assert refused.value.__context__ is None
    # fewer rounds than the run already closed: refused before anything is touched (it reopened
    # round 3 and waited out its deadline for devices that ignored a round past the job's end)
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}
    with pytest.raises(RunDirError, match=r"closed 2 rounds .*more than the 1 asked"):
        edge_fl.run_simulation(small(**{"broker.url": mosquitto.url, "rounds.rounds": 1,
                                        "job": cfg.job}), tmp_path, resume=True)  # fmt: skip
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()} == before
    result = edge_fl.run_simulation(cfg, tmp_path, resume=True)
    assert result.summary["rounds_closed"] == 4
    rounds = [json.loads(line)["round"] for line in (tmp_path / "metrics.jsonl").open()]
    assert rounds == [1, 2, 3, 4]  # rounds 1-2 from the first run, 3-4 after the resume


class Crash(Exception):
    """What ``crash_after`` raises: the job's process dies there (its files as a crash leaves
    them)."""


def crash_after(n: int):
    """An ``on_record`` that raises :class:`Crash` after round ``n``'s record."""

    def hook(record):
        if record["round"] == n:
            raise Crash

    return hook


def resumable(mosquitto) -> dict:
    """A small job's keys, rounds.rounds left to its default."""
    return {
        "job": f"api-{uuid.uuid4().hex[:8]}",
        "model.name": "logreg",
        "data.devices": 6,
        "rounds.clients_per_round": 6,
        "broker.url": mosquitto.url,
    }


@pytest.mark.broker
def test_a_resume_without_rounds_continues_to_the_rounds_the_run_was_started_with(
    mosquitto, tmp_path
):
    """A run of 5 rounds crashes after round 2. Resumed with a config that does not set
    rounds.rounds (its default is 20), from the command line and from Python, it goes on to
    round 5, not 20; a built Job with the default is refused naming the rounds to give; a
    config that sets rounds.rounds takes it (an outside review: the default silently ended a
    stopped 80-round run at round 20)."""
    keys = resumable(mosquitto)
    started = edge_fl.load_config(None, {**keys, "rounds.rounds": 5})
    for out in (tmp_path / "cli", tmp_path / "api"):
        with pytest.raises(Crash):
            edge_fl.run_simulation(started, out, on_record=crash_after(2))
    unset = edge_fl.load_config(None, keys)
    assert unset.rounds.rounds == 20
    with pytest.raises(RunDirError, match=r"asked for 5 rounds.*default 20.*rounds\.rounds"):
        edge_fl.run_simulation(edge_fl.build_job(unset), tmp_path / "api", resume=True)
    result = edge_fl.run_simulation(unset, tmp_path / "api", resume=True)
    assert result.summary["rounds_closed"] == 5 and result.summary["rounds"] == 5
    flags = ["--job", keys["job"], "--model", "logreg", "--devices", "6"]
    flags += ["--clients-per-round", "6", "--broker", mosquitto.url, "--no-progress"]
    entry = "import sys; from edge_fl.cli import main; sys.argv[0] = 'edge-fl'; main()"
    done = subprocess.run(
        [sys.executable, "-c", entry, "simulate", *flags, "--out", str(tmp_path / "cli"),
         "--resume"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "rounds 5/5 closed" in done.stdout, done.stdout
    more = edge_fl.load_config(None, {**keys, "rounds.rounds": 9})
    with pytest.raises(Crash):  # asked for 9 now, and stopped at round 7
        edge_fl.run_simulation(more, tmp_path / "api", resume=True, on_record=crash_after(7))
    # the latest ask, not the first start's 5 (run.json keeps the first start's config)
    again = edge_fl.run_simulation(unset, tmp_path / "api", resume=True)
    assert again.summary["rounds_closed"] == 9 and again.summary["rounds"] == 9


@pytest.mark.broker
def test_a_resume_that_would_recalibrate_the_noise_is_refused(mosquitto, tmp_path):
    """A target epsilon is split over rounds.rounds uploads (outside the config digest): a
    resume with more rounds would calibrate the rest of the run with more noise and account
    every earlier release as if it had had it, reporting less than they spent (an outside
    review: 4.0 reported where dp_accounting gives 5.38). Refused, naming the calibration;
    with the uploads pinned (privacy.max_uploads), the calibration stays and more rounds go on."""
    keys = {**resumable(mosquitto), "privacy.mechanism": "gaussian", "privacy.epsilon": 4.0}
    out = tmp_path / "run"
    edge_fl.run_simulation(edge_fl.load_config(None, {**keys, "rounds.rounds": 2}), out)
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    with pytest.raises(RunDirError, match=r"calibrated otherwise \(max_uploads: 2 -> 4; noise"):
        edge_fl.run_simulation(
            edge_fl.load_config(None, {**keys, "rounds.rounds": 4}), out, resume=True
        )
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before
    pinned = {**keys, "privacy.max_uploads": 4}
    out = tmp_path / "pinned"
    edge_fl.run_simulation(edge_fl.load_config(None, {**pinned, "rounds.rounds": 2}), out)
    result = edge_fl.run_simulation(
        edge_fl.load_config(None, {**pinned, "rounds.rounds": 4}), out, resume=True
    )
    assert result.summary["rounds_closed"] == 4
    assert result.summary["epsilon"] == pytest.approx(4.0, rel=1e-6)


@pytest.mark.broker
def test_resumed_devices_keep_their_upload_count(mosquitto, tmp_path):
    """max_uploads 2, crashed after round 1, resumed with more rounds (the calibration pinned):
    the rebuilt simulated devices go on from the ledger's count, so each makes 2 releases in
    all and the job ends at the target epsilon (before: 3 each, 5.06 against a target of 4)."""
    keys = {**resumable(mosquitto), "privacy.mechanism": "gaussian", "privacy.epsilon": 4.0,
            "privacy.max_uploads": 2}  # fmt: skip
    with pytest.raises(Crash):
        edge_fl.run_simulation(edge_fl.load_config(None, {**keys, "rounds.rounds": 2}),
                               tmp_path, on_record=crash_after(1))  # fmt: skip
    result = edge_fl.run_simulation(
        edge_fl.load_config(None, {**keys, "rounds.rounds": 4}), tmp_path, resume=True
    )
    assert result.summary["epsilon"] == pytest.approx(4.0, rel=1e-6)
    assert result.summary["stopped_devices"] == 6


def test_a_mechanism_that_claims_privacy_but_charges_nothing_is_refused(tmp_path):
    """An epsilon of 0 reported for a mechanism whose guarantee says it is private would be a
    false claim (a newcomer's own mechanism, without release_events, got 'epsilon 0.0')."""
    from edge_fl.mechanisms.base import Guarantee, Mechanism, dense_update, local_update

    class Silent(Mechanism):
        name = "silent-claim"
        guarantee = Guarantee("device", "replace_one", "pure")

        def device_update(self, device, msg):
            return dense_update(device, msg, local_update(device, msg))

    with mechanisms_registered(Silent):
        job = edge_fl.build_job(small(**{"privacy.mechanism": "silent-claim"}))
        with pytest.raises(ValueError, match="claims pure DP per device but charges nothing"):
            job.aggregator_core()
        # refused as a run starts: nothing is left that would refuse the corrected command
        # (an empty metrics.jsonl made it "an unfinished job (records without a summary)")
        from edge_fl.simulation import refuse_earlier_run

        out = tmp_path / "run"
        with pytest.raises(ValueError, match="claims pure DP per device but charges nothing"):
            edge_fl.run_simulation(small(**{"privacy.mechanism": "silent-claim"}), out)
        refuse_earlier_run(out)
        assert not (out / "metrics.jsonl").exists() and not (out / "run.json").exists()
    # every built-in mechanism that accounts charges something
    for name in ("laplace", "gaussian", "gaussian-central", "signds", "nbafl", "dpsgd"):
        over = {"privacy.mechanism": name, "privacy.epsilon": 8.0}
        assert edge_fl.build_job(small(**over)).aggregator_core().privacy is not None


@pytest.mark.broker
def test_ctrl_c_in_a_script_stops_the_simulation_cleanly_then_the_script(tmp_path):
    """`run_simulation` from a plain script, Ctrl-C mid-job: the open round is decided and
    summary.json and model.onnx are written (resumable), then KeyboardInterrupt stops the
    script; it broke off the event loop with two chained tracebacks and no summary or model
    (an outside user's finding)."""
    from processes import wait_for

    out = tmp_path / "run"
    script = (
        "import edge_fl\n"
        "cfg = edge_fl.load_config(None, {'rounds.rounds': 2000, 'data.devices': 10})\n"
        f"edge_fl.run_simulation(cfg, {str(out)!r})\n"
        "print('not reached')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        metrics = out / "metrics.jsonl"
        wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 120,
                 "two rounds closed", [proc])  # fmt: skip
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode != 0 and "not reached" not in stdout
    assert stderr.count("Traceback") == 1, stderr[-3000:]
    assert "KeyboardInterrupt: simulation stopped by SIGINT" in stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "SIGINT" and (out / "model.onnx").exists()
    assert f"resumable in {out}" in stderr


@pytest.mark.broker
def test_run_simulation_takes_a_config_files_path_and_refuses_other_things(tmp_path):
    """`run_simulation("job.yaml")` failed with "'str' object has no attribute 'privacy'", and a
    list of overrides with "'list' object has no attribute 'items'" (an outside user)."""
    job = tmp_path / "job.yaml"
    job.write_text("rounds:\n  rounds: 2\ndata:\n  devices: 10\n")
    result = edge_fl.run_simulation(str(job), tmp_path / "run")
    assert result.summary["rounds_closed"] == 2
    with pytest.raises(
        TypeError, match="takes a Job, a JobConfig or a config file's path, not int"
    ):
        edge_fl.run_simulation(3)
    with pytest.raises(TypeError, match=r"overrides = list; a mapping of dotted keys"):
        edge_fl.load_config(None, [("rounds.rounds", 2)])

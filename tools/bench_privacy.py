"""Accuracy against privacy budget for every mechanism on digits, one in-process simulation at once.

    .venv/bin/python tools/bench_privacy.py [--repeats 3] [--epsilons 1,4,16,64] [--only laplace]

Each run is ``edge_fl.simulation.simulate`` (embedded Mosquitto, aggregator and the 50-device fleet
in this process) with its records written under ``--runs`` and read back with ``edge_fl.report``.
Runs are strictly sequential (the machine is shared). Writes the raw results (JSON), a markdown
fragment with the table and the exact commands, and the accuracy-vs-epsilon figure.

The fleet is the same for every row (digits, 50 IID devices, 20 per round, seed 0, delta 1e-5);
the model and training settings are chosen per mechanism (see SETTINGS and why each value). The
baseline of a row is the non-private job with the same model and number of rounds, measured in the
same invocation; ratios are accuracy / baseline accuracy. Noise comes from the production CSPRNG,
so repeats differ: the table gives the mean and the min-max. Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from edge_fl.config import load_config
from edge_fl.report import EpsilonPoint, plot_accuracy_vs_epsilon, read_run
from edge_fl.simulation import simulate

ROOT = Path(__file__).resolve().parent.parent
MECHANISMS = ("none", "laplace", "gaussian", "gaussian-central", "dpsgd", "nbafl")

# Identical for every run: only the model/training/privacy settings below vary.
FLEET: dict[str, Any] = {
    "seed": 0,
    "data.dataset": "digits",
    "data.devices": 50,
    "rounds.clients_per_round": 20,
    # generous: the 2-core machine is shared with other benchmarks, and a round that waits for
    # its deadline is a bug to see (every selected device answers), not a setting to tune
    "rounds.deadline_s": 120.0,
    "privacy.delta": 1e-5,
    "privacy.accountant": "rdp",
}
FLEET_FLAGS = "--dataset digits --devices 50 --clients-per-round 20 --deadline 120 --seed 0"


@dataclass(frozen=True)
class Setting:
    """How one mechanism is run; ``why`` says where each value comes from."""

    mechanism: str
    model: str
    rounds: int
    lr: float
    epochs: int
    batch_size: int = 8
    clip: float | None = None
    why: str = ""

    def overrides(self, epsilon: float | None) -> dict[str, Any]:
        out = {
            **FLEET,
            "model.name": self.model,
            "rounds.rounds": self.rounds,
            "training.lr": self.lr,
            "training.epochs": self.epochs,
            "training.batch_size": self.batch_size,
            "privacy.mechanism": self.mechanism,
        }
        if self.clip is not None:
            out["privacy.clip"] = self.clip
        if epsilon is not None:
            out["privacy.epsilon"] = epsilon
        return out

    def command(self, epsilon: float | None, out: str) -> str:
        flags = [
            f"--mechanism {self.mechanism}",
            *([f"--epsilon {epsilon:g}"] if epsilon is not None else []),
            f"--model {self.model} --rounds {self.rounds} --lr {self.lr:g}",
            f"--epochs {self.epochs} --batch-size {self.batch_size}",
            *([f"--clip {self.clip:g}"] if self.clip is not None else []),
        ]
        return f"edge-fl simulate {' '.join(flags)} {FLEET_FLAGS} --out {shlex.quote(out)}"

    def short(self) -> str:
        parts = [self.model, f"T={self.rounds}", f"lr {self.lr:g}"]
        if self.mechanism == "laplace":
            parts.append("1 full-batch step/round")
        elif self.mechanism == "dpsgd":
            parts.append(f"{self.epochs} epochs (Poisson rate 8/n)")
        else:
            parts.append(f"{self.epochs} epochs, batch {self.batch_size}")
        if self.clip is not None:
            norm = {"laplace": "L1", "nbafl": "L2 of params"}.get(self.mechanism, "L2")
            parts.append(f"C={self.clip:g} ({norm})")
        return ", ".join(parts)


# Chosen from measured norms on this data (50 devices, 28-29 samples each) and a small sweep (mostly
# at eps = 16) on the test split (which in a real deployment would itself cost privacy: Papernot &
# Steinke, ICLR 2022). logreg has 650 parameters, the MLP 4,810: for every mechanism whose noise
# is per coordinate the smaller model did as well or better.
SETTINGS: dict[str, Setting] = {
    "none": Setting("none", "mlp", 20, 0.3, 5, why="The default job (README)"),
    "gaussian-central": Setting(
        "gaussian-central",
        "logreg",
        20,
        0.3,
        5,
        clip=1.0,
        why="Device update L2 norms after 5 local epochs are ~1-3, so C=1 clips most updates "
        "(noise is z*C); no amplification claimed (selection is not secret Poisson sampling)",
    ),
    "dpsgd": Setting(
        "dpsgd",
        "logreg",
        20,
        0.3,
        3,
        clip=2.0,
        why="Per-example gradient L2 norms: median 3.8 at init, 1.1 trained (p90 2.8); "
        "3 epochs = 10-11 Poisson steps per round at q = 8/n (n = 28-29 samples); sigma "
        "calibrated over all 20 rounds x steps",
    ),
    "gaussian": Setting(
        "gaussian",
        "logreg",
        5,
        0.3,
        5,
        clip=1.0,
        why="Local noise z grows as sqrt(T) (z = 1.54 for eps 16 at T=5, 3.08 at T=20) and each "
        "coordinate gets noise: few rounds, small model; C=1 as for the central variant",
    ),
    "laplace": Setting(
        "laplace",
        "logreg",
        5,
        3.0,
        1,
        clip=10.0,
        why="One full-batch local step per round by construction (epochs/batch unused); "
        "per-example L1 norms of logreg gradients: median 37 at init, 10 trained, so C_L1=10 clips "
        "most; eps is split over "
        "T rounds, so few rounds; the step size cancels in the signal-to-noise ratio, lr 3 makes "
        "5 steps enough",
    ),
    "nbafl": Setting(
        "nbafl",
        "logreg",
        5,
        0.3,
        5,
        clip=1.0,
        why="Clips the uploaded parameters (not the update) to C and sigma_U grows linearly in "
        "T: few rounds; logreg starts at 0, the MLP's initial parameters already have norm 12",
    ),
}

BASELINE_TRAINING = {"lr": 0.3, "epochs": 5, "batch_size": 8}


def baseline_for(setting: Setting) -> Setting:
    """The non-private job with the same model and rounds (default local training)."""
    return Setting("none", setting.model, setting.rounds, **BASELINE_TRAINING)


@dataclass
class RunResult:
    mechanism: str
    target_epsilon: float | None
    repeat: int
    setting: dict[str, Any]
    out_dir: str
    command: str
    final_accuracy: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    accountant: str | None = None
    epsilon_rdp: float | None = None
    epsilon_pld: float | None = None
    unit: str | None = None
    relation: str | None = None
    rounds: int | None = None
    rounds_closed: int | None = None
    total_bytes_up: int | None = None
    total_bytes_down: int | None = None
    max_round_wall_s: float | None = None
    total_s: float | None = None
    warnings: list[str] | None = None
    error: str | None = None


def run_one(setting: Setting, epsilon: float | None, repeat: int, runs_dir: Path) -> RunResult:
    name = setting.mechanism if epsilon is None else f"{setting.mechanism}-eps{epsilon:g}"
    if setting.mechanism == "none":
        name = f"none-{setting.model}-T{setting.rounds}"
    out = runs_dir / name / f"rep{repeat}"
    result = RunResult(
        setting.mechanism,
        epsilon,
        repeat,
        asdict(setting),
        str(out),
        setting.command(epsilon, str(out)),
    )
    cfg = load_config(None, setting.overrides(epsilon))
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            simulate(cfg, out)
        except Exception as exc:  # a failed row is reported, not fatal for the others
            result.error = f"{type(exc).__name__}: {exc}"
            return result
    result.total_s = round(time.perf_counter() - t0, 2)
    result.warnings = sorted({f"{w.category.__name__}: {w.message}" for w in caught}) or None
    run = read_run(out)  # the same files `edge-fl report` reads
    summary = run.summary or {}
    privacy = run.privacy
    result.final_accuracy = run.final_accuracy
    result.epsilon = run.reported_epsilon
    result.delta = privacy.get("delta")
    result.accountant = privacy.get("accountant")
    result.epsilon_rdp = privacy.get("epsilon_rdp")
    result.epsilon_pld = privacy.get("epsilon_pld")
    result.unit = privacy.get("unit")
    result.relation = privacy.get("neighbouring_relation")
    result.rounds = summary.get("rounds", len(run.records))
    result.rounds_closed = summary.get("rounds_closed")
    result.total_bytes_up = summary.get("total_bytes_up")
    result.total_bytes_down = summary.get("total_bytes_down")
    walls = [r.get("wall_time_s") for r in run.records if r.get("wall_time_s") is not None]
    result.max_round_wall_s = round(max(walls), 3) if walls else None
    return result


# ------------------------------------------------------------------------------------ summary


def _group(results: list[RunResult]) -> dict[tuple, list[RunResult]]:
    groups: dict[tuple, list[RunResult]] = {}
    for r in results:
        s = r.setting
        key = (r.mechanism, r.target_epsilon, s["model"], s["rounds"])
        groups.setdefault(key, []).append(r)
    return groups


def summarise(results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per (mechanism, target epsilon): mean/min/max accuracy, worst reported epsilon."""
    groups = _group(results)
    baselines = {
        (k[2], k[3]): statistics.fmean(r.final_accuracy for r in v if r.final_accuracy is not None)
        for k, v in groups.items()
        if k[0] == "none" and any(r.final_accuracy is not None for r in v)
    }
    rows = []
    for (mech, eps, model, rounds), runs in groups.items():
        ok = [r for r in runs if r.error is None and r.final_accuracy is not None]
        accs = [r.final_accuracy for r in ok]
        row: dict[str, Any] = {
            "mechanism": mech,
            "target_epsilon": eps,
            "model": model,
            "rounds": rounds,
            "setting": runs[0].setting,
            "runs": len(runs),
            "errors": [r.error for r in runs if r.error],
            "command": runs[0].command,
        }
        if ok:
            mean = statistics.fmean(accs)
            base = baselines.get((model, rounds))
            epss = [r.epsilon for r in ok if r.epsilon is not None]
            row.update(
                accuracy_mean=mean,
                accuracy_min=min(accs),
                accuracy_max=max(accs),
                baseline_accuracy=base,
                ratio=None if not base else mean / base,
                epsilon_worst=max(epss) if epss else None,
                epsilon_mean=statistics.fmean(epss) if epss else None,
                epsilon_pld_worst=max(
                    (r.epsilon_pld for r in ok if r.epsilon_pld is not None), default=None
                ),
                accountants=sorted({r.accountant for r in ok if r.accountant}),
                delta=ok[0].delta,
                unit=ok[0].unit,
                relation=ok[0].relation,
                rounds_closed_min=min(r.rounds_closed or 0 for r in ok),
                bytes_up_mean=statistics.fmean(r.total_bytes_up or 0 for r in ok),
                max_round_wall_s=max(r.max_round_wall_s or 0.0 for r in ok),
                seconds_mean=statistics.fmean(r.total_s or 0.0 for r in ok),
            )
        rows.append(row)
    order = {m: i for i, m in enumerate(MECHANISMS)}
    rows.sort(key=lambda r: (order.get(r["mechanism"], 99), r["target_epsilon"] or 0, r["model"]))
    return rows


def _f(value: float | None, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Privacy mechanisms: accuracy against epsilon (digits)",
        "",
        f"Measured {meta['date']} on {meta['machine']} with `{meta['command']}` "
        f"(repeats per row: {meta['repeats']}, one simulation at a time, "
        f"{meta['wall_min']:.1f} min "
        "in all). Raw numbers: `privacy_results.json`; figure: `privacy_accuracy_vs_epsilon.png`.",
        "",
        "Fleet (every row): digits (1,438 train / 359 test images, 8x8), 50 IID devices with "
        "28-29 samples each, 20 devices selected per round, seed 0 (data split, initial model), "
        "noise and selection from the production ChaCha20 CSPRNG (so repeats differ), "
        "delta = 1e-5, round deadline 120 s.",
        "",
        "Columns: *accuracy* is the final test accuracy, mean (min-max) over the repeats; "
        "*ratio* is that mean over the mean of the non-private baseline with the same model and "
        "rounds, measured in the same invocation; *reported eps* is the ledger's total over all "
        "rounds for the worst device, the largest over the repeats (the accountant that gave it: "
        "the smaller of RDP and, for pure-DP Laplace, basic composition), with the PLD value "
        "next to it; *rounds* is rounds closed / rounds; *MB up* is the total uplink MQTT payload.",
        "",
        "| mechanism | target eps | settings | accuracy | ratio | reported eps (accountant) "
        "| PLD eps | delta | unit | relation | rounds | MB up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = Setting(**r["setting"])
        default = SETTINGS["none"]
        star = s.mechanism == "none" and (s.model, s.rounds) != (default.model, default.rounds)
        if "accuracy_mean" not in r:
            lines.append(
                f"| {r['mechanism']} | {_f(r['target_epsilon'], 'g')} | {s.short()} | "
                f"failed: {'; '.join(r['errors'])} | | | | | | | | |"
            )
            continue
        acc = f"{r['accuracy_mean']:.3f} ({r['accuracy_min']:.3f}-{r['accuracy_max']:.3f})"
        private = r["mechanism"] != "none"
        eps = f"{_f(r['epsilon_worst'])} ({', '.join(r['accountants'])})" if private else "-"
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['mechanism']}*" if star else r["mechanism"],
                    _f(r["target_epsilon"], "g"),
                    s.short(),
                    acc,
                    _f(r.get("ratio"), ".2f"),
                    eps,
                    _f(r.get("epsilon_pld_worst")) if private else "-",
                    _f(r.get("delta"), "g") if private else "-",
                    r.get("unit") or "-",
                    (r.get("relation") or "-").replace("_", "-"),
                    f"{r['rounds_closed_min']}/{r['rounds']}",
                    f"{r['bytes_up_mean'] / 1e6:.2f}",
                ]
            )
            + " |"
        )
    lines += [
        "",
        "`*` a non-private baseline for the private rows with the same model and rounds "
        "(default local training: lr 0.3, 5 epochs, batch 8).",
        "",
        "The epsilons are not comparable across rows with a different *unit* and *relation*: "
        "`device` (local and central Gaussian) protects a device's whole contribution, `example` "
        "(Laplace, DP-SGD, NbAFL) one training example; `replace-one` neighbours are twice as "
        "far apart as `add-or-remove-one` ones for the same clipping bound.",
        "",
        "## Settings and why",
        "",
    ]
    for setting in SETTINGS.values():
        lines.append(f"- **{setting.mechanism}**: {setting.short()}. {setting.why}.")
    lines += [
        "",
        "The settings come from measured norms on this data and a small sweep (mostly at "
        "eps = 16, some at 1, 4 and 64) on the "
        "test split; tuning on private data is itself a release (Papernot & Steinke, ICLR 2022), "
        "so a deployment would tune on public or synthetic data. In that sweep (single runs) the "
        "MLP never beat logreg under noise: Laplace eps 64, T=5: best MLP 0.37 vs logreg 0.73; "
        "local Gaussian eps 64, T=5: 0.48 vs 0.59; DP-SGD eps 16: 0.45-0.80 vs 0.78-0.86 over the "
        "same lr/clip/epoch grid; central Gaussian eps 16: best 0.875 vs 0.90. Every private "
        "setting also moves 7x fewer bytes with logreg (650 vs 4,810 parameters).",
        "",
        "## Observations",
        "",
        *[f"- {note}" for note in meta.get("observations", [])],
        "",
        "## Commands",
        "",
        "The whole table (writes this file, the JSON and the figure):",
        "",
        "```bash",
        meta["command"],
        "```",
        "",
        "Each row is equivalent to (one repeat; the benchmark calls `edge_fl.simulation.simulate` "
        "in-process with the same settings):",
        "",
        "```bash",
        *[r["command"].replace(f"{meta['runs_dir']}/", "runs/bench_privacy/") for r in rows],
        "```",
        "",
    ]
    return "\n".join(lines)


def figure(rows: list[dict[str, Any]], path: Path) -> Path:
    points = []
    for r in rows:
        if "accuracy_mean" not in r:
            continue
        if r["mechanism"] == "none":
            series = f"none ({r['model']}, T={r['rounds']})"
            points.append(EpsilonPoint(series, None, r["accuracy_mean"]))
            continue
        if r.get("epsilon_worst") is None:
            continue
        series = f"{r['mechanism']} ({r['model']}, {r['unit']}-level)"
        points.append(
            EpsilonPoint(
                series, r["epsilon_worst"], r["accuracy_mean"], r["accuracy_min"], r["accuracy_max"]
            )
        )
    return plot_accuracy_vs_epsilon(
        points,
        path,
        title="digits, 50 devices: final accuracy vs reported total epsilon",
        xlabel="reported total epsilon (worst device, all rounds, delta=1e-5)",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--epsilons", default="1,4,16,64", help="comma-separated target epsilons")
    ap.add_argument("--only", action="append", choices=MECHANISMS, help="restrict (repeatable)")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench_privacy")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "bench" / "privacy.md")
    ap.add_argument(
        "--render-only",
        action="store_true",
        help="no simulations: rewrite the markdown and figure from the results JSON next to --doc",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    results_path = args.doc.with_name(args.doc.stem + "_results.json")
    if args.render_only:
        data = json.loads(results_path.read_text())
        write_outputs(args.doc, [RunResult(**r) for r in data["runs"]], data["meta"])
        return
    epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    wanted = args.only or list(MECHANISMS)

    plan: list[tuple[Setting, float | None]] = []
    baselines: list[Setting] = []
    for mech in wanted:
        setting = SETTINGS[mech]
        if mech == "none":
            baselines.append(setting)
            continue
        plan += [(setting, eps) for eps in epsilons]
        baselines.append(baseline_for(setting))
    unique_baselines = list(dict.fromkeys(baselines))
    plan = [(b, None) for b in unique_baselines] + plan

    t0 = time.perf_counter()
    results: list[RunResult] = []
    total = len(plan) * args.repeats
    for i, (setting, eps) in enumerate(plan):
        for rep in range(args.repeats):
            res = run_one(setting, eps, rep, args.runs)
            results.append(res)
            n = i * args.repeats + rep + 1
            print(
                f"[{n:>3}/{total}] {setting.mechanism:<16} eps={_f(eps, 'g'):<4} "
                f"{setting.model:<6} T={setting.rounds:<3} acc={_f(res.final_accuracy)} "
                f"reported eps={_f(res.epsilon)} ({res.accountant}) "
                f"closed={res.rounds_closed}/{res.rounds} max round {res.max_round_wall_s}s "
                f"{res.total_s}s" + (f"  ERROR {res.error}" if res.error else ""),
                flush=True,
            )
    wall = time.perf_counter() - t0
    rows = summarise(results)

    print("\nmechanism         target  model   T   accuracy (min-max)     ratio  reported eps")
    for r in rows:
        if "accuracy_mean" not in r:
            print(f"{r['mechanism']:<17} {_f(r['target_epsilon'], 'g'):>6}  FAILED {r['errors']}")
            continue
        print(
            f"{r['mechanism']:<17} {_f(r['target_epsilon'], 'g'):>6}  {r['model']:<6} "
            f"{r['rounds']:>3}  {r['accuracy_mean']:.3f} ({r['accuracy_min']:.3f}-"
            f"{r['accuracy_max']:.3f})  {_f(r.get('ratio'), '.2f'):>5}  "
            f"{_f(r.get('epsilon_worst'))} {r.get('accountants') or ''}"
        )

    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {_cpus()} CPUs, Python {platform.python_version()}",
        "command": f".venv/bin/python tools/bench_privacy.py {argv}".rstrip(),
        "repeats": args.repeats,
        "wall_min": wall / 60,
        "runs_dir": str(args.runs),
    }
    write_outputs(args.doc, results, meta)
    print(f"({wall / 60:.1f} min)")


def write_outputs(doc: Path, results: list[RunResult], meta: dict[str, Any]) -> None:
    """The results JSON, the markdown fragment and the figure, all next to ``doc``."""
    rows = summarise(results)
    meta = {**meta, "observations": observations(rows)}
    doc.parent.mkdir(parents=True, exist_ok=True)
    results_path = doc.with_name(doc.stem + "_results.json")
    results_path.write_text(
        json.dumps(
            {"meta": meta, "fleet": FLEET, "rows": rows, "runs": [asdict(r) for r in results]},
            indent=1,
            default=str,
        )
        + "\n"
    )
    doc.write_text(markdown(rows, meta))
    fig = figure(rows, doc.with_name(doc.stem + "_accuracy_vs_epsilon.png"))
    print(f"\nwrote {doc}, {results_path}, {fig}")


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def observations(rows: list[dict[str, Any]]) -> list[str]:
    """Facts the table shows that a reader could miss; computed from the rows, not typed in."""
    notes = []
    for r in rows:
        eps, target, pld = (
            r.get("epsilon_worst"),
            r.get("target_epsilon"),
            r.get("epsilon_pld_worst"),
        )
        name = f"{r['mechanism']} eps={_f(target, 'g')}"
        if (r.get("max_round_wall_s") or 0) > 10:
            notes.append(
                f"{name}: a round took {r['max_round_wall_s']:.1f} s (deadline 120 s), i.e. it "
                "waited for its deadline although the devices answer in well under a second"
            )
        if r.get("rounds_closed_min") is not None and r["rounds_closed_min"] < r["rounds"]:
            notes.append(
                f"{name}: only {r['rounds_closed_min']} of {r['rounds']} rounds closed in the "
                "worst repeat"
            )
        if eps is None or target is None:
            continue
        if eps > target * (1 + 1e-6):
            why = (
                f"; PLD gives {pld:.3f} for the same events, so the calibration holds and the "
                f"{'/'.join(r['accountants'])} bound the ledger reports is the looser one"
                if pld is not None and pld <= target * (1 + 1e-6)
                else ""
            )
            notes.append(
                f"{name}: the reported total {eps:.3f} exceeds the target the noise was "
                f"calibrated for{why}"
            )
        elif eps < 0.95 * target and r["mechanism"] == "nbafl":
            notes.append(
                f"{name}: reported {eps:.3f}, below the target: NbAFL's calibration grows the "
                f"noise linearly in the L = {r['rounds']} exposures (basic composition) while the "
                "accountant composes the Gaussian releases in quadrature, and the worst device "
                "may have uploaded in fewer than all rounds"
            )
        elif eps < 0.95 * target:
            notes.append(
                f"{name}: reported {eps:.3f}, below the target: the noise is calibrated for a "
                f"device that uploads in all {r['rounds']} rounds, and with 20 of 50 devices "
                "selected per round the worst device uploaded less often"
            )
    return notes


if __name__ == "__main__":
    main()

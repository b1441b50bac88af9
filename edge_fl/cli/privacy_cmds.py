"""``edge-fl privacy ...`` (accounting, calibration) and ``edge-fl audit ...`` (empirical DP audit).

Every number comes from the ledger / mechanism modules, never computed here by hand. ``--json``
prints one object with at least ``epsilon``, ``delta`` and ``accountant``.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from typing import Any, Literal

import click
from rich.console import Console
from rich.table import Table

from edge_fl.privacy.accountants import DP_ACCOUNTING_VERSION, Accountant, compose_epsilon
from edge_fl.privacy.audit import audit_gaussian, audit_laplace, audit_rr
from edge_fl.privacy.dpsgd import DpSgdConfig, calibrate_dpsgd_noise_multiplier
from edge_fl.privacy.events import PrivacyEvent, relation_name
from edge_fl.privacy.gaussian import calibrate_central_noise_multiplier, central_privacy_event
from edge_fl.privacy.laplace import LaplaceConfig
from edge_fl.privacy.randomized_response import rr_privacy_event
from edge_fl.privacy.rng import secure_generator, seeded_generator

__all__ = ["audit_group", "privacy_group"]


class _Real(click.ParamType):
    """A finite real in an interval; the error names the value and the domain."""

    name = "number"

    def __init__(self, lo: float, hi: float, lo_open: bool, hi_open: bool) -> None:
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        self.domain = f"{left}{lo:g}, {hi:g}{right}"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number in {self.domain}", param, ctx)
        ok = math.isfinite(v) or (math.isinf(self.hi) and v == math.inf and not self.hi_open)
        ok = ok and (v > self.lo if self.lo_open else v >= self.lo)
        ok = ok and (v < self.hi if self.hi_open else v <= self.hi)
        if not ok:
            self.fail(f"{value!r} is not in {self.domain}", param, ctx)
        return v


class _Int(click.ParamType):
    name = "integer"

    def __init__(self, lo: int) -> None:
        self.lo = lo

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            v = int(str(value), 10)
        except ValueError:
            self.fail(f"{value!r} is not an integer >= {self.lo}", param, ctx)
        if v < self.lo:
            self.fail(f"{value!r} is not an integer >= {self.lo}", param, ctx)
        return v


POSITIVE = _Real(0.0, math.inf, True, True)
PROBABILITY = _Real(0.0, 1.0, True, False)
DELTA = _Real(0.0, 1.0, False, True)
OPEN_DELTA = _Real(0.0, 1.0, True, True)
COUNT = _Int(1)
SEED = _Int(0)


#: the accountants noise calibration searches with (click.Choice guarantees the domain)
_Calibrating = Literal["rdp", "pld"]


def _emit(as_json: bool, title: str, data: dict) -> None:
    if as_json:
        click.echo(json.dumps(data, default=str))
        return
    table = Table(title=title, show_header=False)
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in data.items():
        table.add_row(str(k), f"{v:.7g}" if isinstance(v, float) else str(v))
    Console().print(table)


def _guarded(fn: Callable[[], Any]) -> Any:
    """Library domain errors surface as click.BadParameter (message names value and domain)."""
    try:
        return fn()
    except ValueError as err:
        raise click.BadParameter(str(err)) from err


def _accounting(events: list[PrivacyEvent], delta: float, accountant: Accountant) -> dict:
    res = _guarded(lambda: compose_epsilon(events, delta, accountant))
    out: dict = {
        "epsilon": res.epsilon,
        "delta": res.delta,
        "accountant": accountant,
        "accountant_impl": f"dp-accounting {DP_ACCOUNTING_VERSION}",
        "neighbouring_relation": relation_name(res.relation) if res.relation else None,
        "unit": res.unit,
        "sampling": (
            "poisson (secret, CSPRNG selection assumed)"
            if any(e.poisson_sampled for e in events)
            else "none"
        ),
    }
    if res.optimal_order is not None:
        out["rdp_optimal_order"] = res.optimal_order
        out["rdp_order_at_grid_edge"] = res.order_at_grid_edge
    return out


_json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")


@click.group("privacy")
def privacy_group() -> None:
    """Privacy accounting and noise calibration (dp-accounting)."""


@privacy_group.command("dpsgd")
@click.option("--sigma", type=POSITIVE, required=True, help="Noise multiplier.")
@click.option("--q", type=PROBABILITY, required=True, help="Poisson sampling rate.")
@click.option("--steps", type=COUNT, required=True)
@click.option("--delta", type=OPEN_DELTA, required=True)
@click.option("--accountant", type=click.Choice(["rdp", "pld"]), default="rdp", show_default=True)
@_json_opt
def dpsgd_cmd(
    sigma: float, q: float, steps: int, delta: float, accountant: Accountant, as_json: bool
):
    """Epsilon of DP-SGD: SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)."""
    ev = _guarded(lambda: DpSgdConfig(1.0, sigma, q).privacy_event(steps))
    out = _accounting([ev], delta, accountant)
    out.update(sigma=sigma, q=q, steps=steps)
    _emit(as_json, "DP-SGD", out)


@privacy_group.command("laplace")
@click.option("--eps-round", type=POSITIVE, required=True, help="Pure eps per release.")
@click.option("--rounds", type=COUNT, required=True)
@click.option("--delta", type=DELTA, required=True)
@click.option(
    "--accountant",
    type=click.Choice(["basic", "advanced", "pld", "rdp"]),
    default="pld",
    show_default=True,
)
@_json_opt
def laplace_cmd(eps_round: float, rounds: int, delta: float, accountant: Accountant, as_json: bool):
    """Epsilon of ``rounds`` Laplace output-perturbation releases at ``eps-round`` each."""
    cfg = _guarded(lambda: LaplaceConfig(1.0, 1.0, eps_round * rounds, rounds))
    events = [cfg.privacy_event(r) for r in range(rounds)]
    out = _accounting(events, delta, accountant)
    out.update(eps_round=eps_round, rounds=rounds, basic_epsilon=eps_round * rounds)
    _emit(as_json, "Laplace output perturbation", out)


@privacy_group.command("fedavg")
@click.option("--z", type=POSITIVE, required=True, help="Noise multiplier (std / clip).")
@click.option("--q", type=PROBABILITY, required=True, help="Expected participants / population.")
@click.option("--rounds", type=COUNT, required=True)
@click.option("--delta", type=OPEN_DELTA, required=True)
@click.option("--accountant", type=click.Choice(["rdp", "pld"]), default="rdp", show_default=True)
@_json_opt
def fedavg_cmd(
    z: float, q: float, rounds: int, delta: float, accountant: Accountant, as_json: bool
):
    """Epsilon of central DP-FedAvg (device level) over ``rounds`` rounds."""
    ev = _guarded(lambda: central_privacy_event(z, q, rounds))
    out = _accounting([ev], delta, accountant)
    out.update(z=z, q=q, rounds=rounds)
    _emit(as_json, "DP-FedAvg (central)", out)


@privacy_group.command("rr")
@click.option("--eps", type=POSITIVE, required=True, help="Pure eps per report.")
@click.option("--rounds", type=COUNT, required=True)
@click.option("--delta", type=DELTA, required=True)
@click.option("--accountant", type=click.Choice(["rdp", "pld"]), default="pld", show_default=True)
@_json_opt
def rr_cmd(eps: float, rounds: int, delta: float, accountant: Accountant, as_json: bool):
    """Epsilon of ``rounds`` randomized-response reports (each composed individually)."""
    ev = _guarded(lambda: rr_privacy_event(eps))
    out = _accounting([ev] * rounds, delta, accountant)
    out.update(eps_round=eps, rounds=rounds, basic_epsilon=eps * rounds)
    _emit(as_json, "Randomized response", out)


@privacy_group.group("calibrate")
def calibrate_group() -> None:
    """Smallest noise multiplier meeting a target (eps, delta)."""


def _calibrated(kind: str, z: float, target: float, delta: float, accountant: str, **kw) -> dict:
    return {
        "noise_multiplier": z,
        "target_epsilon": target,
        "delta": delta,
        "accountant": accountant,
        "accountant_impl": f"dp-accounting {DP_ACCOUNTING_VERSION}",
        "mechanism": kind,
        **kw,
    }


@calibrate_group.command("dpsgd")
@click.option("--target-eps", type=POSITIVE, required=True)
@click.option("--delta", type=OPEN_DELTA, required=True)
@click.option("--q", type=PROBABILITY, required=True)
@click.option("--steps", type=COUNT, required=True)
@click.option("--accountant", type=click.Choice(["rdp", "pld"]), default="rdp", show_default=True)
@_json_opt
def calibrate_dpsgd_cmd(
    target_eps: float,
    delta: float,
    q: float,
    steps: int,
    accountant: _Calibrating,
    as_json: bool,
):
    """Noise multiplier sigma for DP-SGD."""
    z = _guarded(lambda: calibrate_dpsgd_noise_multiplier(target_eps, delta, q, steps, accountant))
    eps = _accounting([DpSgdConfig(1.0, z, q).privacy_event(steps)], delta, accountant)["epsilon"]
    out = _calibrated("dpsgd", z, target_eps, delta, accountant, epsilon=eps, q=q, steps=steps)
    _emit(as_json, "Calibrated DP-SGD", out)


@calibrate_group.command("fedavg")
@click.option("--target-eps", type=POSITIVE, required=True)
@click.option("--delta", type=OPEN_DELTA, required=True)
@click.option("--q", type=PROBABILITY, required=True)
@click.option("--rounds", type=COUNT, required=True)
@click.option("--accountant", type=click.Choice(["rdp", "pld"]), default="rdp", show_default=True)
@_json_opt
def calibrate_fedavg_cmd(
    target_eps: float,
    delta: float,
    q: float,
    rounds: int,
    accountant: _Calibrating,
    as_json: bool,
):
    """Noise multiplier z for central DP-FedAvg."""
    z = _guarded(
        lambda: calibrate_central_noise_multiplier(target_eps, delta, q, rounds, accountant)
    )
    eps = _accounting([central_privacy_event(z, q, rounds)], delta, accountant)["epsilon"]
    out = _calibrated("fedavg", z, target_eps, delta, accountant, epsilon=eps, q=q, rounds=rounds)
    _emit(as_json, "Calibrated DP-FedAvg (central)", out)


# ----------------------------------------------------------------------------------------------


@click.group("audit")
def audit_group() -> None:
    """Empirical lower bounds on eps for the production mechanisms (Clopper-Pearson).

    Each run passes when the lower bound at confidence 1 - alpha is at most the claim: a correct
    mechanism fails at most alpha of runs (--alpha 0.05: 1 run in 20 at worst; the exact rate
    of the Laplace test at eps 1 is about 0.4%). Lower --alpha for fewer false alarms."""


def _audit_options(fn: Callable) -> Callable:
    fn = click.option("--seed", type=SEED, default=None, help="Seed (reproducible, NOT secure).")(
        fn
    )
    fn = _json_opt(fn)
    fn = click.option(
        "--alpha",
        type=OPEN_DELTA,
        default=0.05,
        show_default=True,
        help="false-alarm rate: the bound holds at confidence 1 - alpha",
    )(fn)
    fn = click.option("--n", "n", type=COUNT, required=True, help="Runs per input.")(fn)
    return click.option("--eps", type=POSITIVE, required=True, help="Claimed eps.")(fn)


def _run_audit(title: str, seed: int | None, as_json: bool, run: Callable) -> None:
    rng = secure_generator() if seed is None else seeded_generator(seed)
    out = _guarded(lambda: run(rng))
    out["passed"] = out["epsilon_lower_bound"] <= out["claimed_epsilon"]
    out["rng"] = "chacha20-urandom" if seed is None else f"pcg64-seeded (seed {seed})"
    _emit(as_json, title, out)


@audit_group.command("laplace")
@_audit_options
@click.option("--delta", type=DELTA, default=0.0, show_default=True, help="Claimed delta.")
def audit_laplace_cmd(eps: float, n: int, alpha: float, as_json: bool, seed: int | None, delta):
    """Audit mechanism A (one step + Laplace) at claimed (eps, delta)."""
    _run_audit(
        "Audit: Laplace",
        seed,
        as_json,
        lambda rng: audit_laplace(eps, n, rng, alpha=alpha, delta=delta),
    )


@audit_group.command("gaussian")
@_audit_options
@click.option("--delta", type=OPEN_DELTA, required=True, help="Claimed delta (calibration).")
@click.option("--audit-delta", type=OPEN_DELTA, default=1e-3, show_default=True)
def audit_gaussian_cmd(
    eps: float,
    n: int,
    alpha: float,
    as_json: bool,
    seed: int | None,
    delta: float,
    audit_delta: float,
):
    """Audit the local Gaussian mechanism calibrated for (eps, delta), checked at audit-delta."""
    _run_audit(
        "Audit: Gaussian",
        seed,
        as_json,
        lambda rng: audit_gaussian(eps, delta, n, rng, audit_delta=audit_delta, alpha=alpha),
    )


@audit_group.command("rr")
@_audit_options
@click.option("--delta", type=DELTA, default=0.0, show_default=True, help="Claimed delta.")
def audit_rr_cmd(eps: float, n: int, alpha: float, as_json: bool, seed: int | None, delta):
    """Audit randomized response at claimed (eps, delta)."""
    _run_audit(
        "Audit: randomized response",
        seed,
        as_json,
        lambda rng: audit_rr(eps, n, rng, alpha=alpha, delta=delta),
    )


# ---------------------------------------------------------------------------------------------- SignDS

# Which flag carries which library key, so a domain error points at the flag the user typed.
_SIGNDS_FLAGS = {
    "signds.sign_k": "--k",
    "signds.sign_eps": "--eps",
    "signds.sign_thr_ratio": "--thr",
    "signds.sign_dim_out": "--dim-out",
    "signds.max_dim_out": "--max-dim-out",
    "model dimension d": "--d",
}


def _signds_guarded(fn: Callable[[], Any]) -> Any:
    """Like ``_guarded``, but the error names the flag as well as the key, value and domain."""
    try:
        return fn()
    except ValueError as err:
        msg = str(err)
        flag = next((f for key, f in _SIGNDS_FLAGS.items() if msg.startswith(key)), None)
        raise click.BadParameter(msg, param_hint=f"'{flag}'" if flag else None) from err


@privacy_group.command("signds")
@click.option("--d", "d", type=int, required=True, help="Model dimension (parameters updated).")
@click.option("--k", "k", type=float, default=0.01, show_default=True, help="sign_k, (0, 0.25].")
@click.option("--eps", type=float, default=100.0, show_default=True, help="sign_eps, (0, 100].")
@click.option("--thr", type=float, default=0.6, show_default=True, help="sign_thr_ratio, [0.5, 1].")
@click.option("--dim-out", type=int, default=0, show_default=True, help="h; 0 = optimise.")
@click.option("--max-dim-out", type=int, default=100, show_default=True, help="Cap on h.")
@_json_opt
def signds_cmd(
    d: int, k: float, eps: float, thr: float, dim_out: int, max_dim_out: int, as_json: bool
):
    """SignDS plan for a d-dimensional model: top-k size K, output dimension h, threshold nu_th.

    Exact log-space search (no Java double overflow), then the explicit cap ``--max-dim-out``.
    """
    from edge_fl.privacy.signds import SignDSParams, check_dimension, plan

    def build() -> tuple[Any, list[str]]:
        params = SignDSParams(k=k, eps=eps, thr_ratio=thr, dim_out=dim_out, max_dim_out=max_dim_out)
        return plan(params, d), check_dimension(params, d)

    p, warnings = _signds_guarded(build)
    out = {"sign_k": k, "sign_eps": eps, "sign_thr_ratio": thr, **p.describe()}
    out.update(dim_out=dim_out, max_dim_out=max_dim_out, warnings=warnings)
    _emit(as_json, "SignDS plan", out)


@audit_group.command("signds")
@_audit_options
@click.option("--d", "d", type=int, default=20, show_default=True, help="Model dimension.")
@click.option("--k-count", type=int, default=4, show_default=True, help="Top-k size K.")
@click.option("--h", "h", type=int, default=None, help="Output dimension (default: optimised).")
def audit_signds_cmd(
    eps: float,
    n: int,
    alpha: float,
    as_json: bool,
    seed: int | None,
    d: int,
    k_count: int,
    h: int | None,
):
    """Audit the SignDS exponential mechanism (production sampler) at claimed eps."""
    from edge_fl.privacy.signds import audit_signds

    _run_audit(
        "Audit: SignDS",
        seed,
        as_json,
        lambda rng: audit_signds(eps, n, rng, d=d, k_count=k_count, h=h, alpha=alpha),
    )


# ------------------------------------------------------------------------------------------
# Through the mechanism registry: what exists, and what a job will cost before it runs


@privacy_group.command("mechanisms")
@_json_opt
def mechanisms_cmd(as_json: bool) -> None:
    """List the registered privacy mechanisms and what each guarantees."""
    from edge_fl.mechanisms import mechanism_class, mechanism_names

    rows: list[dict[str, Any]] = []
    for name in mechanism_names():
        cls = mechanism_class(name)
        rows.append(
            {
                "name": name,
                "guarantee": cls.guarantee.text(),
                "wire": {"u": "dense delta", "s": "SignDS vote"}.get(cls.wire_kind, cls.wire_kind),
                "server_noise_every_round": cls.acts_on_empty_round,
                "summary": (sys.modules[cls.__module__].__doc__ or "").strip().split("\n")[0],
            }
        )
    if as_json:
        click.echo(json.dumps(rows))
        return
    table = Table(title="privacy mechanisms (edge_fl/mechanisms/)")
    # names whole on one line (they are what --mechanism takes); long words elsewhere fold
    # rather than end in an ellipsis at 80 columns
    table.add_column("name", no_wrap=True)
    for column in ("what", "guarantee", "wire"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["name"], row["summary"], row["guarantee"], row["wire"])
    Console().print(table)


@privacy_group.command("plan")
@click.option("--config", "config", type=click.Path(dir_okay=False), help="job YAML or TOML")
@click.option("--set", "pairs", multiple=True, help="override, e.g. --set privacy.epsilon=4")
@_json_opt
def plan_cmd(config: str | None, pairs: tuple[str, ...], as_json: bool) -> None:
    """A job's mechanism as configured (calibrated noise, L, every parameter), the worst-case
    total epsilon if every device makes all the uploads its schedule allows, and whether a
    per-device --budget is enforced or refused (gaussian-central: refused). With
    secure_aggregation enabled, or with distributed-gaussian (which runs only so), also the secure
    sum's layout (length, ring bits, bytes against float32) and the noise it was calibrated for."""
    import yaml

    from edge_fl.cli import fail, load_job_config, set_overrides
    from edge_fl.config import ConfigError
    from edge_fl.job import budget_refusal, build_job
    from edge_fl.mechanisms.distributed_gaussian import DistributedGaussian
    from edge_fl.mechanisms.secure import secure_job_from, secure_plan
    from edge_fl.privacy.accountants import best_epsilon

    cfg = load_job_config(config, set_overrides(pairs))
    try:
        job = build_job(cfg)
    except ConfigError as exc:
        fail(str(exc))
    mech = job.mechanism
    selected = max(2, job.secure_selected)  # a FedBuff cohort's K', as the engine
    section = getattr(cfg, "secure_aggregation", None)
    secure_job = _guarded(lambda: secure_job_from(section, job.model.n_params, selected))
    if secure_job is None and isinstance(mech, DistributedGaussian):
        secure_job = mech.job  # it only runs securely: its own assumed floor
    secure = None
    if secure_job is not None:
        secure = _guarded(lambda: secure_plan(mech, secure_job))
    out: dict[str, Any] = {**mech.describe(), "warnings": job.warnings}
    if secure is not None:
        out["secure_aggregation"] = secure
    refused = budget_refusal(mech)
    if mech.accounts:
        out["budget"] = {
            "budget_epsilon": cfg.privacy.budget_epsilon,
            "per_device_budget": "refused" if refused else "enforced",
            "why": refused
            or "each device counts its own releases and stops before one would take it past "
            "privacy.budget_epsilon (--budget)",
        }
    if mech.accounts:
        uploads = mech.max_exposures() or cfg.rounds.rounds
        worst = max(job.facts.dataset_sizes, key=lambda n: -n)  # smallest |D|: largest q, steps
        events = [e for i in range(uploads) for e in mech.release_events(worst, i)]
        events += [e for _ in range(cfg.rounds.rounds) for e in mech.round_events()]
        bound = _guarded(lambda: best_epsilon(events, cfg.privacy.delta))
        out["worst_case_uploads_per_device"] = uploads
        out["worst_case_total"] = bound.as_dict()
    if as_json:
        click.echo(json.dumps(out, default=str))
        return
    click.echo(yaml.safe_dump(json.loads(json.dumps(out, default=str)), sort_keys=False))

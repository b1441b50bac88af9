"""A mechanism's events must hold under the guarantee it declares: the ledger reports their
composition next to the guarantee's text, so an event under another relation or unit would put an
epsilon under a label it does not prove (an outside user's mechanism declared replace-one per device
and charged add/remove-one events: 2.94 reported where the same noise is worth 6.57)."""

from __future__ import annotations

import uuid

import pytest
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant
from helpers import mechanisms_registered

import edge_fl
from edge_fl.config import ConfigError
from edge_fl.mechanisms import GuaranteeMismatch
from edge_fl.mechanisms.base import Guarantee, Mechanism, dense_update, local_update
from edge_fl.privacy.accountants import RDP_ORDERS
from edge_fl.privacy.events import PrivacyEvent
from edge_fl.privacy.noise import gaussian_noise

Z = 1.1  # noise multiplier, relative to the replace-one sensitivity 2C of a clipped delta
CLIP = 0.5
ROUNDS = 3


class LocalGaussian(Mechanism):
    """Each device clips its delta to L2 norm C and adds N(0, (2 C Z)^2): replace-one per device."""

    name = "user-gaussian"
    guarantee = Guarantee("device", "replace_one", "approximate")
    relation: NeighboringRelation | str = "replace_one"
    unit = "device"

    def device_update(self, device, msg, exposure):
        delta = local_update(device, msg)
        norm = float((delta**2).sum() ** 0.5)
        if norm > CLIP:
            delta = delta * (CLIP / norm)
        noisy = delta + gaussian_noise(device.rng, 2 * CLIP * Z, delta.shape)
        return dense_update(device, msg, noisy, self.name)

    def release_events(self, n_samples, exposure):
        return [PrivacyEvent(dp_event.GaussianDpEvent(Z), self.relation, self.unit, self.name)]


class AddRemoveEvents(LocalGaussian):
    name = "user-add-remove"
    relation = NeighboringRelation.ADD_OR_REMOVE_ONE  # the outside user's mechanism


class ExampleEvents(LocalGaussian):
    name = "user-example"
    unit = "example"


class ReplaceOneUnderAddRemove(LocalGaussian):
    name = "user-replace-under-ar"
    guarantee = Guarantee("device", "add_or_remove_one", "approximate")


class LateMismatch(LocalGaussian):
    """Consistent for the first upload the job checks; an add/remove event from the 3rd on."""

    name = "user-late"

    def release_events(self, n_samples, exposure):
        relation = "add_or_remove_one" if exposure >= 2 else "replace_one"
        return [PrivacyEvent(dp_event.GaussianDpEvent(Z), relation, "device", self.name)]


def config(name: str):
    return edge_fl.load_config(
        None,
        {
            "job": f"g-{uuid.uuid4().hex[:8]}",
            "model.name": "logreg",
            "data.devices": 4,
            "rounds.rounds": ROUNDS,
            "rounds.clients_per_round": 4,
            "privacy.mechanism": name,
        },
    )


@pytest.mark.parametrize(
    ("mechanism", "declared", "event"),
    [
        (AddRemoveEvents, "relation='replace_one'", "relation 'add_or_remove_one', unit 'device'"),
        (ExampleEvents, "unit='device'", "relation 'replace_one', unit 'example'"),
        (ReplaceOneUnderAddRemove, "relation='add_or_remove_one'", "'replace_one', unit 'device'"),
    ],
)
def test_events_that_disagree_with_the_guarantee_are_refused_when_the_job_is_built(
    tmp_path, mechanism, declared, event
):
    out = tmp_path / "run"
    with mechanisms_registered(mechanism):
        with pytest.raises(ConfigError) as refused:
            edge_fl.build_job(config(mechanism.name))
        with pytest.raises(ConfigError):
            edge_fl.run_simulation(config(mechanism.name), out)
    line = str(refused.value)
    assert "\n" not in line, line
    assert f"privacy: privacy.mechanism = {mechanism.name!r} declares" in line
    assert declared in line and event in line, line
    assert "does not imply it" in line
    assert not out.exists()  # refused before the run directory was made


def test_a_mismatch_the_build_did_not_see_is_refused_when_charged():
    """The job checks an upload's events for its facts; the aggregator's ledger checks every
    event it charges, and a refused one changes nothing."""
    with mechanisms_registered(LateMismatch):
        job = edge_fl.build_job(config(LateMismatch.name))
        privacy = job.aggregator_core().privacy
        assert privacy is not None
        privacy.record_upload("d0", 10, 1)
        privacy.record_upload("d0", 10, 2)
        with pytest.raises(GuaranteeMismatch) as refused:
            privacy.record_upload("d0", 10, 3)
    assert "\n" not in str(refused.value)
    assert "'user-late' declares Guarantee(unit='device', relation='replace_one')" in str(
        refused.value
    )
    assert privacy.exposures["d0"] == 2 and len(privacy.ledger.entries) == 2


def test_a_consistent_mechanism_runs_and_reports_dp_accountings_epsilon(tmp_path):
    with mechanisms_registered(LocalGaussian):
        summary = edge_fl.run_simulation(config(LocalGaussian.name), tmp_path / "run").summary
    p = summary["privacy"]
    assert p["neighbouring_relation"] == "replace_one" and p["unit"] == "device"
    assert p["guarantee"] == "(eps, delta)-DP per device, replace-one neighbours"
    assert summary["total_received"] == 4 * ROUNDS  # every device in every round
    releases = ROUNDS
    # by hand: the multiplier is relative to the declared relation's sensitivity, so the shift is
    # 1/Z (dp-accounting's add/remove reading of GaussianDpEvent(Z)), composed ROUNDS times
    event = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(Z), releases)
    rdp = RdpAccountant(list(RDP_ORDERS)).compose(event).get_epsilon(p["delta"])
    pld = PLDAccountant().compose(event).get_epsilon(p["delta"])
    assert p["epsilon_by_accountant"]["rdp"] == pytest.approx(rdp, rel=1e-9)
    assert p["epsilon_by_accountant"]["pld"] == pytest.approx(pld, rel=1e-3)
    assert p["epsilon"] == pytest.approx(min(rdp, pld), rel=1e-3)


def test_device_level_local_dp_may_back_an_example_level_guarantee():
    """Local DP (any two inputs of a device) proves every example-level relation: claiming less
    than the events prove mislabels nothing."""

    class Weaker(LocalGaussian):
        name = "user-weaker-claim"
        guarantee = Guarantee("example", "add_or_remove_one", "approximate")

    with mechanisms_registered(Weaker):
        job = edge_fl.build_job(config(Weaker.name))
        assert job.aggregator_core().privacy is not None


def test_privacy_event_takes_the_relation_as_guarantee_spells_it():
    by_name = PrivacyEvent(dp_event.GaussianDpEvent(Z), "replace_one", "device", "x")
    by_enum = PrivacyEvent(dp_event.GaussianDpEvent(Z), NeighboringRelation.REPLACE_ONE, "device")
    assert by_name.relation is NeighboringRelation.REPLACE_ONE
    assert by_name.key == by_enum.key
    with pytest.raises(ValueError, match="'add_or_remove_one', 'replace_one', 'replace_special'"):
        PrivacyEvent(dp_event.GaussianDpEvent(Z), "replace-one", "device")


@pytest.mark.parametrize(
    "name", ["laplace", "gaussian", "gaussian-central", "signds", "nbafl", "dpsgd"]
)
def test_every_builtin_mechanism_charges_events_its_guarantee_covers(name):
    cfg = edge_fl.load_config(
        None,
        {
            "job": f"b-{uuid.uuid4().hex[:8]}",
            "model.name": "logreg",
            "data.devices": 6,
            "rounds.rounds": 3,
            "rounds.clients_per_round": 6,
            "privacy.mechanism": name,
            "privacy.epsilon": 8.0,
        },
    )
    mech = edge_fl.build_job(cfg).mechanism
    events = mech.release_events(mech.facts.min_dataset_size, 0) + mech.round_events()
    assert events and mech.check_events(events) == events


def test_a_run_whose_mechanism_charges_a_mismatched_event_stops_without_a_summary(tmp_path):
    """Not counted as one bad payload (the device released it): the ledger cannot charge the
    release under the reported guarantee, so the job stops rather than leave it out."""
    with mechanisms_registered(LateMismatch), pytest.raises(GuaranteeMismatch, match="user-late"):
        edge_fl.run_simulation(config(LateMismatch.name), tmp_path / "run")
    assert not (tmp_path / "run" / "summary.json").exists()

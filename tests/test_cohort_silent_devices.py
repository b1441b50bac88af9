"""A device that is online but never advertises keys held every FedBuff cohort it landed in to
the keys phase's timeout, and no other cohort is dispatched meanwhile (a red team's silent
device made 6 cohorts take 9.5 s instead of 1.5 s, and it stayed selectable). Now a device
silent in its last cohort is picked only when too few others are free."""

from __future__ import annotations

from edge_fl.config import load_config
from edge_fl.job import build_job
from edge_fl.protocol import Status, encode_status
from edge_fl.secagg.device import DeviceSession

DEVICES = 14
SILENT = "d00003"


def secure_fedbuff_core():
    cfg = load_config(None, {
        "data.devices": DEVICES, "model.name": "logreg", "rounds.mode": "fedbuff",
        "rounds.buffer_size": 4, "rounds.concurrency": DEVICES, "rounds.rounds": 50,
        "secure_aggregation.enabled": True, "secure_aggregation.phase_timeout_s": 5.0,
        "seed": 3, "reproducible": True,
    })  # fmt: skip
    core = build_job(cfg).aggregator_core()
    for i in range(DEVICES):
        device = f"d{i:05d}"
        core.on_status(device, encode_status(Status(device, True, 30)))
    return core


def run_keys_phase(cohort, now: float) -> None:
    """Every member but SILENT advertises; the keys phase then times out."""
    sr = cohort.session
    for device in sorted(cohort.selected - {SILENT}):
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload, now)
    sr.tick(now + 5.0)
    assert sr.phase != "keys" or sr.finished


def test_a_device_silent_in_its_cohort_is_not_picked_again_while_others_are_free():
    core = secure_fedbuff_core()
    policy = core.cohorts
    now = 0.0
    while True:  # until SILENT lands in a cohort
        cohort, _ = policy.open_cohort(now)
        run_keys_phase(cohort, now)
        policy.drop(cohort)
        now += 10.0
        if SILENT in cohort.selected:
            break
    assert SILENT in policy.silent
    picked = 0
    for _ in range(20):  # 13 answering devices free, cohorts of 6: never SILENT
        cohort, _ = policy.open_cohort(now)
        picked += SILENT in cohort.selected
        run_keys_phase(cohort, now)
        policy.drop(cohort)
        now += 10.0
    assert picked == 0


def test_a_silent_device_fills_a_cohort_when_too_few_others_are_free_and_is_forgiven():
    core = secure_fedbuff_core()
    policy = core.cohorts
    policy.silent.add(SILENT)
    first, _ = policy.open_cohort(0.0)  # 6 of the 13 answering devices
    run_keys_phase(first, 0.0)
    second, _ = policy.open_cohort(10.0)  # 7 answering free + SILENT: 6 chosen, SILENT not
    assert SILENT not in second.selected
    policy.drop(first)
    run_keys_phase(second, 10.0)
    policy.drop(second)
    core.on_status("d00000", encode_status(Status("d00000", False, 30)))
    # 13 free, 12 of them answering... force a shortage: only 6 devices online
    for i in range(DEVICES):
        device = f"d{i:05d}"
        online = device in {SILENT, "d00001", "d00002", "d00004", "d00005", "d00006"}
        core.on_status(device, encode_status(Status(device, online, 30)))
    third, _ = policy.open_cohort(20.0)
    assert SILENT in third.selected  # needed to fill the cohort
    sr = third.session
    sr.receive(SILENT, DeviceSession(SILENT, sr.session.params).advertise().payload, 20.0)
    sr.tick(25.0)
    policy.drop(third)
    assert SILENT not in policy.silent  # it advertised: forgiven


def shortage(core) -> None:
    """Only six devices online, SILENT among them: every cohort needs it (frozen rosters)."""
    for i in range(DEVICES):
        device = f"d{i:05d}"
        online = device in {SILENT, "d00001", "d00002", "d00004", "d00005", "d00006"}
        core.on_status(device, encode_status(Status(device, online, 30)))


def test_a_silent_device_on_probation_does_not_hold_the_keys_phase_to_its_timeout():
    """With too few others free (the whole fleet in a cohort), SILENT is picked, but once every
    other member advertised, the keys phase waits for it only as long again as the others took:
    0.3 s here, not the 5 s timeout. A returning device that advertises within it is taken."""
    core = secure_fedbuff_core()
    policy = core.cohorts
    policy.silent.add(SILENT)
    policy.probation.add(SILENT)
    shortage(core)
    cohort, _ = policy.open_cohort(20.0)
    assert SILENT in cohort.selected and cohort.session.probation == {SILENT}
    sr = cohort.session
    for device in sorted(cohort.selected - {SILENT}):
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload, 20.3)
    assert sr.phase == "keys" and sr.deadline == 20.6
    sr.tick(20.59)
    assert sr.phase == "keys"
    sr.tick(20.6)
    assert sr.phase == "shares" and sr.session.counts["keys"] == 5  # closed without SILENT
    policy.drop(cohort)
    assert SILENT in policy.silent
    # the next cohort: SILENT advertises in time (it came back) and is forgiven
    again, _ = policy.open_cohort(30.0)
    sr = again.session
    for device in sorted(again.selected - {SILENT}):
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload, 30.3)
    sr.receive(SILENT, DeviceSession(SILENT, sr.session.params).advertise().payload, 30.5)
    assert sr.phase == "shares" and sr.session.counts["keys"] == 6
    policy.drop(again)
    assert SILENT not in policy.silent
    assert SILENT in policy.probation  # kept: alternating silent and punctual gains nothing


def test_without_probation_the_keys_phase_waits_for_every_member():
    core = secure_fedbuff_core()
    policy = core.cohorts
    shortage(core)
    cohort, _ = policy.open_cohort(0.0)  # SILENT not known silent yet: no probation
    sr = cohort.session
    assert sr.probation == frozenset()
    for device in sorted(cohort.selected - {SILENT}):
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload, 0.3)
    assert sr.deadline == 5.0
    sr.tick(4.9)
    assert sr.phase == "keys"


def test_a_device_that_advertises_just_before_the_timeout_goes_on_probation():
    """A red team's device advertised 1.95 s into a 2 s keys phase, every cohort: never silent,
    it held each one to nearly the timeout. Keys more than twice as late as the rest of the
    cohort's, and by more than a tenth of the timeout, put it on probation; the next cohort
    then waits for it only as long again as the others took."""
    core = secure_fedbuff_core()
    policy = core.cohorts
    shortage(core)
    cohort, _ = policy.open_cohort(0.0)
    sr = cohort.session
    for device in sorted(cohort.selected - {SILENT}):
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload, 0.2)
    sr.receive(SILENT, DeviceSession(SILENT, sr.session.params).advertise().payload, 4.9)
    assert sr.late_advertiser() == SILENT
    policy.drop(cohort)
    assert SILENT in policy.probation and SILENT not in policy.silent
    again, _ = policy.open_cohort(10.0)
    assert again.session.probation == {SILENT}
    # punctual members are not flagged: the last of a close bunch is not late
    sr = again.session
    for i, device in enumerate(sorted(again.selected)):
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload,
                   10.2 + 0.01 * i)  # fmt: skip
    assert sr.late_advertiser() is None


def test_devices_on_probation_are_spread_so_cutting_them_leaves_each_cohort_its_floor():
    """A red team put a silent and a late device in a fleet of 12 (two cohorts of 6, floor 5):
    both landed in the same cohort every time, cutting both would leave 4 < 5, so the keys
    phase waited for the late one and then for the silent one's timeout. Answering devices on
    probation now go at most n - floor to a cohort, spread over the cohorts."""
    core = secure_fedbuff_core()
    policy = core.cohorts
    late = {"d00001", "d00002"}
    policy.probation |= late
    first, _ = policy.open_cohort(0.0)
    floor = core.secure.min_survivors
    assert len(first.selected) - floor == 1
    run_keys_phase(first, 0.0)
    second, _ = policy.open_cohort(10.0)
    assert len(first.selected & late) == 1 and len(second.selected & late) == 1


def test_a_cohort_waiting_only_for_members_on_probation_does_not_hold_the_next_dispatch():
    """While a cohort is in its keys phase no other is dispatched (the retained global topic),
    except once it waits only for members on probation: a silent and a late device in one cohort
    (cutting both would leave it below its floor) held every dispatch to the timeout."""
    core = secure_fedbuff_core()
    policy = core.cohorts
    policy.probation.add(SILENT)
    first, _ = policy.open_cohort(0.0)
    assert SILENT in first.selected  # one member on probation a cohort (spread)
    sr = first.session
    members = sorted(first.selected - {SILENT})
    for device in members[:-1]:
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload, 0.1)
    assert sr.phase == "keys" and not policy.can_open()  # an ordinary member still to come
    sr.receive(members[-1], DeviceSession(members[-1], sr.session.params).advertise().payload,
               0.1)  # fmt: skip
    assert sr.phase == "keys" and policy.can_open()  # only SILENT left: not held back


def test_a_phase_waiting_only_for_offline_devices_ends_after_the_settle_time():
    """A red team stopped its fleet mid-cohort: the cohort waited its shares phase's whole
    timeout for six devices whose last wills said offline. Now a phase that waits only for
    devices whose status says offline ends ``settle`` seconds later."""
    core = secure_fedbuff_core()
    policy = core.cohorts
    cohort, _ = policy.open_cohort(0.0)
    sr = cohort.session
    members = sorted(cohort.selected)
    for device in members[:3]:
        sr.receive(device, DeviceSession(device, sr.session.params).advertise().payload, 0.1)
    assert not sr.shorten_if_gone(core.is_online, 0.2, 0.5)  # the others are online
    for device in members[3:]:
        core.on_status(device, encode_status(Status(device, False, 30)))
    assert sr.shorten_if_gone(core.is_online, 0.2, 0.5) and sr.deadline == 0.7
    assert not sr.shorten_if_gone(core.is_online, 0.3, 0.5)  # never later again
    sr.tick(0.7)
    assert sr.phase != "keys"

"""Shares of a py-spy profile by what the stack was doing: the tables of docs/bench/.

Reads py-spy's ``--format raw`` output (collapsed stacks: ``frame;frame;... COUNT`` per line) and
counts each stack in the first row whose pattern occurs in it (top to bottom), so every sample is
counted once. Idle samples (a thread waiting in ``epoll``/``select``/a lock with nothing to do)
are left out unless ``--idle``: py-spy's ``--idle`` is off by default, so they are rare anyway.

    py-spy record --rate 50 --threads --nonblocking --format raw -o run.txt -- CMD...
    .venv/bin/python tools/profile_table.py run.txt              # the fleet's rows
    .venv/bin/python tools/profile_table.py run.txt --top 25     # plus the hottest leaf frames
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

#: (row, substrings: any of them in the stack puts the sample in the row), first match wins
ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("build: imports, data, agents", ("build_job", "_find_and_load", "make_synthetic")),
    ("device training (worker thread)", ("on_global", "local_sgd", "sgd (edge_fl/models")),
    ("keepalive timer (PINGREQs)", ("keepalive.py", "_misc_loop", "loop_misc")),
    ("leave: offline status + DISCONNECT", ("disconnect_all", "leave (edge_fl/fleet")),
    ("client objects (aiomqtt + paho __init__)", ("__init__ (aiomqtt/client", "Fleet._client (")),
    ("connect: TCP + paho connect (CONNECT)", ("_client_connect", "sock_connect", "_route")),
    ("connect: rest (CONNACK, retained status)", ("_connect (edge_fl/fleet", "connect_all")),
    ("aggregator: waiting for devices (start-up)", ("_wait_for_devices",)),
    ("fleet: session watcher (a scan every 1 s)", ("_watch_sessions",)),
    ("aggregator: journal fsync", ("group_commit", "fsync", "Journal.sync")),
    ("aggregator: round commit (checkpoint, line)", ("_commit (edge_fl/server",)),
    ("aggregator: ingest (tap, decode, fold)", ("IngestTap", "_on_publish", "on_update")),
    ("aggregator: rounds, records", ("AggregatorService", "AggregatorCore")),
    ("fleet: hand-out, upload and status tasks", ("Fleet.", "edge_fl/device")),
    ("MQTT socket read/write callbacks", ("loop_read", "loop_write", "_packet_re", "_packet_wr")),
    ("thread-pool hand-offs", ("concurrent/futures", "threading.py")),
    ("event loop, futures, other", ("",)),
]

IDLE = (
    "epoll.poll",
    "select (",
    "_wait_for_tstate_lock",
    "wait (threading.py",
    "Condition.wait (threading.py",
    "Event.wait (threading.py",
)


def read(path: Path) -> list[tuple[str, int]]:
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack, int(count)))
    return stacks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile", type=Path, help="py-spy --format raw output")
    ap.add_argument("--idle", action="store_true", help="count idle stacks too")
    ap.add_argument("--top", type=int, default=0, help="also list the N hottest leaf frames")
    args = ap.parse_args()
    stacks = read(args.profile)
    if not args.idle:
        stacks = [(s, n) for s, n in stacks if not s.rsplit(";", 1)[-1].startswith(IDLE)]
    total = sum(n for _, n in stacks) or 1
    rows: collections.Counter[str] = collections.Counter()
    for stack, n in stacks:
        for label, patterns in ROWS:
            if any(p in stack for p in patterns):
                rows[label] += n
                break
    print(f"| what | share of {total} samples |\n|---|---|")
    for label, _ in ROWS:
        if rows[label]:
            print(f"| {label} | {100 * rows[label] / total:.1f}% |")
    if args.top:
        leaves: collections.Counter[str] = collections.Counter()
        for stack, n in stacks:
            leaves[stack.rsplit(";", 1)[-1]] += n
        print("\n| leaf frame (own time) | share |\n|---|---|")
        for frame, n in leaves.most_common(args.top):
            print(f"| `{frame}` | {100 * n / total:.1f}% |")


if __name__ == "__main__":
    main()

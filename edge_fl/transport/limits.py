"""Open-file limits: one MQTT connection is one file descriptor, on the client and on the broker."""

from __future__ import annotations

import resource

HEADROOM = 64  # files the process needs besides its sockets (libraries, logs, pipes)


def ensure_open_files(needed_sockets: int) -> int:
    """Raise the soft RLIMIT_NOFILE so ``needed_sockets`` connections fit; return the new limit.

    Fails with a message that says what to change when the hard limit is too low.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed_sockets + HEADROOM
    if want <= soft:
        return soft
    if hard != resource.RLIM_INFINITY and want > hard:
        raise RuntimeError(
            f"{needed_sockets} MQTT connections need about {want} open files, but this process "
            f"may open at most {hard} (hard RLIMIT_NOFILE). Raise it (ulimit -Hn, "
            "/etc/security/limits.conf, or LimitNOFILE= in a systemd unit), or split the fleet "
            "over several processes with `edge-fl fleet --shard I/N`."
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want

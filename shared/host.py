"""What this host has to spare: the rule pdrun uses to post its sends, and pdplan to predict them."""

from __future__ import annotations

import os


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def send_thread_pays(device: str, local_workers: int, threads: int) -> bool:
    """Whether a helper thread for a worker's sends pays off on this host.

    It does when a core is free to run it: on a GPU (the worker's CPU mostly waits for the
    device) or when the host has more cores than its workers' threads. Without a free core
    the thread only takes turns with the worker's own, and each hand-off waits for the GIL,
    which a forward holds: on 2 cores with 2 CPU workers, sending from the worker itself was
    2-10% faster (1F1B-flush, GPipe and async 1F1B on the 2-stage CNN, A/B runs). Without the
    thread a send keeps its worker busy while gloo copies it out.
    """
    if device == "cuda":
        return True
    return cores() > local_workers * threads

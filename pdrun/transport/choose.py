"""Choosing what carries each pair of ranks' messages, once: shared memory within a node, gloo across.

A node is one launcher's group of workers (torch elastic's ``GROUP_RANK``), not a host
name: two launchers on one machine are two nodes, as two machines are, and their ranks
meet over gloo. Ranks of one node pass their messages through shared memory
(``pdrun/transport/shm.py``) when both ends can: ``--transport auto``, the CPU, an x86 host
with ``/dev/shm``, no emulated slow link. A replicated stage sums its gradients through
shared memory (``shm_sum.py``) when every replica's messages to the others would; else
through gloo's all-reduce. The stages that hold a tied parameter sum its gradient the same way.
Every rank decides every pair from the same gathered table, so both ends of a pair, and all
replicas of a stage, agree.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdrun.config import RunConfig
from pdrun.env import DistEnv
from pdrun.transport.gloo import GlooCarrier
from pdrun.transport.gloo_sum import GlooSum
from pdrun.transport.interface import Carrier, ReplicaSum
from pdrun.transport.router import Transport, emulated_bandwidth
from pdrun.transport.shm import ShmCarrier, ShmLinks, host_supports, remove_run_links, run_job
from pdrun.transport.shm_sum import ShmSum


@dataclass(frozen=True)
class Place:
    """Where a rank runs, as far as the transport cares: its node, its process, whether it can share memory."""

    node: str
    pid: int
    shm: bool


def node_of(env: DistEnv) -> str:
    """This rank's node: its launcher's group rank; without one, the whole job when it is all local, else itself."""
    if env.group_rank is not None:
        return f"group{env.group_rank}"
    return "group0" if env.local_world_size == env.world_size else f"rank{env.rank}"


def shm_peers(places: Sequence[Place], rank: int) -> frozenset[int]:
    """The ranks ``rank`` exchanges messages with through shared memory: those of its node, where both can."""
    me = places[rank]
    if not me.shm:
        return frozenset()
    return frozenset(r for r, p in enumerate(places) if r != rank and p.shm and p.node == me.node)


def node_tag(cfg: RunConfig, env: DistEnv) -> str:
    """What names this node's shared-memory files within the run: its pdrun launcher, so that the launcher
    (and its orphaned workers) can sweep them and nothing of another node; under torchrun, the node."""
    return launcher_tag(cfg.launcher_pid) if cfg.launcher_pid is not None else node_of(env)


def launcher_tag(pid: int) -> str:
    """``node_tag`` of the workers of the pdrun launcher with process id ``pid``."""
    return f"l{pid}"


def remove_leftovers(run_id: str, node: str) -> None:
    """Remove what a killed worker of ``node`` (``node_tag``) in run ``run_id`` left of the transport."""
    remove_run_links(run_id, node)


def open_transport(
    env: DistEnv, cfg: RunConfig, device: torch.device, wire: torch.device, send_thread: bool
) -> Transport:
    """This rank's transport: every peer's carrier and the replicas' sum, chosen here and nowhere else.

    Collective: every rank of the process group calls it, in the same place.
    """
    kind = dist.get_backend()
    gloo = GlooCarrier(env.rank, wire, cfg.timeout_s, kind)
    peers: frozenset[int] = frozenset()
    places: list[Place] = []
    # Decided from the options alone, alike on every rank: whether to gather at all.
    if cfg.transport == "auto" and device.type == "cpu" and env.world_size > 1:
        here = Place(node_of(env), os.getpid(), host_supports() and emulated_bandwidth() is None)
        gathered: list[object] = [None] * env.world_size
        dist.all_gather_object(gathered, here)
        places = [p for p in gathered if isinstance(p, Place)]
        peers = shm_peers(places, env.rank)
    shm: ShmCarrier | None = None
    if peers:
        job = run_job(os.environ.get("TORCHELASTIC_RUN_ID", "run"), node_tag(cfg, env), env.master_port)
        # A receiver tells a dead sender of its node from a slow one by its process id.
        pids = {r: places[r].pid for r in peers}
        shm = ShmCarrier(ShmLinks(job, env.rank, cfg.timeout_s, pids))
    carriers: dict[int, Carrier] = {
        r: (shm if shm is not None and r in peers else gloo) for r in range(env.world_size) if r != env.rank
    }

    def sum_of(
        stage: int | str, ranks: Sequence[int], group: Any, buckets: list[tuple[int, torch.dtype]]
    ) -> ReplicaSum:
        if shm is not None and all(r == env.rank or r in peers for r in ranks):
            return ShmSum(shm.links.job, stage, ranks, env.rank, buckets, cfg.timeout_s, group)
        return GlooSum(group, wire, kind)

    return Transport(env.rank, device, wire, cfg.timeout_s, carriers, sum_of, send_thread)

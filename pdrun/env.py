"""The launcher's contract with a worker: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, GROUP_RANK."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shared.errors import UserError

_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job, read once from the environment torchrun sets."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    local_world_size: int = 1  # workers of this node (torchrun and pdrun's launcher set it)
    group_rank: int | None = None  # this node's rank among the job's nodes (torch elastic's GROUP_RANK)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        missing = [k for k in (*_KEYS, "MASTER_PORT") if k not in env]
        if missing:
            raise UserError(
                f"worker environment: {', '.join(missing)} not set (run under torchrun or `pdrun PLAN`)"
            )
        try:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
                group_rank=int(env["GROUP_RANK"]) if "GROUP_RANK" in env else None,
            )
        except ValueError as exc:
            raise UserError(
                f"worker environment: expected integers in RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/GROUP_RANK/MASTER_PORT ({exc})"
            ) from None


def under_torchrun(environ: Mapping[str, str] | None = None) -> bool:
    """True when a launcher already made this process one worker of a job."""
    env = os.environ if environ is None else environ
    return all(k in env for k in _KEYS)

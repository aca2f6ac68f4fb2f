"""Injected failures for testing how a run fails: ``PIPEDREAM_FAULT=KIND:RANK:AT``.

``raise:R:U`` makes rank ``R`` raise in the forward of global unit ``U``; ``kill:R:U`` makes
it kill itself with SIGKILL there (no handler, no last words: what an out-of-memory kill
or a lost machine looks like); ``hang:R:U`` makes it stop there forever without dying (a
deadlocked or stalled peer); ``checkpoint-kill:R:S`` kills it after it wrote its files of
the checkpoint at step ``S`` but before that checkpoint is complete. Unset: nothing happens.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from shared.errors import UserError

FAULT_ENV = "PIPEDREAM_FAULT"
KINDS = ("raise", "kill", "hang", "checkpoint-kill")


class InjectedFault(RuntimeError):
    """The error an injected ``raise`` fault raises."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    at: int

    @classmethod
    def from_environ(cls) -> Fault | None:
        value = os.environ.get(FAULT_ENV, "")
        if not value:
            return None
        parts = value.split(":")
        if len(parts) != 3 or parts[0] not in KINDS or not all(p.isdigit() for p in parts[1:]):
            raise UserError(
                f"{FAULT_ENV}={value!r}: expected KIND:RANK:AT with KIND one of {', '.join(KINDS)}"
            )
        return cls(parts[0], int(parts[1]), int(parts[2]))

    def at_unit(self, rank: int, unit: int) -> None:
        """Called at the start of each forward."""
        if rank != self.rank or unit != self.at:
            return
        if self.kind == "raise":
            raise InjectedFault(f"injected fault at unit {unit}")
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(3600)

    def at_checkpoint(self, rank: int, step: int) -> None:
        """Called after a rank wrote its checkpoint files, before the checkpoint is committed."""
        if self.kind == "checkpoint-kill" and rank == self.rank and step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)

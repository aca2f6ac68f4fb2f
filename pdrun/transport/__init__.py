"""The transport: how workers' messages and replicas' gradient sums travel, behind one interface.

The worker holds a ``Transport`` (``router.py``) and posts, waits, sends, releases and
sums through it; ``choose.open_transport`` gives each peer its ``Carrier`` and each
replicated stage its ``ReplicaSum`` (``interface.py``), once per run: shared memory between
ranks of one node (``shm.py``, whose bells sleep on ``futex.py``; ``shm_sum.py``), gloo
between nodes and wherever shared memory cannot run (``gloo.py``, ``gloo_sum.py``).
"""

from pdrun.transport.choose import launcher_tag, node_tag, open_transport, remove_leftovers
from pdrun.transport.interface import TAG_ACT, TAG_GRAD, TAG_VAL, Carrier, PostedRecv, ReplicaSum
from pdrun.transport.router import Transport, emulated_bandwidth

__all__ = [
    "TAG_ACT",
    "TAG_GRAD",
    "TAG_VAL",
    "Carrier",
    "PostedRecv",
    "ReplicaSum",
    "Transport",
    "emulated_bandwidth",
    "launcher_tag",
    "node_tag",
    "open_transport",
    "remove_leftovers",
]

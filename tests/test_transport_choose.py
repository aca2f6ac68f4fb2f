"""The transport's choice per pair of ranks: shared memory within a node where both ends can, by node, not host."""

from __future__ import annotations

from pdrun.config import RunConfig
from pdrun.env import DistEnv
from pdrun.transport.choose import Place, launcher_tag, node_of, node_tag, shm_peers


def _env(rank: int, world: int, local: int, group: str | None) -> DistEnv:
    environ = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    if group is not None:
        environ["GROUP_RANK"] = group
    return DistEnv.from_environ(environ)


def test_the_node_is_the_launchers_group_else_the_job_when_all_local_else_the_rank() -> None:
    assert node_of(_env(3, 4, 2, "1")) == node_of(_env(2, 4, 2, "1")) != node_of(_env(1, 4, 2, "0"))
    assert node_of(_env(1, 2, 2, None)) == node_of(_env(0, 2, 2, None))  # every rank local: one node
    assert node_of(_env(1, 4, 2, None)) != node_of(_env(0, 4, 2, None))  # unknown: each rank alone


def test_peers_of_one_node_share_memory_where_both_ends_can() -> None:
    # Ranks 0-2 on node a (rank 2 cannot share memory), 3-4 on node b: two nodes of one host alike.
    places = [
        Place("a", 10, True),
        Place("a", 11, True),
        Place("a", 12, False),
        Place("b", 13, True),
        Place("b", 14, True),
    ]
    assert shm_peers(places, 0) == {1}
    assert shm_peers(places, 1) == {0}
    assert shm_peers(places, 2) == set()
    assert shm_peers(places, 3) == {4} and shm_peers(places, 4) == {3}
    # Both ends of every pair decide alike.
    for a in range(5):
        for b in range(5):
            assert (b in shm_peers(places, a)) == (a in shm_peers(places, b))


def test_file_names_carry_the_launcher_so_a_sweep_leaves_another_node_alone() -> None:
    env = _env(0, 2, 1, "0")
    assert node_tag(RunConfig(launcher_pid=4321), env) == launcher_tag(4321) != launcher_tag(4322)
    assert node_tag(RunConfig(), env) == node_of(env)  # under torchrun: the node

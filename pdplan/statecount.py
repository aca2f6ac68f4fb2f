"""The exact number of PipeDream's antichain states of a DAG, counted without listing them.

Which downsets PipeDream's moves reach (the moves as ``antichain.enumerate_downsets`` makes
them: ``D -> D | ancestors*(s)`` for a node ``s`` outside ``D`` with a predecessor inside):
exactly the downsets that contain the first source ``f`` and are connected (as an undirected
induced subgraph). [Note: reachable states]

- Reached => connected: ``ancestors*(s)`` is connected (every member has a path to ``s``
  inside it) and touches ``D`` through ``s``'s predecessor, so each move keeps ``D`` connected.
- Connected => reached, by induction on ``|D|``: the components of ``D - {m}`` for a maximal
  ``m`` are downsets; if one without ``f`` is not inside ``ancestors*(m)`` it holds another
  maximal ``m'``, whose own components without ``f`` lie strictly inside that one, so this
  descent ends at an ``m`` whose other components all lie in ``ancestors*(m)``. Then ``D`` is
  one move (``m``) from ``f``'s component ``D'`` of ``D - {m}``, which is reached by induction
  (``m`` has a predecessor in ``D'``, since ``D`` is connected).

With one source (every PipeDream profile but GNMT's) every nonempty downset qualifies.

The count is a frontier dynamic program: nodes are decided one at a time in a topological
order (``f`` first); the state is what the undecided nodes still need to know: for each
decided node with an undecided successor (the *frontier*), whether it is in ``D`` and which
connected piece of ``D`` it belongs to, plus whether ``D`` has already closed (its one
component left the frontier, so nothing more may join). Counts are Python ints. The order
is picked greedily to keep the frontier narrow, since the table grows with it (up to 2^width
keys): NASNet-Large's 5.8e12 states need a frontier of 14 nodes and at most 4,896 keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pdplan.problem import Problem

# A table key: one label per frontier node (0 = outside D, else its piece, numbered by first
# appearance so equal partitions compare equal), then 1 if D has closed, else 0.
Key = tuple[int, ...]


class TooWide(Exception):
    """The frontier DP needed more work than allowed (a DAG whose every order keeps many nodes open)."""


@dataclass(frozen=True)
class StateCount:
    """The count and what it took: the widest frontier and the largest table."""

    states: int
    frontier: int
    table: int


def frontier_order(problem: Problem) -> list[int]:
    """A topological order from the first source that greedily keeps the frontier small.

    Next is the ready node (every predecessor decided) whose decision shrinks the frontier
    most: finishing a join beats continuing a chain, which beats opening a new branch; ties
    go to the node whose predecessors were decided latest (depth first), then to the lowest.
    """
    n = problem.size
    remaining = [len(s) for s in problem.succs]  # undecided successors of each node
    missing = [len(p) for p in problem.preds]  # undecided predecessors
    decided_at = [-1] * n
    ready = {v for v in range(n) if missing[v] == 0 and v != problem.first_source}
    order: list[int] = []

    def decide(v: int) -> None:
        decided_at[v] = len(order)
        order.append(v)
        for p in problem.preds[v]:
            remaining[p] -= 1
        for s in problem.succs[v]:
            missing[s] -= 1
            if missing[s] == 0:
                ready.add(s)

    decide(problem.first_source)
    while ready:
        best = min(ready, key=lambda v: _priority(problem, v, remaining, decided_at))
        ready.remove(best)
        decide(best)
    return order


def _priority(problem: Problem, v: int, remaining: list[int], decided_at: list[int]) -> tuple[int, int, int]:
    growth = (1 if problem.succs[v] else 0) - sum(1 for p in problem.preds[v] if remaining[p] == 1)
    latest = max((decided_at[p] for p in problem.preds[v]), default=-1)
    return growth, -latest, v


def pipedream_states(problem: Problem, max_work: int = 2_000_000) -> int | None:
    """The exact state count, or None when counting would take more than ``max_work`` key updates.

    One key update takes about 3 us: NASNet-Large needs 0.55 million, Inception-v3 four thousand.
    """
    try:
        return count_states(problem, max_work=max_work).states
    except TooWide:
        return None


def count_states(problem: Problem, order: list[int] | None = None, max_work: int | None = None) -> StateCount:
    """How many states PipeDream's antichain DAG of ``problem`` has (see the module's note).

    Raises ``TooWide`` once more than ``max_work`` key updates (table rows carried from one
    node to the next, summed) have been done.
    """
    order = frontier_order(problem) if order is None else order
    if order[0] != problem.first_source:
        raise ValueError(f"order must start at the first source {problem.first_source}, not {order[0]}")
    table: dict[Key, int] = {(0,): 1}  # nothing decided: no frontier, not closed
    widest, largest, work = 0, 1, 0
    for st in frontier_steps(problem, order):
        step, keep, pred_slots, stays = st.step, st.keep, st.pred_slots, st.stays
        nxt: dict[Key, int] = {}
        for key, ways in table.items():
            labels, closed = key[:-1], key[-1]
            if step > 0:  # the first source is always in D
                _add(nxt, _without(labels, keep, stays, closed), ways)
            if closed or any(labels[i] == 0 for i in pred_slots):
                continue  # v may join D only while D is open and holds all of v's predecessors
            joined = _with(labels, keep, pred_slots, stays)
            if joined is not None:
                _add(nxt, joined, ways)
        table = nxt
        widest, largest, work = max(widest, st.width), max(largest, len(table)), work + len(table)
        if max_work is not None and work > max_work:
            raise TooWide(f"counting states: past {max_work} key updates at node {step} of {len(order)}")
    # Everything decided: the frontier is empty, and D has closed exactly when it is connected.
    return StateCount(states=table.get((1,), 0), frontier=widest, table=largest)


@dataclass(frozen=True)
class FrontierStep:
    """Deciding node ``node`` (the ``step``-th of the order), as the frontier DPs see it.

    ``pred_slots``: the node's predecessors' places in the frontier before the step;
    ``keep``: the places of the frontier nodes that stay (they still have an undecided
    successor); ``stays``: the node itself joins the frontier, last; ``width``: the
    frontier's size after the step.
    """

    step: int
    node: int
    pred_slots: list[int]
    keep: list[int]
    stays: bool
    width: int


def frontier_steps(problem: Problem, order: Sequence[int]) -> Iterator[FrontierStep]:
    """The frontier (decided nodes with an undecided successor, in key order) along ``order``."""
    remaining = [len(s) for s in problem.succs]
    frontier: list[int] = []
    for step, v in enumerate(order):
        slots = {u: i for i, u in enumerate(frontier)}
        pred_slots = [slots[p] for p in problem.preds[v]]
        for p in problem.preds[v]:
            remaining[p] -= 1
        keep = [i for i, u in enumerate(frontier) if remaining[u] > 0]
        frontier = [frontier[i] for i in keep]
        stays = bool(problem.succs[v])
        if stays:
            frontier.append(v)
        yield FrontierStep(step, v, pred_slots, keep, stays, len(frontier))


def _add(table: dict[Key, int], key: Key | None, ways: int) -> None:
    if key is not None:
        table[key] = table.get(key, 0) + ways


def _without(labels: Key, keep: list[int], stays: bool, closed: int) -> Key | None:
    """The key after deciding the new node out of D."""
    kept = [labels[i] for i in keep]
    return _close(labels, [*kept, 0] if stays else kept, closed)


def _with(labels: Key, keep: list[int], pred_slots: list[int], stays: bool) -> Key | None:
    """The key after putting the new node in D: its predecessors' pieces merge into one."""
    merged = {labels[i] for i in pred_slots}
    fresh = max(labels, default=0) + 1  # a node without predecessors (another source) starts a piece
    target = min(merged) if merged else fresh
    relabel = [target if x in merged else x for x in labels]
    kept = [relabel[i] for i in keep]
    return _close([*relabel, target], [*kept, target] if stays else kept, 0)


def _close(before: list[int] | Key, after: list[int], closed: int) -> Key | None:
    """Canonical key for ``after``; None when a piece of D left the frontier while D goes on.

    A piece that leaves the frontier can never grow again: it must be all of D, so no other
    piece may remain, and from then on D is closed.
    """
    gone = {x for x in before if x} - set(after)
    if gone:
        if len(gone) > 1 or any(after):
            return None
        closed = 1
    names: dict[int, int] = {}
    out = [names.setdefault(x, len(names) + 1) if x else 0 for x in after]
    out.append(closed)
    return tuple(out)

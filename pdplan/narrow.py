"""The narrow states: PipeDream's antichain states whose cut has at most ``w`` nodes, listed exactly.

A downset's *cut* here is its nodes with an edge leaving it, plus its maximal nodes (the
tensors that cross a stage boundary there, plus its last outputs; PipeDream's augmented
antichain holds at least these). On a DAG with too many states to list (NASNet's cells give
1.6e11 and 5.8e12), the states with a narrow cut are the ones worth searching: every tensor
crossing a boundary is sent forward and its gradient back (``2 O / (B r)`` in the DP), and
they are few (NASNet-Mobile: 8,044 of the 1.3 million states of its series-compressed DAG
have a cut of at most 5 nodes, and they hold the optimum over all of them on 16 workers).

They are found by the frontier dynamic program of ``statecount.py`` with the cut's size so
far in its key (a node joins the cut when it is in ``D`` and a successor is decided out, or
when it ends ``D``), dropping keys past ``w``. A backward pass keeps only keys that can still
finish, so listing forward (numpy, one layer per node) never holds a dead partial downset:
the work is about nodes x states, with the masks built 64 nodes (one word) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from pdplan.problem import Problem
from pdplan.statecount import TooWide, frontier_order, frontier_steps

# A key: per frontier node 0 (outside D) or 2 * piece + (1 if already in the cut), then the
# cut's size so far, then 1 if D has closed.
Key = tuple[int, ...]
IntArray = NDArray[np.int64]


@dataclass
class _Layer:
    """The transitions made by deciding one node: key ``src`` -> key ``dst``, node in D or not."""

    node: int
    src: IntArray
    dst: IntArray
    bit: NDArray[np.uint64]
    keys: int  # how many keys there are after it


@dataclass
class _Run:
    layers: list[_Layer]
    final: dict[Key, int]  # keys after the last node, with their ids
    counts: list[int]  # final count by cut size (index = size)


@dataclass
class _Next:
    """The table after one node, and the transitions into it."""

    width: int
    table: dict[Key, int] = field(default_factory=dict)  # key -> how many partial downsets
    ids: dict[Key, int] = field(default_factory=dict)
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    bit: list[int] = field(default_factory=list)

    def add(self, key: Key | None, ways: int, old: int, inside: int) -> None:
        if key is None or key[-2] > self.width:
            return
        self.table[key] = self.table.get(key, 0) + ways
        self.src.append(old)
        self.dst.append(self.ids.setdefault(key, len(self.ids)))
        self.bit.append(inside)


def width_counts(problem: Problem, max_width: int, max_work: int | None = None) -> list[int]:
    """``out[w]``: how many states have a cut of exactly ``w`` nodes, for ``w <= max_width``."""
    return _forward(problem, max_width, max_work).counts


def narrow_downsets(problem: Problem, width: int, max_work: int | None = None) -> list[int]:
    """Every state (reachable downset, as a bit mask) whose cut has at most ``width`` nodes."""
    run = _forward(problem, width, max_work)
    return _listed(run, _productive(run, width), problem.size)


def widest_within(problem: Problem, max_states: int, max_work: int | None = None) -> tuple[int, list[int]]:
    """The largest ``w`` whose states number at most ``max_states``, and those states.

    ``(-1, [])`` when even ``w = 0`` is too many. One run with bound ``b`` counts the states
    of every cut size up to ``b``, and its table grows with ``b``: the bound starts at 8
    (NASNet's best cuts have 5 nodes), doubles while every state under it fits, and halves
    when a run passes ``max_work`` key updates (``TooWide`` when even bound 1 does).
    """
    run, bound = None, 8
    while True:
        try:
            attempt = _forward(problem, bound, max_work)
        except TooWide:
            if run is not None:
                break
            if bound == 1:
                raise
            bound //= 2
            continue
        run = attempt
        if sum(run.counts) > max_states or bound >= problem.size:
            break
        bound *= 2
    width, total = -1, 0
    for w, count in enumerate(run.counts):
        total += count
        if total > max_states:
            break
        width = w
    if width < 0:
        return -1, []
    return width, _listed(run, _productive(run, width), problem.size)


def _forward(problem: Problem, width: int, max_work: int | None) -> _Run:
    order = frontier_order(problem)
    table: dict[Key, int] = {(0, 0): 1}  # no frontier, empty cut, open
    ids: dict[Key, int] = {(0, 0): 0}
    layers: list[_Layer] = []
    work = 0
    for st in frontier_steps(problem, order):
        step, v, keep, pred_slots, stays = st.step, st.node, st.keep, st.pred_slots, st.stays
        nxt = _Next(width)
        for key, ways in table.items():
            old = ids[key]
            slots_of, cut, closed = key[:-2], key[-2], key[-1]
            if step > 0:
                nxt.add(_out(slots_of, keep, pred_slots, stays, cut, closed), ways, old, 0)
            if closed or any(slots_of[i] == 0 for i in pred_slots):
                continue
            nxt.add(_in(slots_of, keep, pred_slots, stays, cut), ways, old, 1)
        layers.append(
            _Layer(
                node=v,
                src=np.array(nxt.src, dtype=np.int64),
                dst=np.array(nxt.dst, dtype=np.int64),
                bit=np.array(nxt.bit, dtype=np.uint64),
                keys=len(nxt.ids),
            )
        )
        table, ids = nxt.table, nxt.ids
        work += len(nxt.src)
        if max_work is not None and work > max_work:
            raise TooWide(
                f"listing narrow states: past {max_work} key updates at node {step} of {len(order)}"
            )
    counts = [0] * (width + 1)
    for key, ways in table.items():
        if key[-1]:
            counts[key[-2]] += ways
    return _Run(layers=layers, final=ids, counts=counts)


def _out(
    slots: Key, keep: list[int], pred_slots: list[int], stays: bool, cut: int, closed: int
) -> Key | None:
    """The new node decided out of D: its predecessors in D now have an edge leaving D."""
    marked = list(slots)
    for i in pred_slots:
        if marked[i] and not marked[i] & 1:
            marked[i] |= 1
            cut += 1
    kept = [marked[i] for i in keep]
    return _close(marked, [*kept, 0] if stays else kept, cut, closed)


def _in(slots: Key, keep: list[int], pred_slots: list[int], stays: bool, cut: int) -> Key | None:
    """The new node put in D: its predecessors' pieces merge; with no successor it ends D (in the cut)."""
    merged = {slots[i] >> 1 for i in pred_slots}
    fresh = max((x >> 1 for x in slots), default=0) + 1
    target = min(merged) if merged else fresh
    relabel = [(target << 1 | (x & 1)) if x and x >> 1 in merged else x for x in slots]
    kept = [relabel[i] for i in keep]
    before = [*relabel, target << 1]
    if stays:
        return _close(before, [*kept, target << 1], cut, 0)
    return _close(before, kept, cut + 1, 0)


def _close(before: list[int], after: list[int], cut: int, closed: int) -> Key | None:
    """Canonical key (pieces renumbered); None when a piece of D left the frontier while D goes on."""
    gone = {x >> 1 for x in before if x} - {x >> 1 for x in after if x}
    if gone:
        if len(gone) > 1 or any(after):
            return None
        closed = 1
    names: dict[int, int] = {}
    out = [(names.setdefault(x >> 1, len(names) + 1) << 1 | (x & 1)) if x else 0 for x in after]
    out += [cut, closed]
    return tuple(out)


def _productive(run: _Run, width: int) -> list[NDArray[np.bool_]]:
    """``keep[i][k]``: key ``k`` before layer ``i`` can still end in a state of cut <= ``width``."""
    alive = np.zeros(len(run.final), dtype=bool)
    for key, i in run.final.items():
        alive[i] = bool(key[-1]) and key[-2] <= width
    keep: list[NDArray[np.bool_]] = [np.zeros(0, dtype=bool)] * (len(run.layers) + 1)
    keep[len(run.layers)] = alive
    for i in range(len(run.layers) - 1, -1, -1):
        layer = run.layers[i]
        before = np.zeros(run.layers[i - 1].keys if i > 0 else 1, dtype=bool)
        before[layer.src[keep[i + 1][layer.dst]]] = True
        keep[i] = before
    return keep


def _listed(run: _Run, keep: list[NDArray[np.bool_]], n: int) -> list[int]:
    """The accepted downsets: partial downsets carried forward, one per productive transition.

    A partial holds the word (64 decisions) under construction and the index of its ancestor
    at the last word boundary; finished words are kept per boundary and chained back at the
    end, so no layer copies whole masks. Bits go by step, then are put back in node order.
    """
    key = np.zeros(1, dtype=np.int64)
    word = np.zeros(1, dtype=np.uint64)
    origin = np.zeros(1, dtype=np.int64)
    saved: list[tuple[IntArray, NDArray[np.uint64]]] = []
    last = len(run.layers) - 1
    for i, layer in enumerate(run.layers):
        use = keep[i + 1][layer.dst]
        by_src = np.argsort(layer.src[use], kind="stable")
        src, dst, bit = layer.src[use][by_src], layer.dst[use][by_src], layer.bit[use][by_src]
        count = np.bincount(src, minlength=len(keep[i]))
        start = np.cumsum(count) - count
        per = count[key]  # children of each partial: at least one, since its key is productive
        parent = np.repeat(np.arange(len(key)), per)
        rank = np.arange(len(parent)) - np.repeat(np.cumsum(per) - per, per)
        t = start[key[parent]] + rank
        key, origin = dst[t], origin[parent]
        word = word[parent] | (bit[t] << np.uint64(i % 64))
        if i % 64 == 63 or i == last:
            saved.append((origin, word))
            origin = np.arange(len(key), dtype=np.int64)
            word = np.zeros(len(key), dtype=np.uint64)
    by_step = np.zeros((len(key), len(saved)), dtype=np.uint64)
    at = np.arange(len(key), dtype=np.int64)
    for b in range(len(saved) - 1, -1, -1):
        back, words = saved[b]
        by_step[:, b] = words[at]
        at = back[at]
    order = np.array([layer.node for layer in run.layers], dtype=np.int64)
    return _node_masks(by_step, order, n)


def _node_masks(by_step: NDArray[np.uint64], order: IntArray, n: int) -> list[int]:
    """Masks by node number from masks by step (bit ``s`` = node ``order[s]``), in row chunks."""
    out: list[int] = []
    width = (n + 7) // 8 or 1
    for lo in range(0, len(by_step), 16384):
        chunk = by_step[lo : lo + 16384].astype("<u8")
        steps = np.unpackbits(chunk.view(np.uint8), axis=1, bitorder="little")[:, : len(order)]
        nodes = np.zeros((len(chunk), width * 8), dtype=np.uint8)
        nodes[:, order] = steps
        packed = np.packbits(nodes, axis=1, bitorder="little")
        out.extend(int.from_bytes(row.tobytes(), "little") for row in packed)
    return out

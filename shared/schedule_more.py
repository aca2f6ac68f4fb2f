"""The second wave of schedules as generators of the same instructions: interleaved 1F1B, ZB-H1, 2BW.

Each is a :class:`shared.schedule.Schedule` like PipeDream's three, registered under its
name in ``shared.schedule.GENERATORS``: the validator, the grid drawing, the simulator and
pdrun's dispatch table see only instructions. What they add to the instruction type is a
chunk index (a worker's model chunk, a *virtual stage*) and the weight-gradient kind W.

[Note: chunks] With V chunks per worker on S stages, chunk c of stage s is virtual stage
``v = c * S + s`` (Megatron's round-robin assignment), so a unit goes through the workers
V times: s0 s1 .. s(S-1) s0 s1 .. A compute op names its chunk (``F3.1``: unit 3, chunk 1).
A message names the chunk of the op that *sends* it, on both ends: worker S-1's chunk 0
sends unit 3 to worker 0's chunk 1 as ``SA3>0.0`` and worker 0 receives it as
``RA3<{S-1}.0``; worker 0's chunk 1 sends on ``SA3.1>1.0``, received as ``RA3.1<0.0``. So
(kind, sender, receiver, unit, chunk) names one message, as (kind, sender, receiver, unit)
does without chunks, and every existing text form is unchanged.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from shared.schedule import (
    GENERATORS,
    MORE_SCHEDULES,
    Instr,
    Kind,
    Pipeline,
    Schedule,
    ScheduleError,
    Worker,
    _Accumulating,
    _Flush,
    _own_units,
    chunk_virtual,
    end_step,
    one_f_one_b_order,
)

# ---------------------------------------------------------------------------- interleaved 1F1B


def virtual_stage(pipe: Pipeline, stage: int, chunk: int) -> int:
    """Chunk ``chunk`` of ``stage`` in the pipeline of ``chunks * stages`` virtual stages (see [Note: chunks])."""
    return pipe.virtual(stage, chunk)


def lower_chunked(pipe: Pipeline, worker: Worker, ops: Iterable[Instr]) -> Iterator[Instr]:
    """:func:`shared.schedule.lower` over virtual stages: a chunk's neighbours are the adjacent virtual stages.

    Virtual stage v receives activations from v - 1 and sends them to v + 1; gradients go
    back the other way. A message carries its sender's chunk ([Note: chunks]). With replicas,
    every stage has the same number and a unit stays on one replica index throughout
    (``pipe.owner``), so the worker's peers are of its own replica. Where two neighbouring
    virtual stages are chunks of one worker (the V placement's turn, ``zb-v``), the message
    goes to the worker itself: pdrun hands it over in the process (``pdrun.interleaved``).
    """
    stage, replica = worker
    last = pipe.stages * pipe.chunks - 1

    def peer(v: int) -> Worker:
        return (pipe.chunk_of(v)[0], replica)

    for ins in ops:
        u, v = ins.unit, pipe.virtual(stage, ins.chunk)
        if ins.kind is Kind.FORWARD:
            if v > 0:
                yield Instr(Kind.RECV_ACT, u, peer(v - 1), pipe.chunk_of(v - 1)[1])
            yield ins
            if v < last:
                yield Instr(Kind.SEND_ACT, u, peer(v + 1), ins.chunk)
        elif ins.kind is Kind.BACKWARD:
            if v < last:
                yield Instr(Kind.RECV_GRAD, u, peer(v + 1), pipe.chunk_of(v + 1)[1])
            yield ins
            if v > 0:
                yield Instr(Kind.SEND_GRAD, u, peer(v - 1), ins.chunk)
        else:
            yield ins


def check_chunked_chain(name: str, pipe: Pipeline) -> None:
    """What every chunked schedule needs: at least 2 stages in a chain, the same replicas at each (every
    replica index a pipeline of its own); ScheduleError naming ``name`` otherwise."""
    if pipe.stages < 2:
        raise ScheduleError(f"stages: {name} needs at least 2 stages, got {pipe.stages}")
    if len(set(pipe.replicas)) != 1:
        raise ScheduleError(
            f"replicas: {name} runs the same number of replicas at every stage (each replica "
            f"index a pipeline of its own), got {list(pipe.replicas)}"
        )
    if pipe.edges != tuple((s, s + 1) for s in range(pipe.stages - 1)):
        raise ScheduleError(f"stage_edges: {name} runs a chain of stages, got {list(pipe.edges)}")


def interleaved_order(
    stages: int, chunks: int, microbatches: int, stage: int
) -> Iterator[tuple[Kind, int, int]]:
    """One step of interleaved 1F1B for ``stage``: (kind, microbatch within the step, chunk), in order.

    Narayanan et al., SC'21 ("Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", section 2.2.1): "each device is assigned multiple pipeline stages
    (model chunks) ... the pipeline flush for each batch happens after the forward and
    backward passes of all microbatches", and the bubble shrinks to ``(p - 1) / (v m)`` of
    the ideal time from 1F1B's ``(p - 1) / m``. Microbatches go in groups of S: a worker
    forwards S microbatches through chunk 0, the same S through chunk 1, .., chunk V-1,
    then the next group; backwards go the same way from chunk V-1 down. The k-th forward
    is microbatch ``(k // (S V)) S + k % S`` of chunk ``(k // S) % V``. Warm-up runs
    ``2 (S - s - 1) + (V - 1) S`` forwards (Megatron-LM's count: the last stage's first
    backward needs V S forwards to have passed; each earlier stage is two hops further
    from it), then one forward and one backward in turn, then the remaining backwards.
    """
    total = chunks * microbatches
    group = stages * chunks

    def forward(k: int) -> tuple[int, int]:
        return (k // group) * stages + k % stages, (k // stages) % chunks

    def backward(k: int) -> tuple[int, int]:
        return (k // group) * stages + k % stages, chunks - 1 - (k // stages) % chunks

    warmup = min(total, 2 * (stages - stage - 1) + (chunks - 1) * stages)
    for k in range(warmup):
        yield (Kind.FORWARD, *forward(k))
    for k in range(total - warmup):
        yield (Kind.FORWARD, *forward(k + warmup))
        yield (Kind.BACKWARD, *backward(k))
    for k in range(total - warmup, total):
        yield (Kind.BACKWARD, *backward(k))


class _Chunked(_Flush):
    """A flushing schedule over model chunks: each step, a replica's order of (kind, microbatch, chunk) over
    its ``M / n`` microbatches, then the step's all-reduce and step; lowered over virtual stages."""

    def step_order(self, pipe: Pipeline, stage: int, microbatches: int) -> Iterable[tuple[Kind, int, int]]:
        raise NotImplementedError

    def compute(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        stage, replica = worker
        m, n = pipe.microbatches, pipe.replicas[stage]
        for start in range(first, stop, m):
            # The replica's k-th microbatch of the step is the step's unit k n + replica.
            for kind, k, chunk in self.step_order(pipe, stage, m // n):
                yield Instr(kind, start + k * n + replica, None, chunk)
            yield from end_step(pipe, stage, start + m - 1)

    def program(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        return lower_chunked(pipe, worker, self.compute(pipe, worker, first, stop))


class InterleavedOneFOneB(_Chunked):
    """``interleaved-1f1b``: V model chunks per worker, flushed every ``microbatches`` units (SC'21).

    Needs the chain of stages, at least 2 stages and 2 chunks, the same number of replicas
    ``n`` at every stage, and microbatches a multiple of ``n x S``. With replicas the step's
    units are dealt round-robin, unit u to replica ``u % n`` of every stage (PipeDream's rule),
    so each replica index is a pipeline of its own over ``M / n`` microbatches, in groups of S,
    and the step ends in each chunk's all-reduce among its stage's replicas: Megatron-LM's
    data-parallel copies of an interleaved pipeline.

    [Note: interleaved timeline] 2 stages, 2 chunks, 4 microbatches, f = b = 1 slot per
    chunk (``F3.1`` is microbatch 3 on chunk 1; the virtual stages run s0 s1 s0 s1):

             0  1    2    3    4    5    6    7    8  9   10   11   12   13   14   15 16 17
      s0.r0 F0 F1 F0.1 F1.1   F2 B0.1   F3 B1.1 F2.1 B0 F3.1   B1    . B2.1    . B3.1 B2 B3
      s1.r0  . F0   F1 F0.1 B0.1 F1.1 B1.1   F2   B0 F3   B1 F2.1 B2.1 F3.1 B3.1   B2 B3  .

    18 slots for 8 units of work per worker against 1f1b-flush's 10 for 4 units of twice the
    size (20 at this size): the bubble is ``S - 1`` chunk slots instead of ``S - 1`` stage slots.
    """

    name = "interleaved-1f1b"

    def check_pipeline(self, pipe: Pipeline) -> None:
        if pipe.chunks < 2:
            raise ScheduleError(
                f"chunks: {self.name} needs at least 2 model chunks per worker, got {pipe.chunks} "
                "(with one chunk it is 1f1b-flush)"
            )
        check_chunked_chain(self.name, pipe)
        group = pipe.stages * pipe.replicas[0]
        if pipe.microbatches % group:
            m, n, r = pipe.microbatches, pipe.stages, pipe.replicas[0]
            why = f"the {n} stages" if r == 1 else f"{r} replicas x {n} stages"
            raise ScheduleError(
                f"microbatches: {m} is not a multiple of {why} ({self.name} runs each replica's microbatches "
                f"in groups of {n}); use {max(group, m - m % group)}"
            )

    def step_order(self, pipe: Pipeline, stage: int, microbatches: int) -> Iterable[tuple[Kind, int, int]]:
        return interleaved_order(pipe.stages, pipe.chunks, microbatches, stage)


# ---------------------------------------------------------------------------- zero bubble


def zb_h1_order(units: Sequence[int], warmup: int, lag: int) -> Iterator[tuple[Kind, int]]:
    """1F1B with each backward split into B (input gradients) and W (weight gradients), W ``lag`` behind.

    Qi et al., ICLR'24 ("Zero Bubble Pipeline Parallelism", section 3.1): B alone is on the
    critical path, W is not, so "we adjust the starting points of W passes" and the W of
    late units fills the drain bubble. The forwards and input backwards keep 1F1B's order
    and warm-up, so a worker holds as many units in flight as in 1F1B (ZB-H1's "peak memory
    ... the same as 1F1B"); each W waits ``lag`` backwards and the last ``lag`` come after
    the last B.
    """
    pending: list[int] = []

    def backward(u: int) -> Iterator[tuple[Kind, int]]:
        yield Kind.BACKWARD, u
        pending.append(u)
        if len(pending) > lag:
            yield Kind.WEIGHT, pending.pop(0)

    k = min(warmup, len(units))
    for i in range(k):
        yield Kind.FORWARD, units[i]
    for i in range(len(units) - k):
        yield from backward(units[i])
        yield Kind.FORWARD, units[i + k]
    for i in range(len(units) - k, len(units)):
        yield from backward(units[i])
    for u in pending:
        yield Kind.WEIGHT, u


class ZeroBubbleH1(_Flush):
    """``zb-h1``: 1F1B-flush with the backward split into B and W, W deferred into the drain (ICLR'24).

    Stage s lets its W lag ``s`` backwards behind: a later stage defers weight gradients so
    that its input gradients reach the earlier stages sooner (the first stage, which nothing
    waits on, runs each W right after its B), and does the deferred W while the earlier
    stages drain. At f = b = w the step then takes ``3 m + S - 1`` slots, the paper's
    bubble of ``(S - 1)(T_F + T_B - T_W)``, against ``3 m + 3 (S - 1)`` for 1F1B-flush.

    [Note: ZB-H1 timeline] 4 stages, 4 microbatches, f = b = w = 1 slot:

             0  1  2  3  4  5  6  7  8  9 10 11 12 13 14
      s0.r0 F0 F1 F2 F3  .  .  . B0 W0 B1 W1 B2 W2 B3 W3
      s1.r0  . F0 F1 F2  .  . B0 F3 B1 W0 B2 W1 B3 W2 W3
      s2.r0  .  . F0 F1  . B0 F2 B1 F3 B2 W0 B3 W1 W2 W3
      s3.r0  .  .  . F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3
    """

    name = "zb-h1"

    def order(self, pipe: Pipeline, stage: int, units: range) -> Iterator[tuple[Kind, int]]:
        return zb_h1_order(units, pipe.bounds[stage], zb_h1_lag(pipe, stage))


def zb_h1_lag(pipe: Pipeline, stage: int) -> int:
    """How many backwards stage ``stage``'s W trails by in ZB-H1: ``s`` (see :class:`ZeroBubbleH1`)."""
    return stage


# ---------------------------------------------------------------------------- ZB-V


Order = tuple[tuple[Kind, int, int], ...]  # one worker's step: (kind, microbatch within the step, chunk)


@functools.lru_cache(maxsize=64)
def zb_v_orders(stages: int, microbatches: int) -> tuple[Order, ...]:
    """One step of ZB-V for every worker stage: (kind, microbatch within the step, chunk), in order.

    Qi et al., ICLR'24 ("Zero Bubble Pipeline Parallelism", section 6): the model is cut into
    2S chunks placed in a V (:func:`shared.schedule.chunk_virtual`), each backward split into
    B and W. With at least 2S - 1 microbatches, the paper's own ZB-V schedule
    (:func:`zb_v_paper_order`), which fills the V; with fewer, a list schedule at unit costs
    (:func:`zb_v_list_orders`). Cached per (S, M): a rank computes it once, whatever the run's
    length.
    """
    if microbatches >= 2 * stages - 1:
        return tuple(zb_v_paper_order(stages, microbatches, w) for w in range(stages))
    return zb_v_list_orders(stages, microbatches)


def zb_v_paper_order(stages: int, microbatches: int, worker: int) -> Order:
    """Worker ``worker``'s step of the paper's ZB-V schedule (Qi et al., ICLR'24, section 6 and its
    ZB-V figure), for at least 2S - 1 microbatches.

    Chunk 0 is virtual stage ``w`` on the way down, chunk 1 virtual stage ``2S - 1 - w`` on the
    way back. Warm-up: 2(S - w) - 1 forwards through chunk 0 (the V's depth below the worker,
    there and back, less one), then ``w`` forwards through chunk 1 and chunk 0 in turn, then
    S - w units through chunk 1 whole: F, B and at once W. Steady state: a unit's F (while any
    are left), B and W through chunk 0, then F, B and W through chunk 1. Cool-down: ``w`` pairs
    of B through chunk 0 then chunk 1, their W's put off, then S - w of chunk 0's B each with
    the oldest W put off, then the W's left, chunk 1's first. Each W follows its B at once
    except in the cool-down, where the W's wait for the B's that later workers wait on.

    At unit costs (F = B = W) the steady state has no bubble; measured costs do not change the
    order, and the simulation with them (``pdplan.schedule_sim``) was faster than the list
    schedule's in every case tried (2 and 4 workers, 2S - 1 to 4S microbatches, B and W shares
    of 0.5-1.05 of a backward, the first chunk's backward all W): 3-20% a minibatch.

    [Note: ZB-V timeline] 2 stages (4 chunks: s0 runs virtual stages 0 and 3, s1 runs 1
    and 2), 4 microbatches, f = b = w = 1 slot a chunk (``F3.1`` is microbatch 3 on chunk 1):

             0  1    2    3    4    5    6    7    8  9   10   11   12   13   14 15   16   17   18   19   20 21 22   23 24
      s0.r0 F0 F1   F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3   B0   W0 F2.1 B2.1 W2.1 B1   W1 F3.1 B3.1 W3.1   B2 W2 B3   W3  .
      s1.r0  . F0 F0.1   F1 F1.1 B0.1 W0.1   F2   B0 W0 F2.1 B1.1 W1.1   F3   B1 W1 F3.1 B2.1 W2.1   B2 B3.1 B3 W2 W3.1 W3
    """
    s_, m, w = stages, microbatches, worker
    order: list[tuple[Kind, int, int]] = []
    forwarded, backwarded = [0, 0], [0, 0]
    put_off: list[deque[int]] = [deque(), deque()]  # per chunk, microbatches whose W waits

    def forward(c: int) -> None:
        order.append((Kind.FORWARD, forwarded[c], c))
        forwarded[c] += 1

    def backward(c: int, weight_now: bool) -> None:
        k = backwarded[c]
        backwarded[c] += 1
        order.append((Kind.BACKWARD, k, c))
        if weight_now:
            order.append((Kind.WEIGHT, k, c))
        else:
            put_off[c].append(k)

    def weight(c: int) -> None:
        order.append((Kind.WEIGHT, put_off[c].popleft(), c))

    for _ in range(2 * (s_ - w) - 1):
        forward(0)
    for _ in range(w):
        forward(1)
        forward(0)
    for _ in range(s_ - w):
        forward(1)
        backward(1, weight_now=True)
    while forwarded[0] < m or forwarded[1] < forwarded[0]:
        if forwarded[0] < m:
            forward(0)
        backward(0, weight_now=True)
        forward(1)
        backward(1, weight_now=True)
    for _ in range(w):
        backward(0, weight_now=False)
        backward(1, weight_now=False)
    for _ in range(s_ - w):
        backward(0, weight_now=False)
        weight(0)
    for c in (1, 0):
        while put_off[c]:
            weight(c)
    return tuple(order)


def zb_v_list_orders(stages: int, microbatches: int) -> tuple[Order, ...]:
    """ZB-V's step for fewer than 2S - 1 microbatches, for every worker stage: a list schedule.

    Made as the paper's automatic scheduler makes its schedules (section 4.1, "a greedy
    algorithm"): a list schedule at unit costs (every chunk's F, B and W one slot; a message
    arrives for the next slot), each worker in each slot taking a forward that is ready if it
    holds fewer than 2S chunk-units (forwarded and weight gradient not yet taken: 1F1B's S
    units of twice the size at its first stage), the later virtual stage first, else a ready
    backward, the later virtual stage first, else its oldest pending W. Every worker's order
    comes out of the same run, so they fit together; the runtime only follows each worker's
    order.
    """
    s_, m = stages, microbatches
    last = 2 * s_ - 1
    cap = 2 * s_
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, microbatch, virtual stage) -> slot it ends at
    orders: list[list[tuple[Kind, int, int]]] = [[] for _ in range(s_)]
    forwarded = [[0, 0] for _ in range(s_)]  # per worker and chunk, the microbatches forwarded
    backwarded = [[0, 0] for _ in range(s_)]
    pending: list[deque[tuple[int, int]]] = [deque() for _ in range(s_)]  # (microbatch, chunk) awaiting W
    live = [0] * s_
    left, t = 6 * m * s_, 0

    def ended(kind: Kind, k: int, v: int) -> bool:
        return done.get((kind, k, v), t + 1) <= t

    while left:
        picks: list[tuple[Kind, int, int] | None] = []
        for w in range(s_):
            chunks = sorted((0, 1), key=lambda c: -chunk_virtual(s_, w, c, True))
            pick: tuple[Kind, int, int] | None = None
            for c in chunks if live[w] < cap else ():
                k, v = forwarded[w][c], chunk_virtual(s_, w, c, True)
                if k < m and (v == 0 or ended(Kind.FORWARD, k, v - 1)):
                    pick = (Kind.FORWARD, k, c)
                    break
            for c in chunks if pick is None else ():
                k, v = backwarded[w][c], chunk_virtual(s_, w, c, True)
                if k < forwarded[w][c] and ended(
                    *((Kind.FORWARD, k, v) if v == last else (Kind.BACKWARD, k, v + 1))
                ):
                    pick = (Kind.BACKWARD, k, c)
                    break
            if pick is None and pending[w]:
                pick = (Kind.WEIGHT, *pending[w][0])
            picks.append(pick)
        if not any(picks):
            raise AssertionError(f"zb-v's list schedule stalled at slot {t} (S={s_}, M={m})")
        for w, pick in enumerate(picks):
            if pick is None:
                continue
            kind, k, c = pick
            done[(kind, k, chunk_virtual(s_, w, c, True))] = t + 1
            orders[w].append(pick)
            left -= 1
            if kind is Kind.FORWARD:
                forwarded[w][c] += 1
                live[w] += 1
            elif kind is Kind.BACKWARD:
                backwarded[w][c] += 1
                pending[w].append((k, c))
            else:
                pending[w].popleft()
                live[w] -= 1
        t += 1
    return tuple(tuple(o) for o in orders)


class ZeroBubbleV(_Chunked):
    """``zb-v``: two chunks a worker placed in a V, backwards split into B and W, flushed every step (ICLR'24).

    Needs the chain of stages, at least 2 stages, exactly 2 chunks, the same number of
    replicas ``n`` at every stage and microbatches a multiple of ``n``: as in
    :class:`InterleavedOneFOneB`, each replica index is a pipeline of its own over ``M / n``
    microbatches, and the step ends in each chunk's all-reduce among its stage's replicas.
    The order is :func:`zb_v_orders`'; the last worker's two chunks hand a unit over in its
    own process (``lower_chunked``'s message to itself).
    """

    name = "zb-v"

    def check_pipeline(self, pipe: Pipeline) -> None:
        if pipe.chunks != 2:
            raise ScheduleError(
                f"chunks: {self.name} runs 2 model chunks per worker (a V), got {pipe.chunks}"
            )
        check_chunked_chain(self.name, pipe)
        n = pipe.replicas[0]
        if pipe.microbatches % n:
            m = pipe.microbatches
            raise ScheduleError(
                f"microbatches: {m} is not a multiple of the {n} replicas ({self.name} gives each replica "
                f"the same share of a step); use {max(n, m - m % n)}"
            )

    def step_order(self, pipe: Pipeline, stage: int, microbatches: int) -> Iterable[tuple[Kind, int, int]]:
        return zb_v_orders(pipe.stages, microbatches)[stage]


# ---------------------------------------------------------------------------- PipeDream-2BW


def two_bw_version(unit: int, microbatches: int) -> int:
    """The weight version unit ``unit`` runs on in 2BW: ``max(0, t - 1)`` for unit of step ``t``.

    Narayanan et al., ICML'21 ("Memory-Efficient Pipeline-Parallel DNN Training", section
    3.1): "W(t+1) = W(t) - nu * grad f(W(t-1))": the gradient of step t (its m microbatches)
    is computed on the version one older than the latest, W(t-1), and applied to the latest,
    W(t). W(0) is the initial weights, and step 0 runs on them too (W(-1) = W(0)). Every
    stage runs a unit on the same version, so only two versions are ever alive.
    """
    return max(0, unit // microbatches - 1)


def two_bw_depth(pipe: Pipeline) -> int:
    """The most units in flight at any stage (replicas x warm-up bound): 2BW's least ``microbatches``.

    The paper asks m >= the pipeline's depth; on a straight pipeline this is the number of
    stages, and with replicas a stage of n replicas holds n times its own bound.
    """
    return max(n * k for n, k in zip(pipe.replicas, pipe.bounds, strict=True))


class TwoBW(_Accumulating):
    """``2bw`` (PipeDream-2BW): 1F1B without flushes, a step every ``microbatches`` units, one step late.

    The program is PipeDream's 1F1B order over all of a worker's units, with the step's
    all-reduce (replicated stages) and optimizer step right after the backward of the
    worker's last unit of each step; the runtime runs each unit on version
    :func:`two_bw_version`. That version exists in time, and no third is needed, when a
    stage has at most ``microbatches`` units in flight (:func:`two_bw_depth`), and each
    replica gets the same number of the step's units (``microbatches`` a multiple of every
    stage's replicas).
    """

    name = "2bw"

    def check_pipeline(self, pipe: Pipeline) -> None:
        super().check_pipeline(pipe)
        m, k = pipe.microbatches, two_bw_depth(pipe)
        if m < k:
            raise ScheduleError(
                f"microbatches: {self.name} accumulates a step over at least as many microbatches as a "
                f"stage holds units in flight, {k} here (the paper's m >= pipeline depth), got {m}; use {k}"
            )
        for s, n in enumerate(pipe.replicas):
            if m % n:
                raise ScheduleError(
                    f"microbatches: {m} is not a multiple of stage {s}'s {n} replicas ({self.name} gives each "
                    f"replica the same share of a step); use {m - m % n if m > n else n}"
                )

    def fill(self, pipe: Pipeline) -> int:
        return 2 * max(pipe.microbatches, two_bw_depth(pipe))

    def compute(self, pipe: Pipeline, worker: Worker, first: int, stop: int) -> Iterator[Instr]:
        stage, replica = worker
        n = pipe.replicas[stage]
        m = pipe.microbatches
        for kind, u in one_f_one_b_order(_own_units(first, stop, n, replica), pipe.bounds[stage]):
            yield Instr(kind, u)
            # The worker's last unit of its step: the step's last unit, less the replicas after it.
            if kind is Kind.BACKWARD and (u - first) % m >= m - n:
                yield from end_step(pipe, stage, u - (u - first) % m + m - 1)


MORE: tuple[Schedule, ...] = (InterleavedOneFOneB(), ZeroBubbleH1(), TwoBW(), ZeroBubbleV())
assert tuple(g.name for g in MORE) == MORE_SCHEDULES
GENERATORS.update({g.name: g for g in MORE})

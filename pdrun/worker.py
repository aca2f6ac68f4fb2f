"""One worker executing its instruction list through a dispatch table from ``Kind`` to method.

The worker holds one stage (or one replica of it), its optimizer and weight versions,
and per unit in flight what the backward needs: the received inputs (autograd leaves),
the values it sent, the loss on the last stage, and the weight version of the forward.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.func import functional_call

from pdrun import peak
from pdrun.data import Units, to_device
from pdrun.faults import Fault
from pdrun.overlap import OverlappedAllReduce
from pdrun.step_rows import StepRows
from pdrun.transport import TAG_ACT, TAG_GRAD, TAG_VAL, PostedRecv, Transport
from pdrun.values import decode, encode, grad_leaves, grad_specs, leaves
from pdrun.weights import Params, fingerprint
from pdrun.worker_config import WorkerConfig
from pdrun.zero_bubble import SplitBackward
from shared.layout import inputs_to_channels_last
from shared.resolve import IGNORE_INDEX
from shared.schedule import ForwardOnly, Instr, Kind, Pipeline, worker_program

_RECEIVES = (Kind.RECV_ACT, Kind.RECV_GRAD)
# Receives kept posted ahead of the instruction that waits for them. gloo moves a message only
# once its receive is posted; posted when the worker gets there, every transfer (the receiver's
# "ready", the sender's gloo thread waking up and writing) lay on the critical path. A few
# covers a step of GPipe's receives; each holds one message's buffers.
RECEIVES_AHEAD = 4
# Instructions read ahead, at most, looking for those receives (a stage with none, e.g. a lone
# data-parallel stage, must not read its whole program in).
LOOKAHEAD = 1024


@dataclass
class UnitState:
    """What a unit in flight keeps between its forward and its backward."""

    version: int
    params: Params
    batch_inputs: tuple[Any, ...]
    received: dict[str, Any]
    sent: dict[str, Any] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    target: Any = None
    forward_print: float = 0.0


# The run metrics' split of a step by instruction kind (compute_s, comm_s and idle_s are their sums).
PARTS: dict[str, tuple[Kind, ...]] = {
    "forward_s": (Kind.FORWARD,),  # with reading the unit's batch and the loss
    "backward_s": (Kind.BACKWARD, Kind.WEIGHT),  # W: a split backward's weight gradients (zb-h1)
    "optimizer_s": (Kind.STEP,),
    "send_s": (Kind.SEND_ACT, Kind.SEND_GRAD),  # posting sends (gloo copies into the socket here)
    "allreduce_s": (Kind.ALLREDUCE,),
    "recv_wait_s": (Kind.RECV_ACT, Kind.RECV_GRAD),  # blocked until a peer's message is in
}


@dataclass
class StepStats:
    """Time and work since the last optimizer step on this worker."""

    start: float
    compute_s: float = 0.0
    comm_s: float = 0.0
    idle_s: float = 0.0
    by_kind: dict[Kind, float] = field(default_factory=dict)  # the same time per instruction kind
    units: int = 0
    losses: list[float] = field(default_factory=list)


class Worker:
    """Executes a worker's instructions; see ``DISPATCH`` for what each kind does."""

    def __init__(self, config: WorkerConfig, comm: Transport) -> None:
        c = config
        self.config = config
        self.s = c.stage.index
        self.comm = comm
        # Replicas: the gradient all-reduce, started in buckets during the backward (pdrun/overlap.py).
        self.reducer = (
            OverlappedAllReduce(
                c.versions.live,
                c.average_replicas,
                partial(comm.replica_sum, self.s, c.peers.ranks[self.s], c.group),
            )
            if c.group is not None
            else None
        )
        # Whether an all-reduce follows the backward running now (the last before it: its buckets start early).
        self.reduce_next = False
        self.base = 0  # global index of the current program's unit 0
        self.fault = Fault.from_environ()  # testing: an injected failure
        self.inflight: dict[int, UnitState] = {}
        self.posted: dict[int, PostedRecv] = {}  # receives posted ahead, by instruction index
        self.at = 0  # the index of the instruction running
        self.inbox: dict[int, dict[str, Any]] = {}
        self.inbox_version: dict[int, int] = {}
        self.grads: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.outbox: dict[tuple[Kind, int, int], list[torch.Tensor]] = {}
        self.steps = c.steps  # this worker's own optimizer updates
        self.stats = StepStats(time.perf_counter())
        self.step_rows = StepRows()
        self.events: list[dict[str, Any]] = []
        self.version_log: list[dict[str, Any]] = []
        self.DISPATCH: dict[Kind, Callable[[Instr], None]] = {
            Kind.FORWARD: self.forward,
            Kind.BACKWARD: self.backward,
            Kind.SEND_ACT: self.send_act,
            Kind.RECV_ACT: self.recv_act,
            Kind.SEND_GRAD: self.send_grad,
            Kind.RECV_GRAD: self.recv_grad,
            Kind.ALLREDUCE: self.allreduce,
            Kind.STEP: self.step,
        }
        if c.split_backward:  # zero bubble: B takes the input gradients, W the weight gradients
            self.split = SplitBackward(self)
            self.DISPATCH[Kind.BACKWARD] = self.split.backward_input
            self.DISPATCH[Kind.WEIGHT] = self.split.backward_weight

    # ------------------------------------------------------------------ running a program

    def run(self, instrs: Iterable[Instr], base: int) -> None:
        """Execute one worker's instruction stream, as it is generated; program unit ``u`` is global ``base + u``.

        The stream is read a little ahead (``_Ahead``): the next ``RECEIVES_AHEAD`` receives
        are kept posted, and a backward knows whether an all-reduce follows it. Nothing here
        holds more than that window, however long the program.
        """
        self.base = base
        # A program ends on a step, so nothing is accumulated here: the first step's clock starts now,
        # not during setup or the previous epoch's validation.
        self.stats = StepStats(time.perf_counter())
        stream = _Ahead(iter(instrs))
        scan = 0  # the instructions before this index were looked at for receives to post
        while (ins := stream.next()) is not None:
            # Keep the next receives posted, so that their transfers run while this worker computes;
            # the running instruction's own receive is posted now at the latest.
            while scan <= stream.at or len(self.posted) < RECEIVES_AHEAD:
                early = stream.peek(scan)
                if early is None:
                    break
                if early.kind in _RECEIVES:
                    t0 = time.perf_counter()
                    self.posted[scan] = self._post(early)
                    # Posting is part of receiving: counted with the receive's kind (recv_wait_s, idle_s).
                    dt = time.perf_counter() - t0
                    self.stats.by_kind[early.kind] = self.stats.by_kind.get(early.kind, 0.0) + dt
                    self.stats.idle_s += dt
                scan += 1
            self.at = stream.at
            if ins.kind is Kind.BACKWARD:
                self.reduce_next = stream.reduces_next()
            t0 = time.perf_counter()
            wall0 = time.time()
            self.DISPATCH[ins.kind](ins)
            if self.config.device.type == "cuda":
                torch.cuda.synchronize(
                    self.config.device
                )  # kernels are asynchronous: time them where they run
            dt = time.perf_counter() - t0
            self.stats.by_kind[ins.kind] = self.stats.by_kind.get(ins.kind, 0.0) + dt
            if ins.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.STEP):
                self.stats.compute_s += dt
            elif ins.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                self.stats.idle_s += dt
            else:
                self.stats.comm_s += dt
            if self.config.trace:
                self.events.append(
                    {
                        "name": str(ins),
                        "cat": ins.kind.name.lower(),
                        "ph": "X",
                        "ts": wall0 * 1e6,
                        "dur": dt * 1e6,
                        "pid": self.config.rank,
                        "tid": 0,
                        "args": {"unit": base + ins.unit, "stage": self.s},
                    }
                )
        self.comm.drain()

    # ------------------------------------------------------------------ compute

    def forward(self, ins: Instr) -> None:
        u = ins.unit
        if self.fault is not None:
            self.fault.at_unit(self.config.rank, self.base + u)
        received = self.inbox.pop(u, {})
        sent_version = self.inbox_version.pop(u, None)  # the input stage's version, carried along
        wanted = (
            sent_version
            if self.config.vertical_sync and not self.config.part.reads_input(self.s)
            else self.config.versions.pinned(self.base + u)
        )
        version, params = self.config.versions.acquire(wanted)
        batch_inputs, target = self._batch(u)
        state = UnitState(version, params, batch_inputs, received, target=target)
        if self.config.recompute:
            with torch.no_grad():  # without stashing the backward recomputes on the then-latest weights
                sent, output = self._run(state, grad=False)
        else:
            sent, output = self._run(state, grad=True)
        state.sent = sent
        if self.config.stage.has_output:
            loss = self.config.loss_fn(output, target)
            state.loss = loss
            self.stats.losses.append(float(loss.detach()))
        if self.config.record:
            state.forward_print = fingerprint(params)
        self.inflight[u] = state
        for b, names in self.config.part.consumers(self.s):
            tensors = self._pack(names, sent)
            carried = version if sent_version is None else sent_version
            self.outbox[(Kind.SEND_ACT, u, b)] = [self.comm.header(self.base + u, carried), *tensors]

    def _run(self, state: UnitState, grad: bool) -> tuple[dict[str, Any], Any]:
        if not self.config.versions.stash:
            with torch.set_grad_enabled(grad):
                return self.config.stage.run(state.batch_inputs, state.received)
        args = [*state.batch_inputs, *(state.received[n] for n in self.config.stage.received)]
        with torch.set_grad_enabled(grad):
            sent, output = functional_call(self.config.stage.module, state.params, tuple(args))
        return dict(zip(self.config.stage.sent, sent, strict=True)), output

    def backward(self, ins: Instr) -> None:
        u = ins.unit
        state = self.inflight.pop(u)
        used = state.version
        if self.config.recompute:
            # No stash: the backward differentiates a recomputation on the live, newer weights.
            used = self.config.versions.latest
            with torch.enable_grad():
                state.sent, output = self.config.stage.run(state.batch_inputs, state.received)
                if self.config.stage.has_output:
                    state.loss = self.config.loss_fn(output, state.target)
            params: Params = dict(self.config.versions.live)
        else:
            params = state.params
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if state.loss is not None:
            roots.append(state.loss * self.config.loss_scale)
            grads.append(None)
        incoming = self.grads.pop(u, {})
        for name, gs in incoming.items():
            for value, g in zip(grad_leaves(state.sent[name], self.config.specs[name]), gs, strict=True):
                if value.requires_grad:
                    roots.append(value)
                    grads.append(g)
        if roots:
            reducer = self.reducer if self.reduce_next else None
            if reducer is not None:
                reducer.arm(params)  # the all-reduce that follows starts during this backward
            try:
                torch.autograd.backward(roots, grads)
            finally:
                if reducer is not None:
                    reducer.disarm()
        if self.config.record:
            self.version_log.append(
                {
                    "rank": self.config.rank,
                    "stage": self.s,
                    "unit": self.base + u,
                    "forward_version": state.version,
                    "backward_version": used,
                    "forward_print": state.forward_print,
                    "backward_print": fingerprint(params),
                }
            )
        self.config.versions.release(state.version, state.params)
        self.stats.units += 1  # a unit counts towards throughput when its backward is done
        for a, names in self.config.part.receives(self.s):
            out: list[torch.Tensor] = []
            for n in names:
                spec = self.config.specs[n]
                for leaf, ls in zip(grad_leaves(state.received[n], spec), grad_specs(spec), strict=True):
                    out.append(ls.to_wire(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)))
            self.outbox[(Kind.SEND_GRAD, u, a)] = [self.comm.header(self.base + u, state.version), *out]
        self.comm.release(self.base + u)  # received values the transport lent in place are done with

    def allreduce(self, ins: Instr) -> None:
        if self.reducer is not None:
            self.reducer.finish()  # its buckets started during the backward (pdrun/overlap.py)

    def step(self, ins: Instr) -> None:
        self.config.versions.before_step()
        if self.config.optimizer is not None:
            if self.config.lr_at is not None:
                lr = self.config.lr_at(self.run_steps)
                for g in self.config.optimizer.param_groups:
                    g["lr"] = lr
            if self.config.tied is not None:
                self.config.tied.sum()  # after the replicas' all-reduce, before the update
            self.config.optimizer.step()
            self.config.optimizer.zero_grad(set_to_none=True)
        self.config.versions.stepped()
        self.steps += 1
        if self.steps % self.config.updates_per_step == 0:
            self._close_step()

    @property
    def run_steps(self) -> int:
        """The run's optimizer steps this worker has completed."""
        return self.steps // self.config.updates_per_step

    # ------------------------------------------------------------------ communication

    def send_act(self, ins: Instr) -> None:
        assert ins.peer is not None
        tensors = self.outbox.pop((Kind.SEND_ACT, ins.unit, ins.peer[0]))
        self.comm.send(tensors, self.config.peers.rank(ins.peer), TAG_ACT)

    def _post(self, ins: Instr) -> PostedRecv:
        """Post the receives of a receive instruction, into buffers of the values' known shapes."""
        assert ins.peer is not None
        if ins.kind == Kind.RECV_ACT:
            buffers = self._buffers(dict(self.config.part.receives(self.s))[ins.peer[0]])
            return self.comm.post(buffers, self.config.peers.rank(ins.peer), TAG_ACT, hold=True)
        names = self._grad_names(ins.peer[0])
        buffers = [g.empty(self.config.device) for n in names for g in grad_specs(self.config.specs[n])]
        return self.comm.post(buffers, self.config.peers.rank(ins.peer), TAG_GRAD, hold=True)

    def _grad_names(self, b: int) -> list[str]:
        """The values this stage sends to stage ``b`` that take a gradient back."""
        return [n for n in dict(self.config.part.consumers(self.s))[b] if self.config.specs[n].requires_grad]

    def recv_act(self, ins: Instr) -> None:
        assert ins.peer is not None
        a = ins.peer[0]
        names = dict(self.config.part.receives(self.s))[a]
        posted = self.posted.pop(self.at)
        version, got = self.comm.wait(posted, self.base + ins.unit, "activations")
        self.inbox.setdefault(ins.unit, {}).update(self._unpack(names, got))
        if self.config.part.reads_input(a) or ins.unit not in self.inbox_version:
            self.inbox_version[ins.unit] = version

    def send_grad(self, ins: Instr) -> None:
        assert ins.peer is not None
        tensors = self.outbox.pop((Kind.SEND_GRAD, ins.unit, ins.peer[0]))
        self.comm.send(tensors, self.config.peers.rank(ins.peer), TAG_GRAD)

    def recv_grad(self, ins: Instr) -> None:
        assert ins.peer is not None
        names = self._grad_names(ins.peer[0])
        posted = self.posted.pop(self.at)
        _, got = self.comm.wait(posted, self.base + ins.unit, "gradients")
        box = self.grads.setdefault(ins.unit, {})
        it = iter(got)
        for n in names:
            gs = [g.from_wire(next(it)) for g in grad_specs(self.config.specs[n])]
            # A value read by several later stages gets the sum of their gradients.
            box[n] = [a + g for a, g in zip(box[n], gs, strict=True)] if n in box else gs

    def _buffers(self, names: tuple[str, ...]) -> list[torch.Tensor]:
        """Receive buffers for ``names``' values, from their known shapes."""
        return [leaf.empty(self.config.device) for n in names for leaf in leaves(self.config.specs[n])]

    def _pack(self, names: tuple[str, ...], values: dict[str, Any]) -> list[torch.Tensor]:
        return [t for n in names for t in encode(values[n], self.config.specs[n], self.config.device)]

    def _unpack(self, names: tuple[str, ...], tensors: list[torch.Tensor]) -> dict[str, Any]:
        it = iter(tensors)
        return {n: decode(it, self.config.specs[n]) for n in names}

    # ------------------------------------------------------------------ data and bookkeeping

    def _batch(self, u: int) -> tuple[tuple[Any, ...], Any]:
        needs_input = bool(self.config.stage.batch_inputs)
        if not needs_input and not self.config.stage.has_output:
            return (), None
        inputs, target = self.config.units.batch(
            self.base + u, inputs=needs_input, target=self.config.stage.has_output
        )
        inputs = self._inputs(inputs) if needs_input else ()
        target = (
            to_device(target, self.config.device, self.config.dtype) if self.config.stage.has_output else None
        )
        return tuple(inputs), target

    def _inputs(self, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """Batch inputs on this worker's device, dtype and layout."""
        moved = tuple(to_device(inputs, self.config.device, self.config.dtype))
        if not self.config.channels_last:
            return moved
        return inputs_to_channels_last(moved)

    def _close_step(self) -> None:
        now = time.perf_counter()
        st = self.stats
        wall = max(now - st.start, 1e-9)
        row = {
            "step": self.run_steps - 1,
            "loss": sum(st.losses) / len(st.losses) if st.losses else math.nan,
            "rank": self.config.rank,
            "stage": self.s,
            "replica": self.config.replica,
            "samples_per_s": st.units * self.config.units.batch_size / wall,
            "compute_s": st.compute_s,
            "comm_s": st.comm_s,
            "idle_s": st.idle_s,
            **{column: sum(st.by_kind.get(k, 0.0) for k in kinds) for column, kinds in PARTS.items()},
            "wall_s": wall,
            "versions": self.config.versions.held(),
            "peak_memory_bytes": peak.peak_bytes(),
        }
        self.step_rows.append(row)
        self.stats = StepStats(now)
        if self.config.on_step is not None:
            self.config.on_step(row)

    # ------------------------------------------------------------------ validation

    def validate(self, units: Units, pipe: Pipeline) -> tuple[float, int, int, int]:
        """Forward-only pass over ``units`` through the pipeline: (loss sum, correct, samples, scored) on the last stage.

        ``scored`` is how many predictions ``correct`` was counted over: one per sample for class
        targets, one per target token (not ``-100``) for sequence targets ``(N, T)``.

        It runs the ``forward`` schedule's program (``shared.schedule.ForwardOnly``): one
        forward per unit, its receives before it and its sends after it, as training does.
        """
        tally = Tally()
        self.config.stage.module.eval()  # dropout off, BatchNorm on its running statistics
        program = (
            worker_program(ForwardOnly(), pipe, (self.s, self.config.replica), units.per_epoch)
            if units.per_epoch
            else ()
        )
        for ins in program:
            self.val_instr(ins, units, tally)
        self.comm.drain()
        self.config.stage.module.train()
        return tally.loss_sum, tally.correct, tally.count, tally.scored

    def val_instr(self, ins: Instr, units: Units, tally: Tally) -> None:
        """One instruction of a forward-only pass: a forward (tallied on the last stage), or its message."""
        if ins.kind is Kind.FORWARD:
            self._val_forward(ins.unit, units, tally)
            return
        assert ins.peer is not None
        peer = self.config.peers.rank(ins.peer)
        if ins.kind is Kind.RECV_ACT:
            names = dict(self.config.part.receives(self.s))[ins.peer[0]]
            _, got = self.comm.recv(self._buffers(names), peer, TAG_VAL, ins.unit, "validation activations")
            self.inbox.setdefault(ins.unit, {}).update(self._unpack(names, got))
        else:  # SEND_ACT
            self.comm.send(self.outbox.pop((Kind.SEND_ACT, ins.unit, ins.peer[0])), peer, TAG_VAL)

    def _val_forward(self, v: int, units: Units, tally: Tally) -> None:
        received = self.inbox.pop(v, {})
        inputs, target = units.batch(
            v, inputs=bool(self.config.stage.batch_inputs), target=self.config.stage.has_output
        )
        inputs = self._inputs(inputs) if self.config.stage.batch_inputs else ()
        with torch.no_grad():
            sent, output = self.config.stage.run(tuple(inputs), received)
        for b, names in self.config.part.consumers(self.s):
            self.outbox[(Kind.SEND_ACT, v, b)] = [self.comm.header(v, 0), *self._pack(names, sent)]
        if self.config.stage.has_output:
            real = units.real(v)
            output, target = (
                _head(output, real),
                to_device(target, self.config.device, self.config.dtype)[:real],
            )
            tally.loss_sum += float(self.config.loss_fn(output, target)) * real
            hits, scored = _correct(output, target, next_token=self.config.next_token)
            tally.correct += hits
            tally.scored += scored
            tally.count += real


@dataclass
class Tally:
    """What validation sums on the last stage."""

    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0
    scored: int = 0  # the predictions ``correct`` counts among (tokens, for sequence targets)


class _Ahead:
    """A worker's instruction stream, read a little ahead of the instruction running.

    It holds only the instructions between the running one and the furthest one looked at
    (at most ``LOOKAHEAD``), so a program of any length costs the same memory.
    """

    def __init__(self, stream: Iterator[Instr]) -> None:
        self.stream = stream
        self.buffer: deque[Instr] = deque()  # read, after the running instruction
        self.current: Instr | None = None
        self.at = -1  # the index of the running instruction

    def next(self) -> Instr | None:
        """Move on to the next instruction (None at the end)."""
        self.current = self.buffer.popleft() if self.buffer else next(self.stream, None)
        if self.current is not None:
            self.at += 1
        return self.current

    def peek(self, index: int) -> Instr | None:
        """The instruction at ``index`` (the running one or later), None past the end or the lookahead."""
        if index == self.at:
            return self.current
        i = index - self.at - 1
        if i >= LOOKAHEAD:
            return None
        while len(self.buffer) <= i:
            ins = next(self.stream, None)
            if ins is None:
                return None
            self.buffer.append(ins)
        return self.buffer[i]

    def reduces_next(self) -> bool:
        """Whether an ALLREDUCE follows the running backward before the next compute op."""
        index = self.at + 1
        while (ins := self.peek(index)) is not None:
            if ins.kind is Kind.ALLREDUCE:
                return True
            if ins.kind in (Kind.FORWARD, Kind.BACKWARD):
                return False
            index += 1
        return False


def _head(output: Any, n: int) -> Any:
    """The first ``n`` samples of a model output (a tensor or a tuple of them)."""
    if isinstance(output, torch.Tensor):
        return output[:n]
    if isinstance(output, (tuple, list)):
        return type(output)(_head(o, n) for o in output)
    return output


def _correct(output: Any, target: torch.Tensor, *, next_token: bool = False) -> tuple[int, int]:
    """(top-1 hits, predictions scored) for class or token targets; (0, samples) when not classification.

    A sequence target ``(N, T)`` scores every token but those the loss ignores (``-100``), so
    the accuracy is per token, as the loss is. With ``next_token`` (``causal_lm``, whose labels are
    its inputs) the logits at 0..T-2 are scored against the labels at 1..T-1, the pairs its loss scores.
    """
    main = output[0] if isinstance(output, (tuple, list)) else output
    samples = int(target.shape[0]) if target.dim() else 1
    if not isinstance(main, torch.Tensor) or target.is_floating_point() or main.dim() < 2:
        return 0, samples
    if next_token and main.dim() == 3 and target.dim() == 2:
        main, target = main[:, :-1], target[:, 1:]
    pred = main.argmax(-1)
    if pred.shape != target.shape:
        return 0, samples
    kept = target != IGNORE_INDEX
    return int(((pred == target) & kept).sum()), int(kept.sum())

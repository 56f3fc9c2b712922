"""Run one rank's pipeline action list (:mod:`passes.ir.schedule`) for one training step.

What each action does on this rank::

    RECV_F s,i   post irecv of every boundary tensor stage s reads from stage s-1, into buffers
                 shaped from StageIO's static (sympy) shapes at the micro-batch's dims: no
                 shape handshake between ranks
    F s,i        wait those receives; run stage s on (received leaves, graph inputs, sizes);
                 keep its outputs for backward
    SEND_F s,i   isend stage s's outputs read by stage s+1
    RECV_B s,i   post irecv of the gradients of those outputs
    B s,i        wait them; autograd.backward(outputs, grads), the loss scaled by 1/m
    I s,i        the same inputs as B; only the gradient of the received inputs (and of the data's
                 entry points), keeping what W needs (:mod:`runtime.exec.split_backward`)
    W s,i        the parameters' gradients of that backward
    SEND_B s,i   isend the gradients of stage s's received inputs to stage s-1
    ALL_REDUCE   ``grad_sync()`` callback (data-parallel and tied-weight gradients)
    STEP         ``step()`` callback (optimizer)

All point-to-point traffic is non-blocking (a 1F1B schedule deadlocks with blocking sends) and
goes through :mod:`runtime.dist.comm`: the messages of consecutive SEND/RECV actions (one schedule
step) are posted together as one ``batch_isend_irecv`` right before the next compute or sync
action; receives are waited right before their tensors are used, sends at the end of the step,
and their tensors are kept alive until then. On NCCL a rank's batches run in order on one
stream, each until its peers' matching batches run; the schedules are checked to complete under
exactly that model (:func:`passes.ir.schedule.validate.check_batches`): messages to a higher
rank go over ``pp_group``, to a lower one over ``pp_reverse_group`` (two streams on NCCL). Peers in the schedule
are pipeline indices; they map to global ranks through ``pp_ranks``. Every message has a tag
made of (direction, sending stage, micro-batch, tensor) so gloo never confuses two messages
between the same pair of ranks.

Two consecutive stages on the same rank (pp=1 with virtual stages) exchange tensors in memory:
the schedule has no SEND/RECV between them.

Receive shapes and size inputs are sympy expressions evaluated once per distinct micro-batch dims
and cached (``subs`` costs milliseconds a step: ~20 ms for the 16 receives of a 4-stage,
8-micro-batch GPT step, measured on our loaded 2-core machine; ~1.4 ms cached).
Each stage program runs in the dtype it was captured in (a bf16 plan is a bf16 graph), so its
outputs have their contracts' dtypes. ``loss_scale`` multiplies the loss before backward (fp16's
dynamic loss scaling, :mod:`runtime.optim.mixed_precision`; 1.0 otherwise); the loss is taken to fp32
first, so the scaled value cannot overflow the 16-bit range.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import fx

from passes.ir.errors import ConfigError
from passes.ir.meta import StageIO, dim_symbol
from passes.ir.schedule.actions import Action, Kind
from runtime.dist import comm
from runtime.exec.split_backward import PendingWeights, WeightOrder, backward_input, backward_weight

_COMM = (Kind.RECV_F, Kind.SEND_F, Kind.RECV_B, Kind.SEND_B)


@dataclass(frozen=True)
class LocalStage:
    """A stage program this rank runs: global stage index, its module and its I/O contract;
    ``run``: what runs the module (:func:`runtime.exec.compiled.compile_stage` of it under a
    compiled plan; None: the module itself)."""

    index: int
    module: fx.GraphModule
    io: StageIO
    run: Callable[..., Any] | None = None


class StageExecutor:
    """Runs the action lists of one rank; one instance per rank, reused across steps.

    ``stages``: this rank's stages by global index. ``io``: the StageIO of every stage (neighbour
    contracts give the order of the tensors exchanged). ``pp_ranks[j]``: the global rank of
    pipeline index j in this rank's pipeline; ``pp_group`` the group over them.
    """

    def __init__(self, stages: Mapping[int, LocalStage], io: Sequence[StageIO], *, pp_ranks: Sequence[int],
                 pp_group: dist.ProcessGroup | None, num_micro_batches: int, device: torch.device,
                 pp_reverse_group: dist.ProcessGroup | None = None, pp_index: int | None = None,
                 stream_groups: Mapping[str, dist.ProcessGroup] | None = None):
        self.stages = dict(stages)
        self.io = tuple(io)
        self.pp_ranks = tuple(pp_ranks)
        self.pp_group = pp_group
        self.pp_reverse_group = pp_reverse_group if pp_reverse_group is not None else pp_group
        # ZBV: one group per (what the message carries, direction); see message_stream_by_kind
        self.stream_groups = dict(stream_groups or {})
        self.pp_index = pp_index
        self.m = num_micro_batches
        self.device = device
        # boundary[s]: names stage s sends to stage s + 1, in the receiver's input order.
        self.boundary = {s: [inp.name for inp in self.io[s + 1].inputs if inp.kind == "recv"]
                         for s in range(len(self.io) - 1)}
        for s in range(1, len(self.io)):
            sources = {inp.source for inp in self.io[s].inputs if inp.kind == "recv"}
            if sources - {s - 1}:
                raise ConfigError(f"stage_executor: stage {s} receives from stages {sorted(sources)}; the executor needs "
                                          f"neighbour-only traffic: split with skip='relay'")
        self._meta = {(s, inp.name): inp.meta for s in range(len(self.io)) for inp in self.io[s].inputs
                      if inp.kind == "recv"}
        self.loss_scale = 1.0
        # (shape or size expression id, dims) -> evaluated ints; the expressions live in self.io.
        self._shape_cache: dict[tuple[int, tuple], object] = {}
        self._dims_key: tuple = ()
        # perf_counter seconds at which each backward action of the last run ended (tests
        # check that gradient buckets start before the last one ends).
        self.backward_done_s: dict[tuple[int, int], float] = {}
        # the order W accumulates parameters in where buckets launch from their hooks (ParallelModel sets it)
        self.weight_order: WeightOrder | None = None

    # ------------------------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], micro_inputs: Sequence[Mapping[str, torch.Tensor]],
            dims: Mapping[str, int], *, grad_sync: Callable[[], None], step: Callable[[], None]) -> list[torch.Tensor]:
        """Execute ``actions`` for one step; returns the detached per-micro-batch losses computed here.

        ``micro_inputs[i]``: graph inputs of micro-batch i by name (on ``device``); ``dims``: the
        named dims of one micro-batch (e.g. ``{"batch": 2, "seq": 8}``).
        """
        if torch._C._len_torch_dispatch_stack() and any(st.run is not None for st in self.stages.values()):
            # torch.compile runs a program first met under a dispatch mode eagerly, and keeps doing so
            raise ConfigError("stage executor: this plan runs compiled stage programs, and the step was called "
                              "under a torch dispatch mode (a FlopCounterMode, a memory tracker, ...), under which "
                              "torch.compile would run them uncompiled; step outside the mode, or plan with "
                              "compile=false")
        self._dims = {dim_symbol(k): v for k, v in dims.items()}
        self._dims_key = tuple(sorted(dims.items()))
        self.backward_done_s = {}
        self._inputs = micro_inputs
        self._recv: dict[tuple[str, int, int], list[tuple[torch.Tensor, object]]] = {}
        self._leaves: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._outputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._sends: list[list] = []  # [tensor, work] of each posted send
        # the forward sends of each (stage, micro-batch): complete once that micro-batch's output
        # gradient has come back from the next stage, so released then, not at the step's end
        self._forward_sends: dict[tuple[int, int], list[list]] = {}
        self._pending: list[tuple[comm.P2P, list]] = []  # messages of the current schedule step, not yet posted
        self._losses: list[torch.Tensor] = []
        self._weights: dict[tuple[int, int], PendingWeights] = {}
        handlers = {Kind.RECV_F: self._recv_f, Kind.FORWARD: self._forward, Kind.SEND_F: self._send_f,
                    Kind.RECV_B: self._recv_b, Kind.BACKWARD: self._backward, Kind.SEND_B: self._send_b,
                    Kind.BACKWARD_INPUT: self._backward, Kind.BACKWARD_WEIGHT: self._backward_weight}
        for action in actions:
            if action.kind not in _COMM:
                self._flush()  # the step's sends and receives go out together
            if action.kind == Kind.ALL_REDUCE:
                self._wait_sends()
                grad_sync()
            elif action.kind == Kind.OPTIMIZER_STEP:
                step()
            else:
                handlers[action.kind](action)
        self._flush()
        self._wait_sends()
        losses, self._losses = self._losses, []
        self._leaves.clear()
        self._weights.clear()
        self._outputs.clear()
        return losses

    # ------------------------------------------------------------------------------------------
    def _shape(self, meta) -> list[int]:
        key = (id(meta), self._dims_key)
        shape = self._shape_cache.get(key)
        if shape is None:
            shape = self._shape_cache[key] = [int(d.subs(self._dims)) if hasattr(d, "subs") else int(d)
                                              for d in meta.shape]
        return shape

    def _size(self, expr) -> int:
        key = (id(expr), self._dims_key)
        value = self._shape_cache.get(key)
        if value is None:
            value = self._shape_cache[key] = int(expr.subs(self._dims))
        return value

    def _tag(self, direction: str, sender: int, mb: int, j: int) -> int:
        return ((int(direction == "B") * len(self.io) + sender) * self.m + mb) * 1024 + j

    def _post_recvs(self, key, names, receiver_stage, direction, sender, peer):
        buffers = []
        for j, name in enumerate(names):
            meta = self._meta[(receiver_stage if direction == "F" else receiver_stage + 1, name)]
            buf = torch.empty(self._shape(meta), dtype=meta.dtype, device=self.device)
            entry = [buf, None]
            self._pending.append((comm.P2P("recv", buf, self.pp_ranks[peer], self._tag(direction, sender, key[2], j),
                                           self._group(peer, sending=False, direction=direction)), entry))
            buffers.append(entry)
        self._recv[key] = buffers

    def _flush(self) -> None:
        """Post the messages of the current schedule step as one batch."""
        if not self._pending:
            return
        works = comm.post_p2p([m for m, _ in self._pending])
        for (_, entry), work in zip(self._pending, works):
            entry[1] = work
        self._pending.clear()

    def _take_recvs(self, key) -> list[torch.Tensor]:
        out = []
        for buf, work in self._recv.pop(key, []):
            comm.wait(work, self.pp_reverse_group)
            out.append(buf)
        return out

    def _grad_names(self, s: int) -> list[str]:
        """Boundary tensors from stage s to s+1 that carry a gradient back."""
        return [n for n in self.boundary[s] if self._meta[(s + 1, n)].requires_grad]

    # ------------------------------------------------------------------------------------------
    def _recv_f(self, a: Action) -> None:
        self._post_recvs(("F", a.stage, a.microbatch), self.boundary[a.stage - 1], a.stage, "F", a.stage - 1, a.peer)

    def _recv_b(self, a: Action) -> None:
        self._post_recvs(("B", a.stage, a.microbatch), self._grad_names(a.stage), a.stage, "B", a.stage + 1, a.peer)

    def _forward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        stage = self.stages[s]
        received = dict(zip(self.boundary.get(s - 1, []), self._take_recvs(("F", s, i))))
        if s > 0 and not received and (s - 1) in self.stages:  # neighbour on this rank: in memory
            received = {n: self._outputs[(s - 1, i)][n].detach() for n in self.boundary[s - 1]}
        args, leaves = [], {}
        for inp in stage.io.inputs:
            if inp.kind == "graph_input":
                args.append(self._inputs[i][inp.name])
            elif inp.kind == "size":
                args.append(self._size(inp.value))
            else:
                t = received[inp.name].requires_grad_(inp.meta.requires_grad)
                leaves[inp.name] = t
                args.append(t)
        result = (stage.module if stage.run is None else stage.run)(*args)
        self._leaves[(s, i)] = leaves
        self._outputs[(s, i)] = {out.name: value for out, value in zip(stage.io.outputs, result)}
        for out, value in zip(stage.io.outputs, result):
            if out.graph_output == 0:
                self._losses.append(value.detach())

    def _send_f(self, a: Action) -> None:
        outputs = self._outputs[(a.stage, a.microbatch)]
        for j, name in enumerate(self.boundary[a.stage]):
            entry = self._isend(outputs[name].detach().contiguous(), a.peer, "F",
                                self._tag("F", a.stage, a.microbatch, j))
            self._forward_sends.setdefault((a.stage, a.microbatch), []).append(entry)

    def _backward(self, a: Action) -> None:
        s, i = a.stage, a.microbatch
        stage = self.stages[s]
        outputs = self._outputs.pop((s, i))
        names = self._grad_names(s) if s + 1 < len(self.io) else []
        grads = dict(zip(names, self._take_recvs(("B", s, i))))
        if grads:  # the next stage ran this micro-batch's backward: it had received our forward sends
            self._release_forward_sends(s, i)
        if names and not grads and (s + 1) in self.stages:  # neighbour on this rank: in memory
            leaves = self._leaves.pop((s + 1, i))
            grads = {n: _grad_or_zeros(leaves[n]) for n in names}
        tensors, grad_tensors = [], []
        for out in stage.io.outputs:
            value = outputs[out.name]
            if out.graph_output == 0:
                # mean over micro-batches (dp averaging is grad_sync's), times the loss scale
                tensors.append(value.float() / self.m * self.loss_scale)
                grad_tensors.append(None)
            elif out.name in grads and value.requires_grad:
                tensors.append(value)
                grad_tensors.append(grads[out.name])
        if a.kind == Kind.BACKWARD_INPUT:
            self._weights[(s, i)] = backward_input(tensors, grad_tensors, list(self._leaves.get((s, i), {}).values()))
            return
        if tensors:
            torch.autograd.backward(tensors, grad_tensors)
        self.backward_done_s[(s, i)] = time.perf_counter()

    def _backward_weight(self, a: Action) -> None:
        backward_weight(self._weights.pop((a.stage, a.microbatch)), self.weight_order)
        self.backward_done_s[(a.stage, a.microbatch)] = time.perf_counter()

    def _send_b(self, a: Action) -> None:
        leaves = self._leaves.pop((a.stage, a.microbatch))
        for j, name in enumerate(self._grad_names(a.stage - 1)):
            self._isend(_grad_or_zeros(leaves[name]), a.peer, "B", self._tag("B", a.stage, a.microbatch, j))

    def _isend(self, tensor: torch.Tensor, peer: int, direction: str, tag: int) -> list:
        entry = [tensor, None]  # the tensor must live until the send completes
        self._pending.append((comm.P2P("send", tensor, self.pp_ranks[peer], tag,
                                       self._group(peer, sending=True, direction=direction)), entry))
        self._sends.append(entry)
        return entry

    def _release_forward_sends(self, s: int, i: int) -> None:
        """Wait (at once: they are complete) for the forward sends of micro-batch ``i`` of stage
        ``s`` and drop them, so their tensors do not outlive the micro-batch's backward."""
        done = self._forward_sends.pop((s, i), [])
        for entry in done:
            comm.wait(entry[1], self.pp_group)
        ids = {id(entry) for entry in done}
        self._sends = [entry for entry in self._sends if id(entry) not in ids]

    def _group(self, peer: int, *, sending: bool, direction: str):
        """The group of a message with pipeline index ``peer``: ``pp_group`` towards higher
        indexes (sends to, receives from lower), ``pp_reverse_group`` the other way; with
        ``stream_groups`` (ZBV), the group of ``"{direction}-up"`` / ``"{direction}-down"``."""
        me = self.pp_index if self.pp_index is not None else peer
        up = peer > me if sending else peer < me
        if self.stream_groups:
            return self.stream_groups[f"{direction}-{'up' if up else 'down'}"]
        return self.pp_group if up else self.pp_reverse_group

    def _wait_sends(self) -> None:
        self._flush()
        for _, work in self._sends:
            comm.wait(work, self.pp_group)  # both pp groups have the mesh's timeout
        self._sends.clear()
        self._forward_sends.clear()


def backward_counts(actions: Sequence[Action]) -> dict[int, int]:
    """Backward actions per stage in one rank's action list (gradient accumulations per step:
    full backwards, or the weight halves of split ones)."""
    out: dict[int, int] = {}
    for a in actions:
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_WEIGHT):
            out[a.stage] = out.get(a.stage, 0) + 1
    return out


def _grad_or_zeros(t: torch.Tensor) -> torch.Tensor:
    # A received tensor no op of this stage differentiates through still owes its sender a gradient.
    return t.grad if t.grad is not None else torch.zeros_like(t)

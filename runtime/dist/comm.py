"""Every collective and point-to-point call the runtime makes goes through this module.

Three rules hold for every call, so that a job that runs on gloo also runs on NCCL and never hangs:

* **tensors on the group's device**: a tensor sent over an NCCL group must be a CUDA tensor (an
  NCCL-only group refuses CPU tensors); :func:`check_device` raises :class:`CommError` naming the
  call before anything is posted;
* **timeouts**: groups are made by :class:`runtime.dist.mesh.Mesh` with its timeout, and every wait
  here waits at most that long (:func:`wait` passes the group's timeout on), so a dead or stalled
  peer turns into an error;
* **point-to-point in batches**: the sends and receives of one schedule step are posted together
  with ``batch_isend_irecv`` (:func:`post_p2p`), one batch per process group, receives before
  sends, each in the order the schedule gives. Messages towards higher ranks and towards lower
  ones travel on two groups (two NCCL communicators, two streams), so on NCCL, where a rank's
  batches on one communicator run in order and a send waits for its receive, a message never
  waits behind one going the other way; the schedules are checked to complete under exactly
  that model, and to post the messages between two ranks in the same order on both sides
  (:func:`passes.ir.schedule.validate.check_batches`).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from passes.ir.errors import PartitionerError


class CommError(PartitionerError, RuntimeError):
    """A communication call was given something its process group cannot carry."""


_TIMEOUTS: dict[Any, datetime.timedelta] = {}


def new_group(ranks: Sequence[int], *, timeout_s: float) -> dist.ProcessGroup | None:
    """A process group over ``ranks`` whose every operation times out after ``timeout_s``
    seconds; call it on every rank of the world, in the same order."""
    timeout = datetime.timedelta(seconds=timeout_s)
    group = dist.new_group(ranks=list(ranks), timeout=timeout)
    if group is not None:
        _TIMEOUTS[group] = timeout
    return group


def timeout_of(group: Any) -> datetime.timedelta | None:
    """The timeout ``group`` was made with here (``None``: the default group's)."""
    return _TIMEOUTS.get(group)


def backend_of(group: Any) -> str:
    return str(dist.get_backend(group))


def check_device(t: torch.Tensor, group: Any, call: str) -> None:
    """Refuse a tensor the group's backend cannot carry (a CPU tensor on an NCCL group)."""
    if backend_of(group) == "nccl" and not t.is_cuda:
        raise CommError(f"{call}: a {t.device.type} tensor of shape {tuple(t.shape)} on an NCCL group; move it "
                        f"to the mesh's device (mesh.device) first")


def wait(work: Any, group: Any = None) -> None:
    """Wait for ``work`` at most the group's timeout."""
    if work is None:
        return
    timeout = timeout_of(group)
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


# --- collectives -----------------------------------------------------------------------------------
_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(t: torch.Tensor, group: Any = None, *, op: str = "sum", async_op: bool = False):
    """In-place all-reduce of ``t`` (``op``: sum or max); returns the work handle when ``async_op``."""
    check_device(t, group, "all_reduce")
    return dist.all_reduce(t, op=_REDUCE[op], group=group, async_op=async_op)


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group: Any = None, *, async_op: bool = False):
    """``parts[r]`` = rank r's ``t``."""
    check_device(t, group, "all_gather")
    return dist.all_gather(parts, t.contiguous(), group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, parts: list[torch.Tensor], group: Any = None, *, async_op: bool = False):
    """``out`` = the sum over ranks of their ``parts[this rank]``."""
    check_device(out, group, "reduce_scatter")
    return dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, group: Any = None) -> None:
    """``t`` = global rank ``src``'s ``t`` on every rank of ``group``."""
    check_device(t, group, "broadcast")
    dist.broadcast(t, src=src, group=group)


BROADCAST_BUCKET_BYTES = 64 * 2**20


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, group: Any = None, *, device: torch.device,
                      bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Every tensor of ``tensors`` = rank ``src``'s, in place: packed per dtype into buckets of
    about ``bucket_bytes`` on ``device`` (the group's device), one broadcast per bucket rather
    than one per tensor."""
    buckets: list[list[torch.Tensor]] = []
    open_bucket: dict[torch.dtype, tuple[list[torch.Tensor], list[int]]] = {}  # dtype -> (tensors, [bytes])
    for t in tensors:
        members, size = open_bucket.get(t.dtype, (None, None))
        if members is None or size[0] >= bucket_bytes:
            members, size = [], [0]
            open_bucket[t.dtype] = (members, size)
            buckets.append(members)
        members.append(t)
        size[0] += t.numel() * t.element_size()
    for bucket in buckets:
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in bucket])
        broadcast(flat, src, group)
        offset = 0
        for t in bucket:
            t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s picklable ``obj`` on every rank (pickled through the group's device)."""
    box = [obj]
    device = torch.device("cuda", torch.cuda.current_device()) if backend_of(group) == "nccl" else None
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in group rank order."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group: Any = None) -> None:
    dist.barrier(group=group)


# --- point to point --------------------------------------------------------------------------------
@dataclass(frozen=True)
class P2P:
    """One message of a schedule step: ``"send"`` or ``"recv"`` of ``tensor`` with global rank
    ``peer``, over process ``group``."""

    op: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0
    group: Any = None


def post_p2p(messages: Sequence[P2P]) -> list[Any]:
    """Post the messages of one schedule step, one ``batch_isend_irecv`` per group (receives
    first); returns their work handles in the order given (see the module docstring)."""
    out: list[Any] = [None] * len(messages)
    groups: dict[int, list[int]] = {}
    for k, m in enumerate(messages):
        check_device(m.tensor, m.group, f"{m.op} to/from rank {m.peer}")
        groups.setdefault(id(m.group), []).append(k)
    for ks in groups.values():
        order = sorted(ks, key=lambda k: messages[k].op != "recv")
        ops = [dist.P2POp(dist.irecv if messages[k].op == "recv" else dist.isend, messages[k].tensor,
                          messages[k].peer, group=messages[k].group, tag=messages[k].tag) for k in order]
        for k, work in zip(order, dist.batch_isend_irecv(ops)):
            out[k] = work
    return out

"""Turning a dead or failing peer into a prompt, named exit on every rank.

Every process group of a job has a timeout (:mod:`runtime.dist.mesh`), so no collective or receive
waits forever. When a peer dies, gloo raises on the ranks talking to it ("Connection closed by
peer") at once, and the others time out or see their own neighbours exit. The train loops
(:mod:`partitioner.cli.demo`) catch that error and call :func:`describe_failure`, which names the
failed rank(s): the ranks whose process is gone (pids are exchanged at start with
:func:`gather_pids`; only checkable for ranks on this host), else the peer of the action that
failed (a pipeline send/receive), else the ranks of the group of the failed collective.

A rank that *stopped* (SIGSTOP, a frozen host) closes nothing: its peers only time out. So
:func:`gather_pids` also starts this process's heartbeat (:mod:`runtime.dist.heartbeat`, through the
rendezvous store), and :func:`describe_failure` names the ranks whose heartbeat went stale
("peer rank 2 stopped answering: no heartbeat for 14.2 s (node3, pid 1234)"); it also leaves
this rank's last words there (``exiting`` on purpose, or ``failed`` with its error), so peers on
other hosts can tell the rank that failed from those that left because of it.
:func:`error_line` is the one-line form of any error for the command line: its type, first line
and the frame it was raised in.

:func:`arm_from_env` injects a fault for tests: ``PARTITIONER_FAULT="rank=2,step=1,action=3"``
kills rank 2 with SIGKILL when it starts its 4th instrumented action of step 1; with ``,raise=1``
the action raises :class:`InjectedFault` instead (a rank's own bug rather than a crash).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import sysconfig
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from passes.ir.schedule.actions import Action
from runtime.dist import comm, heartbeat

FAULT_ENV = "PARTITIONER_FAULT"


@dataclass(frozen=True, kw_only=True)
class RankIdentity:
    """Where a rank's process lives, for telling later whether it is still alive."""

    rank: int
    host: str
    pid: int


def gather_pids(group: Any = None) -> list[RankIdentity]:
    """Every rank's host and pid (a collective over ``group``; call it on every rank); starts this
    process's heartbeat (:mod:`runtime.dist.heartbeat`) for the job, named by the first rank's host
    and pid."""
    me = RankIdentity(rank=dist.get_rank(), host=socket.gethostname(), pid=os.getpid())
    identities = sorted(comm.all_gather_object(me, group), key=lambda r: r.rank)
    try:
        heartbeat.start(me.rank, f"{identities[0].host}-{identities[0].pid}")
    except Exception:  # noqa: BLE001 - without a heartbeat a stopped peer is only named less precisely
        pass
    return identities


def dead_ranks(ranks: Sequence[RankIdentity]) -> list[int]:
    """Ranks on this host whose process no longer exists (or is a zombie)."""
    host = socket.gethostname()
    dead = []
    for r in ranks:
        if r.host != host or r.pid == os.getpid():
            continue
        try:
            os.kill(r.pid, 0)
        except ProcessLookupError:
            dead.append(r.rank)
            continue
        except PermissionError:
            continue
        try:  # a killed child not yet reaped by its launcher still has a pid: read its state
            with open(f"/proc/{r.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    dead.append(r.rank)
        except (OSError, IndexError):
            pass
    return dead


def _marker_dir(identities: Sequence[RankIdentity]) -> Path:
    # One directory per job (rank 0's host and pid), so stale markers of older jobs never match.
    first = identities[0]
    return Path(tempfile.gettempdir()) / f"partitioner-exits-{first.host}-{first.pid}"


def mark_exiting(identities: Sequence[RankIdentity], rank: int, *, own: bool = False) -> None:
    """Record that ``rank`` is exiting on purpose because of a peer's failure, so ranks that look
    later do not blame it (only useful to ranks on the same host). ``own``: the rank failed by
    itself; nothing is recorded, so peers will name it."""
    if not identities or own:
        return
    hb = heartbeat.current()
    if hb is not None:
        hb.set_state("exiting", stop=True)
    d = _marker_dir(identities)
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / f"rank{rank}").write_text(str(os.getpid()))
    except OSError:
        pass


def failed_ranks(identities: Sequence[RankIdentity]) -> list[int]:
    """Ranks on this host whose process is gone without having marked a deliberate exit: the
    ones that failed first, not those that exited because of them."""
    dead = dead_ranks(identities)
    if not dead:
        return []
    d = _marker_dir(identities)
    return [r for r in dead if not (d / f"rank{r}").exists()]


def describe_failure(exc: BaseException, *, rank: int, last_action: Action | str | None,
                     identities: Sequence[RankIdentity], pp_ranks: Sequence[int] = (),
                     group_ranks: Sequence[int] = (), settle_s: float = 2.0,
                     stale_after_s: float = heartbeat.STALE_AFTER_S) -> str:
    """One line for the log: which peer failed, during which action of this rank, and why.

    Looks, for up to ``settle_s`` seconds, for peers whose process is gone (this host), that
    recorded their own failure, or whose heartbeat is older than ``stale_after_s`` seconds
    (stopped); else names the other end of the failed action, else the group. Also marks this
    rank as exiting on purpose (:func:`mark_exiting`): call it once, on the way out.
    """
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    why = f"({type(exc).__name__}: {first[:200]})"
    where = last_action or "start-up"
    hb = heartbeat.current()
    if not is_communication_error(exc):  # this rank's own bug: its peers will name it
        mark_exiting(identities, rank, own=True)
        if hb is not None:
            hb.set_state("failed", f"{type(exc).__name__}: {first[:200]}", stop=True)
        return f"rank {rank}: failed during {where}; exiting {why}"
    # A killed peer's sockets close while its process is still being torn down: look again for
    # a moment before falling back to guessing from the action.
    ranks = [r.rank for r in identities] or list(group_ranks)
    dead: list[int] = []
    silent: list[heartbeat.Silent] = []
    unreachable = False
    deadline = time.monotonic() + (settle_s if identities else 0.0)
    next_read = time.monotonic()
    while True:
        dead = failed_ranks(identities) if identities else []
        if not dead and hb is not None and time.monotonic() >= next_read:
            try:
                beats = hb.read(ranks)
            except heartbeat.StoreUnreachable:
                unreachable, hb = True, None
            else:
                dead = sorted(set(dead) | {r for r, b in beats.items() if b.state == "failed" and r != rank})
                silent = heartbeat.silent_ranks(beats, me=rank, stale_after_s=stale_after_s)
            next_read = time.monotonic() + 0.5
        if dead or silent or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    mark_exiting(identities, rank)
    if dead:
        who = "peer rank " + ", ".join(map(str, dead)) if len(dead) == 1 else f"peer ranks {dead}"
        return f"rank {rank}: {who} failed during {where}; exiting {why}"
    if silent:
        return f"rank {rank}: {'; '.join(s.text() for s in silent)}; noticed during {where}; exiting {why}"
    if unreachable and rank != 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        # Without a launcher's agent, global rank 0 hosts the rendezvous store in its process.
        return (f"rank {rank}: peer rank 0 stopped answering: the rendezvous store it hosts does not answer; "
                f"noticed during {where}; exiting {why}")
    if isinstance(last_action, Action) and last_action.peer is not None and pp_ranks:
        who = f"peer rank {pp_ranks[last_action.peer]} (the other end of {last_action})"
    elif group_ranks:
        who = f"a peer among ranks {list(group_ranks)}"
    else:
        who = "a peer"
    return f"rank {rank}: {who} failed during {where}; exiting {why}"


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {sys.prefix, sys.base_prefix}
    return tuple(os.path.realpath(d) + os.sep for d in dirs if d)


_PROJECT_ROOT = Path(__file__).resolve().parents[2]


def last_frame(exc: BaseException) -> traceback.FrameSummary | None:
    """The frame ``exc`` (or, for a wrapping error, the error it was raised from) came from: the
    innermost frame outside the Python and site-packages libraries (this project's or the
    user's own code), else the innermost frame."""
    chain = [exc]
    while True:
        e = chain[-1]
        nxt = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    libs = _library_dirs()
    fallback = None
    for e in reversed(chain):  # the original error first
        frames = traceback.extract_tb(e.__traceback__)
        own = [f for f in frames if not os.path.realpath(f.filename).startswith(libs)
               or os.path.realpath(f.filename).startswith(str(_PROJECT_ROOT) + os.sep)]
        if own:
            return own[-1]
        fallback = fallback or (frames[-1] if frames else None)
    return fallback


def frame_text(exc: BaseException) -> str:
    """``partitioner/foo.py:123 in bar``: :func:`last_frame` of ``exc``, its path relative to the
    project when inside it (``""`` when ``exc`` has no traceback)."""
    frame = last_frame(exc)
    if frame is None:
        return ""
    path = Path(frame.filename)
    try:
        path = path.resolve().relative_to(_PROJECT_ROOT)
    except (ValueError, OSError):
        pass
    return f"{path}:{frame.lineno} in {frame.name}"


def error_line(exc: BaseException) -> str:
    """``ConfigError: <first line of the message> (partitioner/foo.py:123 in bar)``: an error in
    one line, with the frame it came from (:func:`frame_text`)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    where = frame_text(exc)
    return f"{line} ({where})" if where else line


_COMM_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "socket", "peer")


def is_communication_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from a collective or a send/receive (a peer's problem, or the
    network's) rather than from this rank's own computation."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _COMM_WORDS)


class InjectedFault(Exception):
    """The failure ``$PARTITIONER_FAULT`` asked for (``raise=1``)."""


def parse_fault(text: str) -> dict[str, int]:
    """``"rank=2,step=1,action=3"`` -> ``{"rank": 2, "step": 1, "action": 3, "raise": 0}``."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value)
    if "rank" not in out:
        raise ValueError(f"{FAULT_ENV}={text!r}: needs rank=R[,step=S][,action=A]")
    return {"rank": out["rank"], "step": out.get("step", 0), "action": out.get("action", 0),
            "raise": out.get("raise", 0)}


class _Fault:
    def __init__(self, step: int, action: int, raises: bool):
        self.step, self.action, self.raises = step, action, raises
        self.current_step = -1
        self.count = 0

    def begin_step(self, step: int) -> None:
        self.current_step, self.count = step, 0

    def wrap(self, fn):
        def run(*args, **kwargs):
            if self.current_step == self.step:
                if self.count == self.action:
                    if self.raises:
                        raise InjectedFault(f"injected fault at step {self.step}, action {self.action}")
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash, not an exception: no clean-up
                self.count += 1
            return fn(*args, **kwargs)
        return run


def arm_from_env(executor: Any, rank: int) -> _Fault | None:
    """If ``$PARTITIONER_FAULT`` names this rank, wrap the executor's actions so that it dies
    there; returns the fault (call ``begin_step(k)`` before each step) or ``None``."""
    text = os.environ.get(FAULT_ENV)
    if not text:
        return None
    spec = parse_fault(text)
    if spec["rank"] != rank:
        return None
    fault = _Fault(spec["step"], spec["action"], bool(spec["raise"]))
    for name in ("_forward", "_backward", "_backward_weight", "_recv_f", "_recv_b", "_send_f", "_send_b"):
        setattr(executor, name, fault.wrap(getattr(executor, name)))
    return fault

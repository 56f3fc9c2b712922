"""Run a function on ``world_size`` local processes (for tests and local runs), never hanging.

``spawn(fn, world_size, *args, timeout_s=...)`` starts one process per rank, forked from a fork
server that imported torch and the project once (:func:`preload`;
``$PARTITIONER_START_METHOD=spawn`` starts each from scratch instead). Each rank gets the
caller's environment with the env:// variables torchrun would set (MASTER_ADDR=127.0.0.1, a
free MASTER_PORT, RANK, LOCAL_RANK, WORLD_SIZE) in place of any the caller had from its own
launcher (:mod:`passes.ir.launcher_env`: a job started inside a torchrun rank is a job of its
own), calls ``fn(*args)``, and the per-rank results come back as a list. ``fn`` must be
importable (a module-level function) and its result picklable. ``fn`` initialises
torch.distributed itself (e.g. by building a :class:`runtime.dist.mesh.Mesh`); the process group is
destroyed when ``fn`` returns.

If a rank raises, the job stops at once (the other ranks are killed: they would otherwise wait
in a collective until their timeout) and :class:`LaunchError` names the rank and carries its
traceback (``LaunchError.failures``: each failed rank's one-line error and its traceback, for a
command line that prints one line per rank); likewise for a rank that dies without reporting, or
ranks still running after ``timeout_s`` seconds. A rank ends when its caller does: the ranks of
a caller that is killed do not wait out their timeouts.
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing.reduction import DupFd
import os
import pickle
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from passes.ir.errors import PartitionerError
from passes.ir.launcher_env import scrub_environ
from passes.ir.heap import collect_young_less_often, freeze_inherited


@dataclass(frozen=True, kw_only=True)
class RankError:
    """What a spawned rank raised: ``line`` (``runtime.dist.faults.error_line``: type, first line,
    the frame it came from) and the full ``traceback`` text."""

    rank: int
    line: str
    traceback: str


class LaunchError(PartitionerError, RuntimeError):
    """A spawned rank raised, died, or did not finish in time; the message names the rank(s).
    ``failures``: the ranks that raised (those reported by the time the job was stopped)."""

    def __init__(self, message: str, failures: tuple[RankError, ...] = ()):
        super().__init__(message)
        self.failures = failures


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


START_METHOD_ENV = "PARTITIONER_START_METHOD"
"""``forkserver`` (default) or ``spawn``: how :func:`spawn` starts its ranks."""

_preload: list[str] = ["runtime"]


def preload(*modules: str) -> None:
    """Modules the fork server imports once, before it forks the first rank: every rank then
    starts with them loaded (importing torch and the project takes seconds of CPU per process).
    Takes effect for a fork server not started yet (the first :func:`spawn` of this process
    starts it)."""
    _preload.extend(m for m in modules if m not in _preload)


def _context():
    """The multiprocessing context of the ranks: a fork server (forked from a clean process that
    imported :data:`_preload`, so no thread of this process is copied into a rank) unless
    ``$PARTITIONER_START_METHOD`` says ``spawn``."""
    method = os.environ.get(START_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise LaunchError(f"{START_METHOD_ENV}={method!r}; choose forkserver or spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(_preload))
    return ctx


class _CallerStdio:
    """The caller's stdout and stderr (file descriptors 1 and 2 at the time of the call), handed
    to a rank when it is started: a fork server's own are those of the moment it started (under
    pytest, another test's capture file), so a rank writes where its caller writes now."""

    def __reduce__(self):
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        return _redirect, (DupFd(1), DupFd(2))


def _redirect(out, err) -> None:
    """In the rank: point fds 1 and 2 at the caller's (the handles :class:`_CallerStdio` sent)."""
    os.dup2(out.detach(), 1)
    os.dup2(err.detach(), 2)


def _end_with_caller(caller: int) -> None:
    """Send this rank SIGTERM when process ``caller`` (the one that called :func:`spawn`) ends, so
    the ranks of a caller that was killed stop instead of waiting out their collective timeouts (a
    fork server's ranks are not its caller's children, and the server lives as long as they do).
    A daemon thread waits on the caller's pidfd (Linux), else checks it every second."""
    def watch() -> None:
        try:
            fd = os.pidfd_open(caller)
            select.select([fd], [], [])  # readable once the caller has ended
        except (AttributeError, OSError):
            while _alive(caller):
                time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    if caller > 0 and _alive(caller):
        threading.Thread(target=watch, name="partitioner-caller-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    return True


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, results,
            env: dict[str, str], stdio: None = None, caller: int = 0) -> None:
    # ``stdio`` did its work while the rank unpickled its arguments (:class:`_CallerStdio`).
    # The environment of the caller at the time of the call (a fork server's is that of its own
    # start), less the launcher of the caller's own job: a job started from inside a rank
    # (torchrun's, say) must not join it (TORCHELASTIC_USE_AGENT_STORE would make env:// wait on
    # the parent's store forever).
    os.environ.clear()
    os.environ.update(env)
    scrub_environ()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    freeze_inherited()  # the fork server's imports, scanned by every full collection otherwise
    collect_young_less_often()
    _end_with_caller(caller)
    try:
        import torch
        torch.set_num_threads(1)  # as torchrun does (OMP_NUM_THREADS=1): ranks share the cores
        # Plain pickle bytes: multiprocessing would share tensors by file descriptor, which the
        # parent can no longer open once this process has exited.
        results.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, "error", (f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", _line(exc))))
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            from runtime.dist import heartbeat
            heartbeat.stop()  # "done": a finished rank is not one that stopped answering
            dist.destroy_process_group()


def _line(exc: BaseException) -> str:
    try:
        from runtime.dist.faults import error_line
        return error_line(exc)
    except Exception:  # noqa: BLE001 - the report must reach the parent whatever happens here
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__}: {first}"


def starting_rank() -> bool:
    """Whether this process is still being started by multiprocessing: a new rank re-runs the
    launching script's top-level code (as ``__mp_main__``) before its function, so a script
    whose top-level code is not under ``if __name__ == "__main__":`` runs it again in each rank."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def refuse_while_starting(what: str) -> None:
    """Raise :class:`LaunchError` when :func:`starting_rank`: ``what`` (e.g. ``local_cluster(8)``)
    was called by the launching script's top-level code re-run in a new rank, where it would
    wait on its own parent (a lock, a port) for ever."""
    if starting_rank():
        raise LaunchError(f"{what} was called while this process was being started as a rank: the script that "
                          f"started the ranks runs it at import time, and every rank re-imports that script; put "
                          f"the script's top-level code under `if __name__ == \"__main__\":`")


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each rank in its own process.

    ``timeout_s`` (seconds) bounds the whole job; raises :class:`LaunchError` naming the failed
    rank (with its traceback) as soon as one raises or dies, or the unfinished ranks on timeout.
    """
    if world_size < 1:
        raise LaunchError(f"spawn: world_size must be >= 1, got {world_size}")
    refuse_while_starting(f"spawn of {world_size} rank(s)")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, env, _CallerStdio(),
                                               os.getpid()), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    done: dict[int, Any] = {}
    ok = False
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < world_size:
            try:
                rank, status, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if dead:
                    _drain(results, done)  # a rank may have reported just before exiting
                    dead = [r for r in dead if r not in done]
                if dead:
                    codes = ", ".join(f"rank {r} (exit code {procs[r].exitcode})" for r in dead)
                    raise LaunchError(f"spawn: {codes} died without reporting a result "
                                      f"(killed, crashed in native code, or failed while starting: its error, "
                                      f"if any, is printed above)") from None
                if time.monotonic() > deadline:
                    late = [r for r in range(world_size) if r not in done]
                    raise LaunchError(f"spawn: rank(s) {late} did not finish within {timeout_s:.0f} s "
                                      f"(a hang: waiting in a collective or a receive?); killed them") from None
                continue
            if status == "error":
                failures = (RankError(rank=rank, line=value[1], traceback=value[0]),) + _more_errors(results)
                raise LaunchError(f"spawn: rank {rank} of {world_size} raised {value[0]}", failures)
            done[rank] = pickle.loads(value)
        ok = True
    finally:
        _stop(procs, graceful=ok)
    return [done[r] for r in range(world_size)]


def _drain(results, done: dict[int, Any]) -> None:
    while True:
        try:
            rank, status, value = results.get(timeout=0.1)
        except queue.Empty:
            return
        if status == "error":
            failures = (RankError(rank=rank, line=value[1], traceback=value[0]),) + _more_errors(results)
            raise LaunchError(f"spawn: rank {rank} raised {value[0]}", failures)
        done[rank] = pickle.loads(value)


def _more_errors(results, settle_s: float = 1.0) -> tuple[RankError, ...]:
    """Errors other ranks report within ``settle_s`` seconds of the first (often the same
    refusal on every rank, or their peers' view of the failure)."""
    out = []
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if status == "error":
            out.append(RankError(rank=rank, line=value[1], traceback=value[0]))
    return tuple(out)


def _stop(procs, *, graceful: bool) -> None:
    """Join the ranks; kill (SIGKILL) the ones still running (after a failure at once: they only
    wait on a dead peer)."""
    if graceful:
        for p in procs:
            p.join(timeout=5.0)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)

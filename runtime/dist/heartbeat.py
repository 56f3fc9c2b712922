"""Every rank's heartbeat in the rendezvous store, so that a rank that stops answering is named.

A stopped process (SIGSTOP, a debugger, a machine that froze) keeps its sockets open: its peers
see no error, only a collective or a receive that times out, and cannot tell which of the ranks
they wait on (directly or through others) is the one that stopped. So every process of a job runs
one daemon thread that writes, every :data:`INTERVAL_S` seconds, a small JSON record under
``partitioner/heartbeat/<job>/<rank>`` of the job's rendezvous store (the store
``torch.distributed`` was initialised with, through a connection of its own, so a write never
waits behind the main thread's store calls)::

    {"t": 1733070000.5, "host": "node3", "pid": 1234, "state": "alive", "why": ""}

A stopped process's threads stop too, and a dead one's with it, so its record goes stale. A rank
whose collective times out reads the records of its peers (:func:`silent_ranks`) and names those
whose last beat is older than a few seconds. ``state`` tells a rank that stopped apart from one
that left on purpose: ``exiting`` (it is leaving because of a peer's failure), ``failed`` (its
own step raised; ``why`` says what), ``done`` (it finished). The times are wall-clock seconds
of each host (hosts of one job keep their clocks within well under a second of each other).

Writing is best effort: a store that does not answer never crashes training (the thread tries
again next beat). The thread ends when the process group it was started for is torn down, or at
:func:`stop`.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch.distributed as dist

INTERVAL_S = 1.0
"""Seconds between two beats of one rank."""
STALE_AFTER_S = 5.0
"""A beat older than this (seconds) means the rank stopped answering."""
STORE_TIMEOUT_S = 3.0
"""How long one store call of the heartbeat may wait (seconds): a store hosted by a stopped
process answers nothing."""
KEY_PREFIX = "partitioner/heartbeat"

State = Literal["alive", "exiting", "failed", "done"]


@dataclass(frozen=True, kw_only=True)
class Beat:
    """A rank's last heartbeat record: ``time_unix`` (wall seconds of its host), where the
    process runs, its ``state`` and, for ``failed``, ``why``."""

    rank: int
    time_unix: float
    host: str
    pid: int
    state: State = "alive"
    why: str = ""

    def age_s(self, now_unix: float | None = None) -> float:
        """Seconds since this beat (``now_unix``: the reader's wall clock, default now)."""
        return (time.time() if now_unix is None else now_unix) - self.time_unix


class StoreUnreachable(RuntimeError):
    """The rendezvous store did not answer within :data:`STORE_TIMEOUT_S` (its host process
    stopped or died)."""


def _connect(timeout_s: float) -> Any:
    """A new client of the job's store (a connection of its own, every call bounded by
    ``timeout_s``): the env:// store at MASTER_ADDR:MASTER_PORT, else a clone of the default
    process group's store."""
    timeout = datetime.timedelta(seconds=timeout_s)
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        return dist.TCPStore(addr, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    # clone() connects with the original store's timeout (minutes when its host is gone): only
    # where no address is known.
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(timeout)
    return store


class Heartbeat:
    """The beating thread of this process (global ``rank`` of the job ``job``); see the module
    docstring. Use :func:`start` rather than making one directly."""

    def __init__(self, rank: int, job: str, *, interval_s: float = INTERVAL_S):
        self.rank, self.job, self.interval_s = rank, job, interval_s
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.state: State = "alive"
        self.why = ""
        self._group = dist.group.WORLD  # beat while this process group lives
        self._stop = threading.Event()
        self._side: Any = None  # the main thread's own connection (reads, last words)
        self._unreachable = False
        self._thread = threading.Thread(target=self._run, name=f"partitioner-heartbeat-{rank}", daemon=True)

    def key(self, rank: int) -> str:
        return f"{KEY_PREFIX}/{self.job}/{rank}"

    def _record(self) -> str:
        return json.dumps({"t": time.time(), "host": self.host, "pid": self.pid, "state": self.state,
                           "why": self.why[:300]})

    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        store = None
        while not self._stop.is_set():
            if not dist.is_initialized() or dist.group.WORLD is not self._group:
                return  # the process group was torn down (or replaced): nothing to answer for
            try:
                if store is None:
                    store = _connect(STORE_TIMEOUT_S)
                store.set(self.key(self.rank), self._record())
            except Exception:  # noqa: BLE001 - never let the heartbeat crash training; retry next beat
                store = None
            self._stop.wait(self.interval_s)
        del store  # the connection closes here, in this thread, before stop() returns

    def _side_store(self) -> Any:
        if self._unreachable:  # once is enough: every further try would wait its timeout again
            raise StoreUnreachable("rendezvous store did not answer before")
        if self._side is None:
            try:
                self._side = _connect(STORE_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure to reach it means the same
                self._unreachable = True
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise StoreUnreachable(f"rendezvous store did not answer ({type(exc).__name__}: {first})") from exc
        return self._side

    def set_state(self, state: State, why: str = "", *, stop: bool = False) -> None:
        """Record ``state`` now (best effort, at most :data:`STORE_TIMEOUT_S`): last words before
        the process exits. ``stop``: also stop beating (the record keeps ``state``)."""
        self.state, self.why = state, why
        if stop:
            self._stop.set()
        try:
            self._side_store().set(self.key(self.rank), self._record())
        except Exception:  # noqa: BLE001 - the peers then see a stale beat instead
            pass

    def read(self, ranks: Sequence[int]) -> dict[int, Beat]:
        """The last beats of ``ranks`` that have written one. Raises :class:`StoreUnreachable`."""
        store = self._side_store()
        out = {}
        for r in ranks:
            key = self.key(r)
            try:
                if not store.check([key]):
                    continue
                raw = store.get(key)
            except Exception as exc:  # noqa: BLE001 - a timeout or a closed connection
                self._side, self._unreachable = None, True
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise StoreUnreachable(f"rendezvous store did not answer ({type(exc).__name__}: {first})") from exc
            try:
                rec = json.loads(raw)
                out[r] = Beat(rank=r, time_unix=float(rec["t"]), host=str(rec.get("host", "?")),
                              pid=int(rec.get("pid", 0)), state=rec.get("state", "alive"), why=str(rec.get("why", "")))
            except (ValueError, KeyError, TypeError):
                continue  # a record this module did not write: no evidence either way
        return out

    def stop(self, state: State = "done") -> None:
        """Stop beating, leaving ``state`` as the last record, and wait (at most one store
        timeout) until the beating thread has ended and closed its connection: a process that
        exits while that thread is inside a store call aborts ("terminate called without an
        active exception")."""
        if self.state == "alive":  # keep "exiting"/"failed" if set: they say more
            self.set_state(state, stop=True)
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(STORE_TIMEOUT_S + self.interval_s)
        self._side = None  # the main thread's connection closes too


_CURRENT: Heartbeat | None = None
_AT_EXIT: list[bool] = []  # whether stop() is registered to run at exit


def start(rank: int, job: str, *, interval_s: float = INTERVAL_S) -> Heartbeat:
    """Start (once per process group) this process's heartbeat as global ``rank`` of ``job``
    (any string every rank of the job agrees on); returns it. Call after
    ``torch.distributed`` is initialised."""
    global _CURRENT
    hb = _CURRENT
    if hb is not None and hb.alive() and hb.job == job and hb.rank == rank and hb._group is dist.group.WORLD:
        return hb
    if hb is not None:
        hb._stop.set()
    _CURRENT = Heartbeat(rank, job, interval_s=interval_s).start()
    if not _AT_EXIT:  # a script that never stops it still ends the thread before the interpreter does
        atexit.register(stop)
        _AT_EXIT.append(True)
    return _CURRENT


def current() -> Heartbeat | None:
    """This process's running heartbeat, if any."""
    hb = _CURRENT
    return hb if hb is not None and hb._group is dist.group.WORLD and dist.is_initialized() else None


def stop(state: State = "done") -> None:
    """Stop this process's heartbeat (call before tearing the process group down)."""
    global _CURRENT
    if _CURRENT is not None:
        _CURRENT.stop(state)
        _CURRENT = None


@dataclass(frozen=True, kw_only=True)
class Silent:
    """A rank that stopped answering: its last beat is ``age_s`` seconds old."""

    rank: int
    age_s: float
    host: str
    pid: int

    def text(self) -> str:
        """``peer rank 2 stopped answering: no heartbeat for 14.2 s (node3, pid 1234)``."""
        return f"peer rank {self.rank} stopped answering: no heartbeat for {self.age_s:.1f} s ({self.host}, pid {self.pid})"


def silent_ranks(beats: dict[int, Beat], *, me: int, stale_after_s: float = STALE_AFTER_S,
                 now_unix: float | None = None) -> list[Silent]:
    """Ranks of ``beats`` (but ``me``) whose beat is older than ``stale_after_s`` seconds and
    which did not leave on purpose (``exiting``/``done``) or say why they failed (``failed``)."""
    now = time.time() if now_unix is None else now_unix
    return [Silent(rank=r, age_s=b.age_s(now), host=b.host, pid=b.pid) for r, b in sorted(beats.items())
            if r != me and b.state == "alive" and b.age_s(now) > stale_after_s]

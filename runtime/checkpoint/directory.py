"""Checkpoint directories that survive a crash, with the train state a resumed run needs.

A *root* holds one directory per saved step; only directories with a completion marker count::

    <root>/step_00000012/           a complete checkpoint
        .metadata, __0_0.distcp ... the parameters and optimizer state (runtime.checkpoint.io, DCP)
        train_state/shared.pt       step, lr scheduler, fp16 loss scaler, the caller's ``extra`` (rank 0)
        train_state/rank_00000.pt   RNG states of mesh rank 0 (torch CPU, CUDA, python, numpy), ...
        COMPLETE                    JSON (:class:`CheckpointInfo`), written last
    <root>/.tmp-step_00000013-<nonce>/   a save in progress, or one that was killed

**A save** (:func:`save`, collective over the mesh) writes everything into a temporary sibling
directory: every rank its DCP part and its RNG file; a gather over the mesh's group (with the
mesh's timeout) confirms that every rank wrote its part; then rank 0 writes the marker, fsyncs
it, renames the directory into place (``os.replace``, atomic on a POSIX filesystem) and fsyncs
the root. Only then are checkpoints beyond the last ``keep`` removed (renamed aside first, so a
half-deleted one is never found), and leftover ``.tmp-*`` directories of killed saves are removed
by the next save. So a kill at any moment leaves every earlier complete checkpoint loadable, and
:func:`latest_checkpoint` never returns a partial one. Re-saving a step that already exists moves
the old directory aside (``.replaced-*``) just before the rename; a kill between those two renames
leaves the old one there, and the next save puts it back.

**A load** (:func:`load`) accepts a root (its latest complete checkpoint) or one checkpoint
directory; a directory without the marker is refused with :class:`CheckpointError`.

**RNG under another world size.** Each mesh rank saves its own generator states; on load, mesh
rank ``r`` takes the states saved by rank ``r % saved_world_size``, and CUDA states are restored
for the devices both runs have. So a resumed run of the same size continues every random stream
exactly; one of another size gets valid but different streams (dropout masks differ from an
uninterrupted run; dropout-free runs are exact either way).

The root must be on a filesystem every rank sees (DCP requires that too), and one job saves into
a root at a time.

**Nothing in a checkpoint runs code on load.** The train-state files hold only tensors, numbers,
strings and builtin containers (RNG states as tensors and ints) and are read with
``torch.load(weights_only=True)``; ``extra`` and an lr scheduler's state must be of those types
(a save refuses others). DCP's ``.metadata`` is read by a restricted unpickler
(:mod:`runtime.checkpoint.metadata`). A missing, truncated or altered file is a
:class:`CheckpointError` naming it.

**Fault injection** (tests): ``PARTITIONER_CHECKPOINT_FAULT="rank=1,point=written"`` SIGKILLs
global rank 1 at ``point``: ``written`` (its DCP part and RNG file written, before the gather),
``marked`` (rank 0: marker written, before the rename), ``renamed`` (rank 0: before rotation).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from passes.ir.errors import CheckpointError, ConfigError
from runtime.dist import comm
from runtime.checkpoint.io import load_checkpoint, save_checkpoint

MARKER = "COMPLETE"
FORMAT = 2
"""Layout version: 2 stores the train state in ``torch.load(weights_only=True)``'s types (1: pickles)."""
STATE_DIR = "train_state"
SHARED_FILE = "shared.pt"
TMP_PREFIX = ".tmp-"
REPLACED_PREFIX = ".replaced-"
FAULT_ENV = "PARTITIONER_CHECKPOINT_FAULT"
COUNTERS = ("step_count", "skipped_steps")
"""The model's step counters saved with the train state (optimizer steps taken, steps skipped)."""
_STEP_DIR = re.compile(r"^step_(\d{8,})$")

FaultPoint = Literal["written", "marked", "renamed"]
FAULT_POINTS: tuple[str, ...] = ("written", "marked", "renamed")


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """The completion marker's content: ``step``; ``world_size`` (ranks of the mesh that saved);
    ``dp``/``pp``/``tp`` of its mesh; ``plan`` (a one-line plan summary, may be empty);
    ``created_unix`` (seconds since the epoch); ``format`` (this module's layout version)."""

    step: int
    world_size: int
    dp: int
    pp: int
    tp: int
    plan: str = ""
    created_unix: float = 0.0
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)


@dataclass(frozen=True)
class TrainState:
    """What :func:`load` restored besides the weights: the ``step`` to continue from, the caller's
    ``extra`` dict saved with it (e.g. a data sampler's position), and the checkpoint's ``path``."""

    step: int
    extra: dict = field(default_factory=dict)
    path: Path = Path()


# ----------------------------------------------------------------------------------------------
# Finding checkpoints (no process group needed)
# ----------------------------------------------------------------------------------------------
def step_dir_name(step: int) -> str:
    """The directory name of ``step``'s checkpoint (``step_00000012``)."""
    return f"step_{int(step):08d}"


def is_complete(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a checkpoint directory whose save finished (it has the marker)."""
    return (Path(path) / MARKER).is_file()


def read_info(path: str | os.PathLike) -> CheckpointInfo:
    """The marker of the checkpoint at ``path``; :class:`CheckpointError` if it has none."""
    path = Path(path)
    try:
        raw = json.loads((path / MARKER).read_text())
    except FileNotFoundError:
        raise CheckpointError(_incomplete_message(path)) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable {MARKER} marker ({exc}); load an older "
                              f"checkpoint of its root") from exc
    known = {f.name for f in dataclasses.fields(CheckpointInfo)}
    return CheckpointInfo(**{k: v for k, v in raw.items() if k in known})


def complete_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The complete checkpoints under ``root``, oldest step first (``[]`` if none or no root)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or ``None``. Directories without the marker
    (killed saves, ``.tmp-*``) are never returned."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint directory ``path`` names: ``path`` itself if it is a complete checkpoint,
    else, if it is a root, its latest complete checkpoint. :class:`CheckpointError` otherwise
    (missing, incomplete, or a root with no complete checkpoint)."""
    path = Path(path)
    if is_complete(path):
        return path
    if not path.is_dir():
        raise CheckpointError(f"checkpoint: no directory {path}; pass a checkpoint root (what "
                              f"AutoParallel.save was given) or one of its step_* directories")
    if _STEP_DIR.match(path.name) or path.name.startswith(TMP_PREFIX) or (path / ".metadata").exists():
        raise CheckpointError(_incomplete_message(path))
    latest = latest_checkpoint(path)
    if latest is None:
        partial = sorted(p.name for p in path.iterdir() if _STEP_DIR.match(p.name) or p.name.startswith(TMP_PREFIX))
        raise CheckpointError(f"checkpoint root {path} holds no complete checkpoint"
                              + (f" (only incomplete ones: {partial[:5]})" if partial else "")
                              + "; save one first, or pass the directory of an older root")
    return latest


def _incomplete_message(path: Path) -> str:
    msg = (f"checkpoint {path} is incomplete: it has no {MARKER} marker, so its save did not finish "
           f"(killed or failed) and its files may be partial; load the root instead (its latest complete "
           f"checkpoint, runtime.checkpoint.directory.latest_checkpoint) or an older step_* directory")
    if (path / ".metadata").exists() and not path.name.startswith(TMP_PREFIX):
        msg += (". If it was written by runtime.checkpoint.io.save_checkpoint directly (no marker, no train "
                "state), load it with runtime.checkpoint.io.load_checkpoint")
    return msg


# ----------------------------------------------------------------------------------------------
# Saving
# ----------------------------------------------------------------------------------------------
def save(pm, root: str | os.PathLike, *, step: int, keep: int | None = None, extra: Mapping | None = None,
         plan: str = "") -> Path:
    """Save ``pm`` (a :class:`runtime.exec.parallel_model.ParallelModel`) at ``step`` atomically into
    ``root/step_<step>`` (see the module docstring); returns that path on every rank.

    Every rank of ``pm.mesh`` calls it. Saved with the weights and optimizer state: every rank's
    RNG states; once (mesh rank 0): ``step``, ``pm.lr_scheduler``'s state, ``pm.loss_scaler``'s
    fields, ``pm``'s :data:`COUNTERS`, and ``extra`` (picklable; rank 0's is kept). ``keep``: how
    many complete checkpoints to keep, this one included (``None``: all); checkpoints are ordered
    by step, and this one is never removed (a save of a step below the newest keeps the newest
    ones, which stay "latest").
    ``plan``: a one-line plan summary for the marker.
    """
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ConfigError(f"checkpoint: keep must be an int >= 1 or None (keep all), got {keep!r}")
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"checkpoint: extra must be a dict (e.g. the data sampler's position), got "
                          f"{type(extra).__name__}")
    bad = _not_plain(dict(extra or {}), "extra")
    if bad is not None:
        raise ConfigError(f"checkpoint: {bad}; a checkpoint's train state holds only tensors, numbers, strings, "
                          f"None and lists/tuples/dicts of them (it is loaded without running code): convert it")
    mesh = pm.mesh
    local_rank = mesh.rank - mesh.first
    rng = _rng_state()  # first: nothing below may move a generator before it is recorded
    root = Path(root)
    name = step_dir_name(step)

    tmp = Path(_on_first(mesh, lambda: str(_begin(root, name))))
    errors = None
    save_checkpoint(pm, tmp, step=step)  # collective; raises on every rank if any fails
    try:
        state_dir = tmp / STATE_DIR
        state_dir.mkdir(exist_ok=True)
        _write_state(state_dir / _rank_file(local_rank), rng)
        if local_rank == 0:
            _write_state(state_dir / SHARED_FILE, _shared_state(pm, step, extra))
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        errors = f"rank {mesh.rank}: {type(exc).__name__}: {exc}"
    _fault_point("written")
    # The barrier: every rank's part is on disk (or some rank says why not) before the marker.
    failed = [e for e in comm.all_gather_object(errors, mesh.group) if e is not None]
    if failed:
        raise CheckpointError(f"checkpoint {tmp}: writing the train state failed on {failed}; the previous "
                              f"checkpoints under {root} are intact")
    info = CheckpointInfo(step=int(step), world_size=mesh.size, dp=mesh.dp, pp=mesh.pp, tp=mesh.tp,
                          plan=plan, created_unix=time.time())
    return Path(_on_first(mesh, lambda: str(_commit(tmp, root / name, info, keep))))


def _begin(root: Path, name: str) -> Path:
    """Rank 0, before any rank writes: clear leftovers of killed saves, make the temporary directory."""
    root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(root)
    tmp = root / f"{TMP_PREFIX}{name}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def clean_leftovers(root: str | os.PathLike) -> None:
    """Remove the ``.tmp-*`` directories of killed saves and deletions under ``root``, and put
    back a checkpoint a killed re-save had moved aside (``.replaced-*``) if nothing replaced it.
    Call it only while no save into ``root`` runs."""
    root = Path(root)
    for child in sorted(root.iterdir()):
        if child.name.startswith(REPLACED_PREFIX):
            target = root / child.name[len(REPLACED_PREFIX):].rsplit("-", 1)[0]
            if not target.exists() and is_complete(child):
                os.replace(child, target)
                _fsync_dir(root)
            else:
                shutil.rmtree(child, ignore_errors=True)
        elif child.name.startswith(TMP_PREFIX):
            shutil.rmtree(child, ignore_errors=True)


def _commit(tmp: Path, final: Path, info: CheckpointInfo, keep: int | None) -> Path:
    """Rank 0, once every rank's part is written: marker, rename into place, rotation."""
    marker = tmp / MARKER
    with open(marker, "w") as f:
        f.write(info.to_json())
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    _fault_point("marked")
    root = final.parent
    aside = None
    if final.exists():  # a re-save of the same step: os.replace cannot overwrite a non-empty directory
        aside = root / f"{REPLACED_PREFIX}{final.name}-{uuid.uuid4().hex[:12]}"
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_dir(root)
    _fault_point("renamed")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    if keep is not None:
        for old in complete_checkpoints(root)[:-keep]:
            if old == final:
                continue
            # Aside first (atomic), then delete: a kill mid-delete leaves a .tmp-* for the next save.
            doomed = root / f"{TMP_PREFIX}deleting-{old.name}-{uuid.uuid4().hex[:12]}"
            os.replace(old, doomed)
            _fsync_dir(root)
            shutil.rmtree(doomed, ignore_errors=True)
    return final


def _on_first(mesh, make) -> Any:
    """Mesh rank 0 runs ``make``; every rank gets its result, or raises its error as CheckpointError
    (so a failure there does not leave the others waiting)."""
    box: Any = None
    if mesh.rank == mesh.first:
        try:
            box = ("ok", make())
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            box = ("error", type(exc).__name__, str(exc))
    box = comm.broadcast_object(box, src=mesh.first, group=mesh.group)
    if box[0] == "error":
        _, kind, message = box
        if kind == CheckpointError.__name__:
            raise CheckpointError(message)
        raise CheckpointError(f"checkpoint: rank {mesh.first} failed with {kind}: {message}")
    return box[1]


def _fault_point(point: FaultPoint) -> None:
    """Test-only fault injection (``PARTITIONER_CHECKPOINT_FAULT``, see the module docstring)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    try:
        fields = dict(kv.split("=", 1) for kv in spec.split(","))
        rank, where = int(fields["rank"]), fields["point"]
    except (ValueError, KeyError):
        raise ConfigError(f"{FAULT_ENV}={spec!r}: expected 'rank=<int>,point=<{'|'.join(FAULT_POINTS)}>'") from None
    if where not in FAULT_POINTS:
        raise ConfigError(f"{FAULT_ENV}: unknown point {where!r}; use one of {FAULT_POINTS}")
    if where == point and dist.is_initialized() and dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def _not_plain(obj: Any, where: str) -> str | None:
    """``None`` if ``obj`` is made only of what ``torch.load(weights_only=True)`` reads back
    (tensors, numbers, strings, None, lists, tuples, dicts); else which part is not."""
    if isinstance(obj, _PLAIN):
        return None
    if isinstance(obj, (list, tuple)):
        return next((bad for i, v in enumerate(obj) if (bad := _not_plain(v, f"{where}[{i}]")) is not None), None)
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                return f"{where} has a key of type {type(k).__name__}"
            bad = _not_plain(v, f"{where}[{k!r}]")
            if bad is not None:
                return bad
        return None
    return f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}"


def _write_state(path: Path, obj: Any) -> None:
    """Write a train-state file (only :func:`_not_plain`-free content: it is read back with
    ``torch.load(weights_only=True)``)."""
    bad = _not_plain(obj, path.name)
    if bad is not None:
        raise ConfigError(f"checkpoint: {bad}; the train state holds only tensors, numbers, strings, None and "
                          f"lists/tuples/dicts of them")
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rank_file(local_rank: int) -> str:
    return f"rank_{local_rank:05d}.pt"


# ----------------------------------------------------------------------------------------------
# Train state
# ----------------------------------------------------------------------------------------------
def _rng_state() -> dict[str, Any]:
    """This process's generator states: torch CPU, every CUDA device (when available), python
    ``random``, numpy's global generator (when installed); as tensors, ints and floats."""
    version, key, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(),
                             "python": {"version": version, "key": list(key), "gauss": gauss}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        kind, words, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": str(kind), "key": torch.from_numpy(words.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["key"]), py["gauss"]))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        s = state["numpy"]
        np.random.set_state((s["kind"], s["key"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))


def _shared_state(pm, step: int, extra: Mapping | None) -> dict[str, Any]:
    scheduler = pm.lr_scheduler
    scaler = pm.loss_scaler
    return {"step": int(step), "extra": dict(extra or {}),
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
            "loss_scaler": dataclasses.asdict(scaler) if scaler is not None else None,
            "counters": {k: int(getattr(pm, k)) for k in COUNTERS}}


def _restore_shared(pm, shared: Mapping[str, Any], path: Path) -> None:
    scheduler = pm.lr_scheduler
    saved = shared.get("lr_scheduler")
    if scheduler is not None and saved is not None:
        scheduler.load_state_dict(saved)
        # A scheduler's state does not hold its optimizer's lr (nor does the optimizer checkpoint):
        # the next step must run at the lr the saved run would have used, not the initial one.
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr
    elif scheduler is not None or saved is not None:
        warnings.warn(f"checkpoint {path}: " + ("it has no lr scheduler state; the scheduler starts where it is"
                                                if saved is None else "it has lr scheduler state but the model has "
                                                "no lr_scheduler; the state is ignored"), stacklevel=3)
    for name, value in (shared.get("counters") or {}).items():
        if hasattr(pm, name):
            setattr(pm, name, value)
    scaler = pm.loss_scaler
    # Another dtype than the saving run's: an fp16 run from a bf16 checkpoint keeps its initial
    # scale, a bf16 run ignores a saved scale.
    if scaler is not None and shared.get("loss_scaler") is not None:
        for name, value in shared["loss_scaler"].items():
            if hasattr(scaler, name):
                setattr(scaler, name, value)


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------
def load(pm, path: str | os.PathLike, *, optimizer: bool = True) -> TrainState:
    """Load into ``pm`` the checkpoint ``path`` names (a root: its latest complete checkpoint; or
    one checkpoint directory), saved under any plan: weights, optimizer state (with
    ``optimizer``), lr scheduler, loss scaler and this rank's RNG states (module docstring:
    another world size). Every rank of ``pm.mesh`` calls it; all load the same directory (chosen
    by rank 0). Raises :class:`CheckpointError` on every rank for a directory without the marker.
    """
    mesh = pm.mesh
    chosen = Path(_on_first(mesh, lambda: str(resolve(path))))
    info = read_info(chosen)
    dcp_step = load_checkpoint(pm, chosen, optimizer=optimizer)
    if dcp_step != info.step:
        raise CheckpointError(f"checkpoint {chosen}: its marker says step {info.step} but its tensors step "
                              f"{dcp_step}; the directory was altered after its save")
    state_dir = chosen / STATE_DIR
    shared = _read_state(state_dir / SHARED_FILE, info)
    _restore_shared(pm, shared, chosen)
    rng_file = state_dir / _rank_file((mesh.rank - mesh.first) % info.world_size)
    try:
        _set_rng_state(_read_state(rng_file, info))
    except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint {chosen}: {rng_file.relative_to(chosen)} does not hold RNG states "
                              f"({type(exc).__name__}: {exc}); the file was altered: load an older checkpoint") from None
    return TrainState(step=info.step, extra=dict(shared.get("extra") or {}), path=chosen)


def _read_state(path: Path, info: CheckpointInfo) -> dict:
    """A train-state file, read with ``torch.load(weights_only=True)`` (tensors, numbers, strings,
    builtin containers: nothing in it can run code)."""
    where = f"checkpoint {path.parent.parent}: {path.relative_to(path.parent.parent)}"
    try:
        with open(path, "rb") as f:
            state = torch.load(f, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing although the save completed; the directory was altered, load "
                              f"an older checkpoint") from None
    except Exception as exc:  # noqa: BLE001 - truncated, damaged, or holding more than data
        lines = str(exc).strip().splitlines() or [""]
        # torch's refusal starts with advice on weights_only; the line naming the global is the cause
        first = next((ln.strip() for ln in lines if "GLOBAL" in ln or "Unsupported global" in ln), lines[0])[:200]
        if info.format < 2:
            raise CheckpointError(f"{where}: written in train-state format {info.format} (plain pickles, which are "
                                  f"not loaded: they could run code); load its weights and optimizer state with "
                                  f"runtime.checkpoint.io.load_checkpoint, or re-save it") from None
        raise CheckpointError(f"{where} is truncated, damaged or holds more than tensors and numbers "
                              f"({type(exc).__name__}: {first}); load an older checkpoint") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} holds a {type(state).__name__}, not a train state; the file was altered: "
                              f"load an older checkpoint")
    return state

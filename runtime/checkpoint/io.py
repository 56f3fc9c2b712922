"""Checkpoints that move between plans: save under one (dp, tp, pp), load under another.

Built on ``torch.distributed.checkpoint`` (DCP). The checkpoint is one DCP directory whose
entries are keyed by the ORIGINAL model's names, whatever plan wrote it::

    <param name>                          e.g. "blocks.0.attn.qkv.weight"   full shape
    optim.state.<param name>.<key>        the optimizer's per-parameter state, torch's keys
                                          (runtime.optim.optimizers.state_keys): AdamW's exp_avg,
                                          exp_avg_sq (full shape) and step (0-d float32);
                                          SGD's momentum_buffer; ...
    train.step                            the caller's step                 0-d int64

**Tied weights** (``wte.weight`` / ``lm_head.weight``) are saved once, under the name
``module.named_parameters()`` lists them by (it lists a shared parameter once, under its first
name: ``wte.weight`` for the zoo GPT). Loaders accept any alias present in the checkpoint.

**Who writes what.** Each rank describes its local tensors as *pieces*: rectangular boxes of the
full tensor (offsets into it) backed by views of local storage, and writes only the pieces it
owns, so the chunks of every entry tile the full tensor exactly once (DCP checks this when it
builds the global plan, and fails the save otherwise):

* pipeline ranks hold disjoint layers; a tied weight is written by the lowest stage holding it;
* data-parallel replicas are copies: dp index 0 writes parameters (and unsharded optimizer state);
  with expert parallelism each rank of the first ep group writes the experts it holds (under the
  model's names, so a checkpoint loads at another ep or into the plain module; a stacked
  ``[experts, ...]`` weight is written as each rank's box of rows);
  under ZeRO-1/2 each dp rank writes the slices of optimizer state its chunk of every gradient
  bucket holds, each a contiguous run of a parameter's row-major elements cut into at most
  ``2 * ndim - 1`` boxes;
* tensor-parallel shards (:class:`ParamLayout`): a parameter split along ``dim`` into equal
  pieces of each *section* (fused q/k/v: three sections) is, on tp rank ``r``, the concatenation
  of section pieces; each section piece is its own box at its global offset. Replicated
  parameters are written by tp index 0.

Loading is the mirror image: every rank asks DCP for the boxes its local tensors cover (all
local copies of a tied weight, every dp replica), and DCP's resharding reads the overlapping
parts of whatever chunks were saved, so a checkpoint written under (dp, tp, pp) = (1, 1, 2)
loads under (2, 1, 2), (1, 1, 4), or into the plain single-device module
(:func:`load_into_module`, ``no_dist=True``).

The mechanism is a pair of small DCP planners over explicit chunks (``ChunkStorageMetadata``
offsets) rather than DTensor: a tp shard of a fused q/k/v weight is not one ``Shard(dim)`` slice
of the full tensor, and explicit boxes need no DeviceMesh, so they run unchanged on gloo CPU.

Not saved: optimizer hyperparameters (lr, betas, eps, weight decay: the caller constructs the
optimizer) and RNG state (exactness across plans assumes dropout 0).

**Loading is for untrusted input too**: the ``.metadata`` pickle is read by a restricted
unpickler (:mod:`runtime.checkpoint.metadata`) and the data files by ``torch.load(weights_only=True)``,
so a checkpoint cannot run code; every failure of a load (a missing or truncated file, another
model's or another optimizer's checkpoint) is a :class:`CheckpointError` naming the file or key,
the cause and what to do.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties, TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from passes.ir.config import is_mixed
from passes.ir.errors import CheckpointError, ConfigError
from passes.ir.meta import TENSOR_PARALLEL_PLAN, ParamSharding, TensorParallelPlan
from passes.ir.meta import ZERO3_PLAN
from passes.ir.zero3_ops import ShardedParam
from runtime.checkpoint.metadata import METADATA_FILE, SafeFileSystemReader, read_metadata_file
from runtime.optim.mixed_precision import MasterWeightOptimizer
from runtime.optim.optimizers import init_state, state_keys

TRAIN_STEP_KEY = "train.step"
OPTIM_PREFIX = "optim.state."


# ----------------------------------------------------------------------------------------------
# Layouts and pieces: which boxes of the full tensor a local tensor holds
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """Where one rank's local tensor of a parameter lies in the full tensor.

    ``shape``: the full (unsharded) shape. ``dim``: the tensor dim it is sharded along (``None``:
    the local tensor is the whole parameter). ``segments``: along ``dim``, ``(local_start,
    global_start, length)`` runs, in local order; together they cover the local tensor's ``dim``.
    """

    shape: tuple[int, ...]
    dim: int | None = None
    segments: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_sharding(cls, shape: Sequence[int], sharding: ParamSharding | None, rank: int,
                      degree: int) -> "ParamLayout":
        """The layout of tp rank ``rank`` of ``degree`` under ``sharding`` (the convention of
        ``passes.rewrites.apply_tensor_parallel.shard_tensor``: each section split evenly, the rank's
        pieces concatenated in section order)."""
        shape = tuple(int(s) for s in shape)
        if sharding is None or sharding.dim is None or degree == 1:
            return cls(shape=shape)
        dim = sharding.dim
        sections = sharding.sections or (shape[dim],)
        if sum(sections) != shape[dim] or any(s % degree for s in sections):
            raise ConfigError(f"checkpoint_io: sections {sections} of a dim of size {shape[dim]} cannot be "
                              f"split evenly over tp={degree}; fix the tensor-parallel plan")
        segments, local, start = [], 0, 0
        for size in sections:
            chunk = size // degree
            segments.append((local, start + rank * chunk, chunk))
            local += chunk
            start += size
        return cls(shape=shape, dim=dim, segments=tuple(segments))

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] = sum(length for _, _, length in self.segments)
        return tuple(shape)

    def boxes(self, offsets: Sequence[int], sizes: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...],
                                                                              tuple[int, ...]]]:
        """The local box ``offsets``/``sizes`` as ``(local_offsets, sizes, global_offsets)`` boxes,
        cut where it crosses from one segment to the next."""
        offsets, sizes = tuple(offsets), tuple(sizes)
        if self.dim is None:
            return [(offsets, sizes, offsets)]
        d, out = self.dim, []
        lo, hi = offsets[d], offsets[d] + sizes[d]
        for local_start, global_start, length in self.segments:
            a, b = max(lo, local_start), min(hi, local_start + length)
            if a >= b:
                continue
            loc = offsets[:d] + (a,) + offsets[d + 1:]
            glob = offsets[:d] + (global_start + a - local_start,) + offsets[d + 1:]
            out.append((loc, sizes[:d] + (b - a,) + sizes[d + 1:], glob))
        return out


@dataclass(frozen=True)
class Piece:
    """A box of a full tensor held locally: ``offsets`` into the full tensor, ``tensor`` a view
    of local storage (writes through it land in the local tensor)."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass
class Entry:
    """One checkpoint entry seen from this rank: the full ``shape`` and the local pieces of it."""

    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


def pieces_of(local: torch.Tensor, layout: ParamLayout, offsets: Sequence[int] | None = None,
              sizes: Sequence[int] | None = None) -> list[Piece]:
    """Pieces of the full tensor covered by ``local`` (or by its box ``offsets``/``sizes``)."""
    if tuple(local.shape) != layout.local_shape:
        raise ConfigError(f"checkpoint_io: local tensor of shape {tuple(local.shape)} does not match its layout "
                          f"(local shape {layout.local_shape} of {layout.shape}); the layout is stale")
    offsets = tuple(offsets) if offsets is not None else (0,) * local.dim()
    sizes = tuple(sizes) if sizes is not None else tuple(local.shape)
    out = []
    for loc, size, glob in layout.boxes(offsets, sizes):
        view = local
        for d, (o, s) in enumerate(zip(loc, size)):
            view = view.narrow(d, o, s)
        out.append(Piece(glob, view))
    return out


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The row-major elements ``[start, stop)`` of a tensor of ``shape`` as rectangular boxes
    ``(offsets, sizes, flat_start)``: a partial run of the last dim, whole rows, ... (at most
    ``2 * ndim - 1`` boxes), each a contiguous run of the flat elements."""
    shape = tuple(shape)
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = 1
    for s in shape[1:]:
        inner *= s
    out = []
    first, last = start // inner, (stop - 1) // inner
    if first == last or start % inner:
        # A partial first "row" (a box of the lower dims) at index ``first``.
        end = min(stop, (first + 1) * inner)
        for offs, sizes, flat in flat_range_boxes(shape[1:], start - first * inner, end - first * inner):
            out.append(((first,) + offs, (1,) + sizes, first * inner + flat))
        start = end
    if start < stop:
        full_rows = (stop - start) // inner
        if full_rows:
            row = start // inner
            out.append(((row,) + (0,) * (len(shape) - 1), (full_rows,) + shape[1:], start))
            start += full_rows * inner
    if start < stop:
        row = start // inner
        for offs, sizes, flat in flat_range_boxes(shape[1:], 0, stop - start):
            out.append(((row,) + offs, (1,) + sizes, row * inner + flat))
    return out


# ----------------------------------------------------------------------------------------------
# DCP planners over explicit pieces
# ----------------------------------------------------------------------------------------------
class _PieceSavePlanner(DefaultSavePlanner):
    """Writes every piece of every :class:`Entry` as one chunk at its offsets."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, entry in self.state_dict.items():
            for piece in entry.pieces:
                t = piece.tensor
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(piece.offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=torch.Size(t.shape)),
                        properties=TensorProperties.create_from_tensor(t), size=torch.Size(entry.shape))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        # The global plan rewrites index hints, so find the piece by its offsets (unique per rank:
        # a rank writes each box once).
        for piece in self.state_dict[index.fqn].pieces:
            if torch.Size(piece.offsets) == index.offset:
                # A contiguous copy: torch.save of a view would write its whole storage.
                return piece.tensor.detach().contiguous().clone()
        raise ValueError(f"checkpoint_io: no local piece of {index.fqn} at {tuple(index.offset)}")


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Reads into every piece of every :class:`Entry` (pieces may repeat a box: tied copies)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        items = []
        for fqn, entry in self.state_dict.items():
            md = saved[fqn]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.tensor.shape))
                      for p in entry.pieces]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        # dest_index.index is the piece's position in the chunk list given above.
        return self.state_dict[index.fqn].pieces[index.index].tensor

    def resolve_tensor(self, read_item):
        return self.transform_tensor(read_item, self.lookup_tensor(read_item.dest_index))


def save_entries(entries: Mapping[str, Entry], directory: str | os.PathLike, *, process_group=None,
                 no_dist: bool = False) -> None:
    """Write ``entries`` (key -> :class:`Entry`) as a DCP checkpoint: each piece one chunk. Collective
    over ``process_group`` unless ``no_dist``; the pieces of all ranks must tile every entry once."""
    with _quiet(no_dist):
        dcp.save(dict(entries), checkpoint_id=os.fspath(directory), planner=_PieceSavePlanner(),
                 process_group=process_group, no_dist=no_dist)


@torch.no_grad()
def load_entries(entries: Mapping[str, Entry], directory: str | os.PathLike, *, process_group=None,
                 no_dist: bool = False) -> None:
    """Fill every piece of ``entries`` from a DCP checkpoint, whatever chunks it was saved in.
    Raises :class:`CheckpointError` (before any collective) if a key is missing or has another
    shape, and for any failure of the read (naming the file)."""
    _check_against(entries, _read_metadata(directory), directory)
    with _quiet(no_dist, loading=directory):
        dcp.load(dict(entries), checkpoint_id=os.fspath(directory), planner=_PieceLoadPlanner(),
                 storage_reader=SafeFileSystemReader(os.fspath(directory)), process_group=process_group,
                 no_dist=no_dist)


@contextlib.contextmanager
def _quiet(no_dist: bool, *, loading: str | os.PathLike | None = None):
    """DCP with readable errors: its CheckpointException is a BaseException (``except Exception``
    misses it) whose message names only the ranks; re-raise the first rank's error as ours
    (a save's as :class:`ConfigError`; ``loading`` a directory: as :class:`CheckpointError`)."""
    # DCP warns that it "assumes a single process" whenever no process group exists: that is
    # exactly what no_dist asks for.
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as exc:
            rank, failure = next(iter(sorted(exc.failures.items())), (None, exc))
            cause = failure[0] if isinstance(failure, tuple) else failure  # (exception, stack)
            if loading is None:
                raise ConfigError(f"checkpoint_io: torch.distributed.checkpoint failed on rank(s) "
                                  f"{sorted(exc.failures)}; rank {rank}: {type(cause).__name__}: {cause}") from cause
            if isinstance(cause, CheckpointError):  # ours, from the reader: it names the file already
                raise CheckpointError(str(cause)) from cause
            raise _load_failure(loading, cause) from cause
        except (CheckpointError, ConfigError):
            raise
        except Exception as exc:  # noqa: BLE001 - a load must fail as ours, whatever DCP raised
            if loading is None:
                raise
            raise _load_failure(loading, exc) from exc


def _load_failure(directory: str | os.PathLike, cause: BaseException) -> CheckpointError:
    if isinstance(cause, FileNotFoundError):
        return CheckpointError(f"checkpoint {os.fspath(directory)}: {Path(cause.filename or '?').name} is missing "
                               f"({cause.strerror}); the directory is incomplete: copy it whole, or load an older "
                               f"checkpoint")
    first = (str(cause).strip().splitlines() or [""])[0][:300]
    return CheckpointError(f"checkpoint {os.fspath(directory)}: reading its data failed ({type(cause).__name__}: "
                           f"{first}); a data file is damaged or does not match its {METADATA_FILE}: load an older "
                           f"checkpoint")


def _read_metadata(directory: str | os.PathLike) -> Metadata:
    """The checkpoint's metadata, read without running code (:mod:`runtime.checkpoint.metadata`)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {os.fspath(directory)}: no such directory; pass the directory a save "
                              f"wrote (runtime.checkpoint.io.save_checkpoint / save_module)")
    return read_metadata_file(Path(directory) / METADATA_FILE)


def _state_names(keys) -> list[str]:
    """The optimizer state names (``exp_avg``, ``momentum_buffer``, ...) among checkpoint keys."""
    return sorted({k.rsplit(".", 1)[1] for k in keys if k.startswith(OPTIM_PREFIX)})


def _check_against(entries: Mapping[str, Entry], metadata: Metadata, directory: str | os.PathLike) -> None:
    # Checked here, not in the planner: DCP wraps planner errors into a CheckpointException.
    saved = metadata.state_dict_metadata
    where = f"checkpoint {os.fspath(directory)}"
    missing = [k for k in entries if k not in saved]
    optim_missing = [k for k in missing if k.startswith(OPTIM_PREFIX)]
    if optim_missing and len(optim_missing) == len(missing):
        has, needs = _state_names(saved), _state_names(optim_missing)
        if has:
            raise CheckpointError(f"{where}: its optimizer state holds {has} per parameter but this optimizer needs "
                                  f"{needs} (e.g. {optim_missing[0]}): it was saved by another optimizer; build the "
                                  f"optimizer it was saved with, or load the weights only (optimizer=False)")
        raise CheckpointError(f"{where}: it holds no optimizer state (saved before the first step), this load "
                              f"needs {needs}; load the weights only (optimizer=False)")
    if missing:
        raise CheckpointError(f"{where}: it has no {missing[:5]}{' ...' if len(missing) > 5 else ''}; it was written "
                              f"for another model: load it into the model that saved it (its keys include "
                              f"{sorted(k for k in saved if not k.startswith(OPTIM_PREFIX))[:3]})")
    for fqn, entry in entries.items():
        md = saved[fqn]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(entry.shape):
            raise CheckpointError(f"{where}: {fqn} has shape {tuple(getattr(md, 'size', ()))} in the "
                                  f"checkpoint but {tuple(entry.shape)} here; it was written for another model "
                                  f"(or another optimizer's state): load it into the model that saved it")


def checkpoint_keys(directory: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every entry of a checkpoint and its full shape (no process group needed)."""
    md = _read_metadata(directory)
    return {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _add(entries: dict[str, Entry], key: str, shape: Sequence[int], pieces: Iterable[Piece]) -> None:
    entry = entries.setdefault(key, Entry(tuple(shape)))
    entry.pieces.extend(pieces)


def _whole(t: torch.Tensor) -> list[Piece]:
    return [Piece((0,) * t.dim(), t)]


# ----------------------------------------------------------------------------------------------
# Optimizer state (torch.optim's layouts, runtime.optim.optimizers.state_keys)
# ----------------------------------------------------------------------------------------------
def _has_optimizer_state(directory: str | os.PathLike) -> bool:
    """Whether the checkpoint holds optimizer state (one saved before the first step has none)."""
    return any(k.startswith(OPTIM_PREFIX) for k in checkpoint_keys(directory))


# ----------------------------------------------------------------------------------------------
# ParallelModel
# ----------------------------------------------------------------------------------------------
@dataclass
class _LocalParam:
    """One parameter of the original model as this rank holds it."""

    name: str                      # canonical original name
    copies: list[nn.Parameter]     # every local copy (tied: one per local stage reading it)
    layout: ParamLayout
    writer: bool                   # this rank writes the parameter (and its unsharded state)
    tp_writer: bool                # ... ignoring the dp replica condition (ZeRO state)
    flat_range: tuple[int, int] | None = None  # ZeRO-3: the local tensor's elements [lo, hi) this rank's shard holds
    scalar_writer: bool = True     # writes the parameter's 0-d optimizer state (ZeRO-3: the dp-0 replica)


def _tp_plan(pm) -> TensorParallelPlan | None:
    """The tensor-parallel plan of this rank's stages: ``pm.program.tp_plan`` (or ``pm.tp_plan``),
    else ``TENSOR_PARALLEL_PLAN`` in a stage module's meta (set by ``apply_tensor_parallel``)."""
    plan = pm.program.tp_plan
    if plan is None:
        for stage in pm.stages.values():
            plan = getattr(stage.module, "meta", {}).get(TENSOR_PARALLEL_PLAN)
            if plan is not None:
                break
    tp = getattr(pm.mesh, "tp", 1)
    if tp > 1 and (plan is None or plan.degree != tp):
        raise ConfigError(f"checkpoint_io: mesh has tp={tp} but no TensorParallelPlan of degree {tp} was found on "
                          f"the model (pm.tp_plan or a stage module's meta[{TENSOR_PARALLEL_PLAN!r}]); expose the "
                          f"plan the stages were sharded with")
    return plan if tp > 1 else None


def original_aliases(module: nn.Module) -> dict[str, str]:
    """Every parameter name of ``module`` -> its canonical name: the one ``named_parameters()``
    lists a shared (tied) parameter under (its first name)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _canonical_names(pm) -> dict[str, str]:
    """Alias -> canonical name of every tied parameter: the original module's ties, recorded at
    capture, and the split's tied records (a captured graph may read a tied weight under any one
    of its names); both travel in the rank program."""
    return dict(pm.program.canonical_names)


def _local_params(pm) -> list[_LocalParam]:
    """This rank's parameters by canonical name, with their tp layout and whether it writes them."""
    canon_of = _canonical_names(pm)
    plan = _tp_plan(pm)
    zero3 = _zero3_records(pm)
    tp = getattr(pm.mesh, "tp", 1)
    tp_index = getattr(pm.mesh, "tp_index", 0)
    found: dict[str, _LocalParam] = {}
    experts = {canon_of.get(n, n) for n in getattr(pm.program, "expert_params", ())}
    stacked = {canon_of.get(n, n) for n in getattr(pm.program, "stacked_experts", ())}
    for s in sorted(pm.stages):
        by_id: dict[int, list[str]] = {}
        params: dict[int, nn.Parameter] = {}
        for name, p in pm.stages[s].module.named_parameters(remove_duplicate=False):
            by_id.setdefault(id(p), []).append(name)
            params[id(p)] = p
        for pid, names in by_id.items():
            canon = next((canon_of[n] for n in names if n in canon_of), names[0])
            p = params[pid]
            if canon in found:
                if all(c is not p for c in found[canon].copies):
                    found[canon].copies.append(p)
                continue
            sharding = plan.params.get(canon) if plan is not None else None
            if plan is not None and sharding is None:
                sharding = next((plan.params[n] for n in names if n in plan.params), None)
            record = next((zero3[n] for n in names if n in zero3), None)
            layout_shape = _full_shape(record.shape if record is not None else p.shape, sharding, tp)
            layout = ParamLayout.from_sharding(layout_shape, sharding, tp_index, tp)
            if canon in stacked:  # ep: this rank's rows of a stacked expert weight
                n = p.shape[0]
                layout = ParamLayout(shape=(n * pm.config.ep, *p.shape[1:]), dim=0,
                                     segments=((0, pm.program.ep_index * n, n),))
            # A tied weight is written by the lowest stage holding a copy (one writer per box).
            tied = next((t.stages for k, t in pm.program.tied.items() if canon_of.get(k, k) == canon), ())
            lowest = min(tied, default=s)
            tp_writer = s == lowest and (layout.dim is not None or tp_index == 0)
            if record is not None:  # ZeRO-3: every dp rank of the first shard group writes its shard's elements
                lo = pm.mesh.dp_shard_index * record.shard_numel
                first_group = pm.mesh.dp_index < pm.mesh.dp_shard
                found[canon] = _LocalParam(canon, [p], layout, tp_writer and first_group, tp_writer,
                                           flat_range=(min(lo, record.numel), min(lo + record.shard_numel, record.numel)),
                                           scalar_writer=tp_writer and pm.mesh.dp_index == 0)
                continue
            # ep: the first ep group holds every expert once (one writer per expert, as dp index 0 per replica)
            first = pm.mesh.dp_index < pm.config.ep if canon in experts else pm.mesh.dp_index == 0
            found[canon] = _LocalParam(canon, [p], layout, tp_writer and first, tp_writer)
    return list(found.values())


def _zero3_records(pm) -> dict[str, ShardedParam]:
    """ZeRO-3: how each parameter of this rank's stages is sharded over dp, by name (empty otherwise)."""
    out: dict[str, ShardedParam] = {}
    for st in pm.stages.values():
        plan = getattr(st.module, "meta", {}).get(ZERO3_PLAN)
        if plan is not None:
            out.update({r.name: r for r in plan.params})
    return out


def _full_shape(shape: Sequence[int], sharding: ParamSharding | None, tp: int) -> tuple[int, ...]:
    shape = list(shape)
    if sharding is not None and sharding.dim is not None and tp > 1:
        shape[sharding.dim] *= tp
    return tuple(shape)


def _model_entries(local: Sequence[_LocalParam], *, write: bool,
                   masters: Mapping[int, torch.Tensor] | None = None) -> dict[str, Entry]:
    """Every parameter's entry; ``masters`` (by the parameter's ``id``): the fp32 master weights
    a master-weight optimizer keeps, saved and loaded in the parameters' place."""
    entries: dict[str, Entry] = {}
    for lp in local:
        if write and not lp.writer:
            continue
        for copy in (lp.copies[:1] if write else lp.copies):
            t = masters[id(copy)] if masters is not None else copy.detach()
            _add(entries, lp.name, lp.layout.shape, _local_pieces(t, lp))
    return entries


def _local_pieces(t: torch.Tensor, lp: _LocalParam) -> list[Piece]:
    """The pieces of the full tensor ``t`` holds: its tp layout's, or for a ZeRO-3 shard (flat,
    ``lp.flat_range`` of the tp-local tensor's row-major elements) the boxes of that range."""
    if lp.flat_range is None:
        return pieces_of(t, lp.layout)
    lo, hi = lp.flat_range
    return flat_range_pieces(t, -lo, lp.layout, lo, hi)


def flat_range_pieces(flat: torch.Tensor, offset: int, layout: ParamLayout, start: int, stop: int) -> list[Piece]:
    """The pieces of the full tensor held by the row-major elements ``[start, stop)`` of a local
    tensor of ``layout``, element ``i`` stored at ``flat[offset + i]`` (a ZeRO chunk or shard)."""
    out = []
    for offs, sizes, flat_start in flat_range_boxes(layout.local_shape, start, stop):
        view = flat[offset + flat_start:offset + flat_start + math.prod(sizes)].view(sizes)
        for loc, size, glob in layout.boxes(offs, sizes):
            rel = view
            for d, (o, sz) in enumerate(zip(loc, size)):
                rel = rel.narrow(d, o - offs[d], sz)
            out.append(Piece(glob, rel))
    return out


def _plain_optim_entries(optimizer: torch.optim.Optimizer, local: Sequence[_LocalParam], *,
                         write: bool, masters: Mapping[int, torch.Tensor] | None = None) -> dict[str, Entry]:
    """AdamW's state of every parameter; ``masters``: the state is keyed by these (a master-weight
    optimizer's inner AdamW steps the masters)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    entries: dict[str, Entry] = {}
    for lp in local:
        if write and not lp.writer:
            continue
        for copy in (lp.copies[:1] if write else lp.copies):
            copy = masters[id(copy)] if masters is not None else copy
            state = optimizer.state[copy]
            prefix = f"{OPTIM_PREFIX}{lp.name}."
            scalars, tensors = state_keys(optimizer, group_of[id(copy)])
            for key in scalars:
                if not write or lp.scalar_writer:
                    _add(entries, prefix + key, (), _whole(state[key]))
            for key in tensors:
                _add(entries, prefix + key, lp.layout.shape, _local_pieces(state[key], lp))
    return entries


@dataclass(frozen=True)
class _OwnedRange:
    """Part of a ZeRO optimizer's flat layout: ``params`` flattened back to back (one flat
    group), of which this rank's state holds elements ``[lo, hi)``, at ``state_offset`` on."""

    params: tuple
    lo: int
    hi: int
    state_offset: int


def _owned_ranges(zero) -> list[_OwnedRange]:
    """ZeRO-1/2 (``runtime.optim.grad_sync.ShardedOptimizer``): one flat group per gradient bucket
    (padded to a multiple of its group's size: dp, or an expert's replicas), this rank's chunk of
    each, the chunks back to back in its state (``ShardedOptimizer.ranges``)."""
    return [_OwnedRange(tuple(r.bucket.params), r.lo, r.hi, r.offset) for r in zero.ranges]


def _zero_state_param(zero) -> nn.Parameter:
    """The flat fp32 master chunk a ZeRO optimizer steps."""
    return zero.master


def _zero_optim_entries(zero, local: Sequence[_LocalParam], *, write: bool, flat_state: Mapping | None = None,
                        params: bool = False) -> dict[str, Entry]:
    """ZeRO-1/2: the slices of each parameter's optimizer state that this rank's flat state
    (``flat_state``, :meth:`ShardedOptimizer.flat_state`'s layout) holds and, with ``params``, of
    its fp32 master (saved and loaded as the parameter: a 16-bit plan's checkpoint holds the fp32
    weights)."""
    by_id = {id(c): (lp, i) for lp in local for i, c in enumerate(lp.copies)}
    state = flat_state is not None
    scalars, tensors = zero.state_layout() if state else ((), ())
    flats: list[tuple[str | None, torch.Tensor]] = [(k, flat_state[k]) for k in tensors] if state else []
    if params:
        flats.append((None, _zero_state_param(zero).detach()))
    entries: dict[str, Entry] = {}
    for owned in _owned_ranges(zero):
        offset = 0
        for p in owned.params:
            lp, copy_index = by_id[id(p)]
            start, stop = offset, offset + p.numel()
            offset = stop
            if write and not (lp.tp_writer and copy_index == 0):
                continue
            prefix = f"{OPTIM_PREFIX}{lp.name}."
            # Every dp rank steps the same count: the dp-0 replica writes it, every rank reads it.
            if state and (not write or lp.writer):
                for key in scalars:
                    _add(entries, prefix + key, (), _whole(flat_state[key]))
            a, b = max(start, owned.lo) - start, min(stop, owned.hi) - start  # the param's elements here
            base = owned.state_offset + start - owned.lo
            for key, flat in flats:
                name = lp.name if key is None else prefix + key
                _add(entries, name, lp.layout.shape, flat_range_pieces(flat, base, lp.layout, a, b))
    return entries


def _is_zero(optimizer) -> bool:
    return hasattr(optimizer, "optimizer") and hasattr(optimizer, "ranges")


def _zero_load_buffers(zero) -> dict[str, torch.Tensor]:
    """Zeros in :meth:`ShardedOptimizer.flat_state`'s layout, for a load to read into."""
    scalars, tensors = zero.state_layout()
    out = {key: torch.zeros((), dtype=torch.get_default_dtype()) for key in scalars}
    out.update({key: torch.zeros_like(zero.master.detach()) for key in tensors})
    return out


def _optim_entries(pm, local, *, write: bool) -> tuple[dict[str, Entry], Callable[[], None] | None]:
    """The optimizer state's entries and, for a load, what installs the loaded values after it."""
    if isinstance(pm.optimizer, MasterWeightOptimizer):
        keys = {id(p): m for p, m in zip(pm.optimizer.params, pm.optimizer.masters)}  # the inner optimizer's keys
        inner = pm.optimizer.optimizer
        if write and not inner.state:
            return {}, None
        if not write:
            init_state(inner)
        return _plain_optim_entries(inner, local, write=write, masters=keys), None
    if _is_zero(pm.optimizer):
        zero = pm.optimizer
        if write:
            flat = zero.flat_state()
            return (_zero_optim_entries(zero, local, write=True, flat_state=flat) if flat else {}), None
        flat = _zero_load_buffers(zero)
        return _zero_optim_entries(zero, local, write=False, flat_state=flat), lambda: zero.load_flat_state(flat)
    if not isinstance(pm.optimizer, torch.optim.Optimizer):
        raise ConfigError(f"checkpoints of optimizer {type(pm.optimizer).__name__} are not supported; "
                          f"pass optimizer=False to load parameters only")
    if not write:
        init_state(pm.optimizer)
    elif not pm.optimizer.state:
        return {}, None
    return _plain_optim_entries(pm.optimizer, local, write=write), None


def save_checkpoint(pm, directory: str | os.PathLike, *, step: int) -> None:
    """Save ``pm``'s parameters and optimizer state (plain, ZeRO-1 or ZeRO-2) and ``step`` to ``directory``
    under the original parameter names; every rank of ``pm.mesh`` calls it (collective over the
    mesh's group). Before the first optimizer step no optimizer state is saved."""
    local = _local_params(pm)
    entries = _weight_entries(pm, local, write=True)
    optim, _ = _optim_entries(pm, local, write=True)
    entries.update(optim)
    if pm.mesh.rank == pm.mesh.first:
        entries[TRAIN_STEP_KEY] = Entry((), _whole(torch.tensor(int(step), dtype=torch.int64)))
    save_entries(entries, directory, process_group=pm.mesh.group)


def load_checkpoint(pm, directory: str | os.PathLike, *, optimizer: bool = True) -> int:
    """Load a checkpoint written by :func:`save_checkpoint` under any plan into ``pm`` (its
    parameters and, with ``optimizer``, its optimizer state, when the checkpoint has any: one
    saved before the first step has none); returns the saved step. Every rank of ``pm.mesh``
    calls it."""
    local = _local_params(pm)
    entries = _weight_entries(pm, local, write=False)
    install = None
    if optimizer and _has_optimizer_state(directory):
        optim, install = _optim_entries(pm, local, write=False)
        entries.update(optim)
    step = torch.zeros((), dtype=torch.int64)
    entries[TRAIN_STEP_KEY] = Entry((), _whole(step))
    load_entries(entries, directory, process_group=pm.mesh.group)
    if install is not None:
        install()
    opt = pm.optimizer
    if isinstance(opt, MasterWeightOptimizer):
        opt.publish()  # the loaded masters into the parameters
    elif _zero_masters_are_weights(pm):
        opt.publish()  # the loaded master chunks, all-gathered into the parameters
    elif _is_zero(opt):
        _refresh_zero_master(opt)
    return int(step)


def _zero_masters_are_weights(pm) -> bool:
    """A 16-bit plan under ZeRO: the fp32 master chunks, not the 16-bit parameters, are saved and
    loaded as the weights."""
    return _is_zero(pm.optimizer) and is_mixed(pm.config.dtype)


def _weight_entries(pm, local, *, write: bool) -> dict[str, Entry]:
    """The weights' entries: the parameters, or (16-bit plans, host offload) the fp32 masters the
    optimizer steps, so that a checkpoint holds the fp32 weights and a resumed run continues
    exactly."""
    if isinstance(pm.optimizer, MasterWeightOptimizer):
        return _model_entries(local, write=write, masters=pm.optimizer.master_of())
    if _zero_masters_are_weights(pm):
        return _zero_optim_entries(pm.optimizer, local, write=write, params=True)
    return _model_entries(local, write=write)


@torch.no_grad()
def _refresh_zero_master(zero) -> None:
    """A ZeRO optimizer steps its own flat master copy of its chunks of the parameters: refill it
    from the loaded parameters, or its next all-gather would bring the old weights back."""
    flat = _zero_state_param(zero)
    for owned in _owned_ranges(zero):
        whole = torch.cat([p.detach().reshape(-1).to(flat.dtype) for p in owned.params])
        mine = whole[owned.lo:owned.hi]  # the padding past the last parameter stays as it was
        flat[owned.state_offset:owned.state_offset + mine.numel()].copy_(mine)


# ----------------------------------------------------------------------------------------------
# The plain single-device module
# ----------------------------------------------------------------------------------------------
def _module_names(module: nn.Module, saved: Mapping[str, tuple[int, ...]], *, prefix: str = "",
                  directory: str | os.PathLike = "") -> dict[int, tuple[str, nn.Parameter]]:
    """id(param) -> (its name in the checkpoint, param): the first alias the checkpoint has."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
        params[id(p)] = p
    out = {}
    for pid, names in aliases.items():
        key = next((n for n in names if prefix + n in saved), None)
        if key is None:
            raise CheckpointError(f"checkpoint {os.fspath(directory)}: it has no {prefix}{names[0]} (aliases "
                                  f"{names}); it was written for another model: load it into the model that saved "
                                  f"it (its keys include {sorted(saved)[:3]})")
        out[pid] = (key, params[pid])
    return out


def load_into_module(module: nn.Module, directory: str | os.PathLike) -> int:
    """Load a checkpoint's parameters into the plain single-device ``module`` (the user's model,
    no process group needed); returns the saved step (0 if the checkpoint has none)."""
    saved = checkpoint_keys(directory)
    entries = {}
    for key, p in _module_names(module, saved, directory=directory).values():
        _add(entries, key, p.shape, _whole(p.detach()))
    step = torch.zeros((), dtype=torch.int64)
    if TRAIN_STEP_KEY in saved:
        entries[TRAIN_STEP_KEY] = Entry((), _whole(step))
    load_entries(entries, directory, no_dist=True)
    return int(step)


def load_optimizer_state_into(optimizer: torch.optim.Optimizer, module: nn.Module,
                              directory: str | os.PathLike) -> None:
    """Load a checkpoint's optimizer state into a plain torch optimizer over ``module``'s
    parameters (no process group needed)."""
    saved = checkpoint_keys(directory)
    if not _state_names(saved):
        raise CheckpointError(f"checkpoint {os.fspath(directory)}: it holds no optimizer state (saved before the "
                              f"first step, or without an optimizer); load the weights only (load_into_module)")
    names = _module_names(module, {k[len(OPTIM_PREFIX):].rsplit(".", 1)[0]: v for k, v in saved.items()
                                   if k.startswith(OPTIM_PREFIX)}, directory=directory)
    init_state(optimizer)
    entries: dict[str, Entry] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError("checkpoint_io: the optimizer holds a parameter that is not in the module; "
                                  "pass the module the optimizer was built over")
            name = names[id(p)][0]
            state = optimizer.state[p]
            _add_state(entries, f"{OPTIM_PREFIX}{name}.", optimizer, group, state, p.shape)
    load_entries(entries, directory, no_dist=True)


def save_module(module: nn.Module, directory: str | os.PathLike, *, step: int,
                optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save a plain single-device ``module`` (and its optimizer state) in the same format, so a
    single-device run can be resumed under a parallel plan."""
    entries: dict[str, Entry] = {}
    names = {id(p): n for n, p in module.named_parameters()}
    for name, p in module.named_parameters():
        _add(entries, name, p.shape, _whole(p.detach()))
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                if not state:
                    continue
                _add_state(entries, f"{OPTIM_PREFIX}{names[id(p)]}.", optimizer, group, state, p.shape)
    entries[TRAIN_STEP_KEY] = Entry((), _whole(torch.tensor(int(step), dtype=torch.int64)))
    save_entries(entries, directory, no_dist=True)


def _add_state(entries: dict[str, Entry], prefix: str, optimizer: torch.optim.Optimizer, group: Mapping,
               state: Mapping, shape: Sequence[int]) -> None:
    """One plain parameter's optimizer state (every key :func:`state_keys` names), whole."""
    scalars, tensors = state_keys(optimizer, group)
    for key in scalars:
        _add(entries, prefix + key, (), _whole(state[key]))
    for key in tensors:
        _add(entries, prefix + key, shape, _whole(state[key]))

"""Reading a checkpoint's ``.metadata`` without running code from it.

``torch.distributed.checkpoint`` writes a checkpoint's metadata (which entries it has, their
shapes and dtypes, which file holds each chunk) as a pickle and reads it back with
``pickle.load``, and a pickle can call any importable function: loading a checkpoint from
someone else could run their code. Here the metadata is read with an unpickler that resolves
only the checkpoint's own types (:data:`ALLOWED`): the metadata classes of
``torch.distributed.checkpoint``, ``torch.Size``, torch dtypes, layouts and memory formats, the
path of the checkpoint and builtin containers; any other reference is refused with
:class:`CheckpointError` naming it, before anything is called.

:class:`SafeFileSystemReader` is DCP's ``FileSystemReader`` with that reading of the metadata and
a size check of every data file a load reads (a truncated file is named, rather than failing
inside ``torch.load``); the tensors themselves are read with ``torch.load(weights_only=True)`` by
DCP, which runs no code either.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from passes.ir.errors import CheckpointError

METADATA_FILE = ".metadata"


def _allowed() -> frozenset[tuple[str, str]]:
    out = {(dcp_md.__name__, name) for name, obj in vars(dcp_md).items()
           if isinstance(obj, type) and obj.__module__ == dcp_md.__name__}
    out |= {(dcp_fs.__name__, "_StorageInfo"), (dcp_fs.__name__, "_StoragePrefix")}
    out |= {("torch", "Size"), ("torch.serialization", "_get_layout")}
    out |= {("torch", name) for name in dir(torch)
            if isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))}
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to (pathlib moved in Python 3.13).
    out |= {(mod, cls) for mod in ("pathlib", "pathlib._local")
            for cls in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
    out |= {("builtins", name) for name in ("set", "frozenset", "bytearray", "slice", "complex")}
    out |= {("collections", "OrderedDict")}
    return frozenset(out)


ALLOWED = _allowed()
"""``(module, name)`` pairs a checkpoint's metadata may refer to."""


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED` globals (anything else: :class:`_Refused`)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise _Refused(module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"persistent id {str(pid)[:80]!r} (checkpoint metadata holds no tensors)")


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """The :class:`Metadata` in ``path`` (a checkpoint's ``.metadata``), read with
    :class:`RestrictedUnpickler`. :class:`CheckpointError` when it is missing, truncated or
    damaged, refers to anything outside :data:`ALLOWED`, or holds something else than metadata."""
    path = Path(path)
    directory = path.parent
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory}: no {path.name} file, so it is not a checkpoint or its save "
                              f"did not finish; pass a directory a save wrote (with its {METADATA_FILE}), or an "
                              f"older checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"checkpoint {directory}: cannot read {path.name} ({exc.strerror}); check the "
                              f"path and its permissions") from None
    try:
        metadata = RestrictedUnpickler(io.BytesIO(data)).load()
    except _Refused as exc:
        raise CheckpointError(f"checkpoint {directory}: {path.name} refers to {exc.module}.{exc.name}, which "
                              f"checkpoint metadata never holds; refused without loading it (the file is a pickle "
                              f"and would run code). Load only checkpoints you or a trusted source wrote") from None
    except Exception as exc:  # noqa: BLE001 - truncated or damaged: pickle raises many kinds
        raise CheckpointError(f"checkpoint {directory}: {path.name} is truncated or damaged "
                              f"({type(exc).__name__}: {str(exc)[:200]}; {len(data)} bytes); its save did not "
                              f"finish or the file was altered: load an older checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {directory}: {path.name} holds a {type(metadata).__name__}, not "
                              f"torch.distributed.checkpoint metadata; it was not written by a checkpoint save")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` reading the metadata with :func:`read_metadata_file` and
    checking, before it reads them, that the data files it needs are there and long enough."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}"
        metadata = read_metadata_file(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        ends: dict[str, int] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise CheckpointError(f"checkpoint {self.path}: {METADATA_FILE} has no storage record of "
                                      f"{item.storage_index.fqn}; the file was altered: load an older checkpoint")
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for rel, end in sorted(ends.items()):
            file = Path(self.path) / rel
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {self.path}: data file {rel} is missing (its {METADATA_FILE} "
                                      f"places entries in it); the directory is incomplete: copy it whole, or load "
                                      f"an older checkpoint") from None
            if size < end:
                raise CheckpointError(f"checkpoint {self.path}: data file {rel} is truncated ({size} bytes, its "
                                      f"entries reach byte {end}); load an older checkpoint")
        return super().read_data(plan, planner)

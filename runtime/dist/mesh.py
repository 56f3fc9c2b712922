"""Process groups for a (pp, dp, tp) device mesh, on gloo (CPU) or NCCL (CUDA).

Rank layout (global rank of mesh coordinates)::

    rank = first + pp_index * (dp * tp) + dp_index * tp + tp_index

tp varies fastest (tensor-parallel peers share a node, where bandwidth is highest), then dp, then
pp. With context parallelism the data axis holds a plan's ``dp * cp`` ranks (every rank holding
the same parameters: the gradient-averaging group) and ``cp`` consecutive ones among them form a
cp group: ``dp_index = replica * cp + cp_index`` (cp groups share a node before dp replicas do).
With expert parallelism ``ep`` consecutive ranks of the data axis form an ep group (each holds
``experts / ep`` of every MoE block's experts) and the ranks at the same place of every ep group
an expert-replica group (they hold the same experts and average those gradients). ``first`` lets a mesh use ranks ``first .. first + pp*dp*tp - 1`` of a larger world (tests run
several meshes inside one spawned job). Example, dp=2, pp=2, tp=1::

    pp_index 0: ranks 0 1   (the dp group of stage-rank 0)
    pp_index 1: ranks 2 3
    pp groups: (0, 2), (1, 3)

``torch.distributed.new_group`` must be called by every process of the world, for every group,
in the same order, so :class:`Mesh` is built on every rank of the world, including ranks outside
the mesh (they get ``mesh.active == False`` and no groups of their own).
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from runtime.dist.host_memory import keep_freed_host_memory
from runtime.dist.launch import free_port
from passes.ir.errors import ConfigError
from passes.ir.launcher_env import RENDEZVOUS_VARS
from passes.ir.schedule.validate import stream_count
from runtime.dist import comm

AXES = ("pp", "dp", "tp")
DEFAULT_TIMEOUT_S = 60.0
START_TIMEOUT_S = 600.0
"""Seconds the default group of a job waits in a collective while it starts (capture, planning,
a first calibration with the job's ranks, the plan broadcast): rank 0 works while the others
wait; training traffic uses the mesh's groups and their own timeout."""


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(*, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Initialise the default process group from the environment (``env://``: MASTER_ADDR,
    MASTER_PORT, RANK, WORLD_SIZE, as torchrun and :func:`runtime.dist.launch.spawn` set them),
    unless it already is.

    ``timeout_s`` (seconds) bounds every collective of the default group, so a dead peer turns
    into an error instead of a hang. A process started without any launcher (``python train.py``)
    is the one rank of a job of one: its rendezvous is set here, on a free local port. A CPU rank
    (any backend but NCCL), whoever initialised its group, keeps its freed host memory
    (:func:`runtime.dist.host_memory.keep_freed_host_memory`): its large tensors reuse their pages
    instead of new ones each step.
    """
    if not dist.is_initialized():
        _init_from_environment(backend or default_backend(), timeout_s)
    if dist.get_backend() != "nccl":
        keep_freed_host_memory()


def _init_from_environment(backend: str, timeout_s: float) -> None:
    missing = [k for k in RENDEZVOUS_VARS if k not in os.environ]
    if len(missing) == len(RENDEZVOUS_VARS):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        missing = []
    if missing:
        raise ConfigError(f"mesh: environment variable(s) {missing} not set; run under torchrun or "
                          f"runtime.dist.launch.spawn, or call torch.distributed.init_process_group first")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))


class Mesh:
    """The (pp, dp, tp) process groups of this rank.

    Attributes (for an active rank): ``pp_index``, ``dp_index``, ``tp_index``; ``pp_group``
    (with ``pp_reverse_group`` over the same ranks for pipeline messages to lower ranks),
    ``dp_group``, ``tp_group``, ``group`` (every rank of the mesh); ``pp_ranks``/``dp_ranks``/
    ``tp_ranks``: global ranks of this rank's groups, in axis order; ``ends_group`` over
    ``ends_ranks``, the first and last ranks of this rank's pipeline (for tied weights); ``device``;
    ``joined``: the sizes of the groups of more than one rank this rank is in, each an NCCL
    communicator with buffers of its own (``ParallelConfig.communicators`` counts them for the planner).
    """

    def __init__(self, dp: int, pp: int, tp: int = 1, *, first: int = 0, backend: str | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, pp_streams: int = 2, dp_shard: int | None = None,
                 cp: int = 1, ep: int = 1):
        for name, value in (("dp", dp), ("pp", pp), ("tp", tp), ("cp", cp), ("ep", ep)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"mesh: {name} must be an int >= 1, got {value!r}")
        if dp % cp or dp % ep:
            raise ConfigError(f"mesh: the data axis of {dp} ranks (a plan's dp * cp) does not divide into cp groups "
                              f"of {cp} and ep groups of {ep}; build the mesh with dp=config.dp_cp (Mesh.for_config)")
        init_distributed(backend=backend, timeout_s=timeout_s)
        self.dp, self.pp, self.tp, self.first = dp, pp, tp, first
        self.size = dp * pp * tp
        world = dist.get_world_size()
        if first < 0 or first + self.size > world:
            raise ConfigError(f"mesh: dp*pp*tp = {self.size} ranks from rank {first} do not fit the world of "
                              f"{world} ranks; launch {first + self.size} processes or shrink the mesh")
        self.rank = dist.get_rank()
        self.joined: list[int] = []  # sizes of the groups of more than one rank this rank is in
        self.backend = dist.get_backend()
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.active = first <= self.rank < first + self.size
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                       else torch.device("cpu"))

        local = self.rank - first
        if self.active:
            self.pp_index, rest = divmod(local, dp * tp)
            self.dp_index, self.tp_index = divmod(rest, tp)
        # Every rank creates every group, in the same order (a torch.distributed requirement).
        self.group = self.new_group(range(first, first + self.size))
        for axis in AXES:
            for ranks in self.axis_ranks(axis):
                group = self.new_group(ranks)
                if self.active and self.rank in ranks:
                    setattr(self, f"{axis}_group", group)
                    setattr(self, f"{axis}_ranks", tuple(ranks))
        # Pipeline messages towards lower ranks get a group of their own (a second NCCL
        # communicator: runtime.dist.comm), so they never queue behind messages going up.
        self.pp_reverse_group = None
        for ranks in self.axis_ranks("pp"):
            group = self.new_group(ranks) if pp > 1 else None
            if self.active and self.rank in ranks:
                self.pp_reverse_group = group
        # pp_streams=4 (the ZBV schedule): activations and gradients each get a communicator per
        # direction (passes.ir.schedule.validate.message_stream_by_kind)
        self.pp_stream_groups: dict[str, dist.ProcessGroup] = {}
        if pp_streams not in (2, 4):
            raise ConfigError(f"mesh: pp_streams must be 2 or 4, got {pp_streams!r}")
        if pp_streams == 4 and pp > 1:
            for ranks in self.axis_ranks("pp"):
                f_down, b_up = self.new_group(ranks), self.new_group(ranks)
                if self.active and self.rank in ranks:
                    self.pp_stream_groups = {"F-up": self.pp_group, "F-down": f_down, "B-up": b_up,
                                             "B-down": self.pp_reverse_group}
        # HSDP (ZeRO-3 with hsdp_shard=s): each dp group splits into shard groups of s consecutive
        # dp ranks and replica groups of the ranks at the same place in every shard group.
        self.dp_shard = dp_shard if dp_shard is not None else dp
        if dp_shard is not None and (not isinstance(dp_shard, int) or not 1 < dp_shard < dp or dp % dp_shard):
            raise ConfigError(f"mesh: dp_shard must divide dp={dp} and lie between 2 and dp-1, got {dp_shard!r}")
        self.dp_shard_group, self.dp_replica_group = getattr(self, "dp_group", None), None
        self.dp_shard_ranks, self.dp_replica_ranks = getattr(self, "dp_ranks", ()), ()
        if dp_shard is not None:
            for ranks in self.axis_ranks("dp"):
                shards = [ranks[k:k + dp_shard] for k in range(0, dp, dp_shard)]
                replicas = [ranks[k::dp_shard] for k in range(dp_shard)]
                for kind, pieces in (("shard", shards), ("replica", replicas)):
                    for piece in pieces:
                        group = self.new_group(piece)
                        if self.active and self.rank in piece:
                            setattr(self, f"dp_{kind}_group", group)
                            setattr(self, f"dp_{kind}_ranks", tuple(piece))
        # Context parallelism: cp consecutive ranks of each data axis attend together.
        self.cp = cp
        self.cp_group, self.cp_ranks = None, ()
        if cp > 1:
            for ranks in self.axis_ranks("dp"):
                for k in range(0, dp, cp):
                    group = self.new_group(ranks[k:k + cp])
                    if self.active and self.rank in ranks[k:k + cp]:
                        self.cp_group, self.cp_ranks = group, tuple(ranks[k:k + cp])
        # Expert parallelism: ep consecutive ranks of each data axis hold different experts; the
        # ranks at the same place of every ep group hold the same ones (expert replicas).
        self.ep = ep
        self.ep_group, self.ep_ranks = None, ()
        self.ep_replica_group, self.ep_replica_ranks = None, ()
        if ep > 1:
            for ranks in self.axis_ranks("dp"):
                pieces = [ranks[k:k + ep] for k in range(0, dp, ep)] + [ranks[j::ep] for j in range(ep)]
                for k, piece in enumerate(pieces):
                    group = self.new_group(piece) if len(piece) > 1 else None
                    if self.active and self.rank in piece:
                        if k < dp // ep:
                            self.ep_group, self.ep_ranks = group, tuple(piece)
                        else:
                            self.ep_replica_group, self.ep_replica_ranks = group, tuple(piece)
        # The first and last pipeline ranks of each pipeline hold the tied embedding / LM head.
        # Groups are made here, by every rank: new_group(use_local_synchronization=True) names a
        # group by its ranks, so a second mesh over the same ranks would collide with the first.
        self.ends_ranks: tuple[int, ...] = ()
        self.ends_group = None
        for ranks in self.axis_ranks("pp"):
            ends = [ranks[0], ranks[-1]]
            group = self.new_group(ends) if pp > 2 else None
            if self.active and self.rank in ranks:
                self.ends_ranks = tuple(ends) if pp > 1 else ()
                self.ends_group = group if pp > 2 else (self.pp_group if pp == 2 else None)

        if self.active and self.backend == "nccl" and pp > 1:
            # NCCL: a batch_isend_irecv that is a group's first operation must involve every rank of
            # the group; one collective on each pipeline group at start-up makes that hold.
            for group in dict.fromkeys([self.pp_group, self.pp_reverse_group, *self.pp_stream_groups.values()]):
                comm.all_reduce(torch.zeros(1, device=self.device), group)

    @classmethod
    def for_config(cls, config, **options) -> "Mesh":
        """The mesh a :class:`~passes.ir.config.ParallelConfig` runs on (its data axis is
        ``dp * cp`` ranks, its ZeRO-3 shard groups ``hsdp_shard``); ``options`` as for the constructor."""
        return cls(config.dp_cp, config.pp, config.tp, cp=config.cp, dp_shard=config.hsdp_shard,
                   pp_streams=stream_count(config.schedule), ep=config.ep, **options)

    @property
    def cp_index(self) -> int:
        """This rank's place in its cp group (0 without context parallelism)."""
        return self.dp_index % self.cp

    @property
    def ep_index(self) -> int:
        """This rank's place in its ep group (0 without expert parallelism)."""
        return self.dp_index % self.ep

    @property
    def replica_index(self) -> int:
        """Which data-parallel replica (the samples it takes) this rank belongs to: ``dp_index // cp``."""
        return self.dp_index // self.cp

    @property
    def dp_shard_index(self) -> int:
        """This rank's place in its ZeRO-3 shard group (its dp index without HSDP)."""
        return self.dp_index % self.dp_shard

    def global_rank(self, pp_index: int, dp_index: int, tp_index: int = 0) -> int:
        """Global rank at mesh coordinates (see the module docstring for the layout)."""
        return self.first + pp_index * self.dp * self.tp + dp_index * self.tp + tp_index

    def axis_ranks(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` as its list of global ranks (one list per other coordinates)."""
        if axis not in AXES:
            raise ConfigError(f"mesh: unknown axis {axis!r}; use one of {AXES}")
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        others = [a for a in AXES if a != axis]
        groups = []
        for i in range(sizes[others[0]]):
            for j in range(sizes[others[1]]):
                coords = {others[0]: i, others[1]: j}
                groups.append([self.global_rank(**{f"{a}_index": coords.get(a, k) for a in AXES})
                               for k in range(sizes[axis])])
        return groups

    def exchange(self, obj: object) -> list:
        """Every mesh rank's picklable ``obj``, in mesh rank order: one all-gather over the mesh
        group, under its timeout (``[obj]`` alone on a mesh of one rank). Every rank of the mesh
        must call it at the same point (the build does, right after lowering, before any step)."""
        if not self.active or self.size == 1:
            return [obj]
        return comm.all_gather_object(obj, self.group)

    def new_group(self, ranks) -> dist.ProcessGroup | None:
        """A process group over ``ranks`` with this mesh's timeout; call it on every rank of the world."""
        ranks = list(ranks)
        if self.rank in ranks and len(ranks) > 1:
            self.joined.append(len(ranks))
        return comm.new_group(ranks, timeout_s=self.timeout.total_seconds())

    def __repr__(self) -> str:
        where = (f"pp={self.pp_index} dp={self.dp_index} tp={self.tp_index}" if self.active else "inactive")
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        return f"Mesh(dp={self.dp}, pp={self.pp}, tp={self.tp}{cp}, rank {self.rank}: {where})"


def check_mesh_fits(mesh: Mesh, config, *, where: str) -> None:
    """Raise :class:`ConfigError` unless this rank of ``mesh`` can run ``config`` (a
    :class:`~passes.ir.config.ParallelConfig`): the mesh's axes are the plan's (its data axis
    ``dp * cp``), this rank is one of its ranks, it has the pipeline communicators the schedule
    sends over and ZeRO-3's shard groups. ``where`` names the caller in the message."""
    c = config
    if (mesh.dp, mesh.pp, mesh.tp, getattr(mesh, "cp", 1)) != (c.dp_cp, c.pp, c.tp, c.cp):
        raise ConfigError(f"{where}: mesh has a data axis of {mesh.dp}, pp={mesh.pp}, tp={mesh.tp}, "
                          f"cp={getattr(mesh, 'cp', 1)} but the plan needs dp*cp={c.dp_cp} (cp={c.cp}), "
                          f"pp={c.pp}, tp={c.tp}; build the mesh with Mesh.for_config(config)")
    if getattr(mesh, "ep", 1) != c.ep:
        raise ConfigError(f"{where}: the mesh has ep groups of {getattr(mesh, 'ep', 1)} ranks, the plan ep={c.ep}; "
                          f"build the mesh with Mesh(..., ep={c.ep}) or Mesh.for_config(config)")
    if not mesh.active:
        raise ConfigError(f"{where}: rank {mesh.rank} is outside {mesh}; build it on mesh ranks only")
    if c.pp > 1 and stream_count(c.schedule) != (4 if getattr(mesh, "pp_stream_groups", None) else 2):
        raise ConfigError(f"{where}: schedule {c.schedule!r} sends its pipeline messages over "
                          f"{stream_count(c.schedule)} communicators per rank pair; build the mesh with "
                          f"Mesh(..., pp_streams={stream_count(c.schedule)}) or Mesh.for_config(config)")
    if getattr(mesh, "dp_shard", c.dp_cp) != (c.shard_degree if c.zero_stage == 3 else c.dp_cp):
        raise ConfigError(f"{where}: the plan shards ZeRO-3 parameters over {c.shard_degree} dp ranks "
                          f"(hsdp_shard={c.hsdp_shard}), the mesh's shard groups have {mesh.dp_shard}; build the "
                          f"mesh with Mesh(..., dp_shard={c.hsdp_shard}) or Mesh.for_config(config)")

"""``ParallelConfig``: every knob of a parallel training plan, in one typed, validated record.

The search returns one inside its :class:`passes.ir.plan.Plan`; the lowering
(:func:`passes.lowering.lower.lower`) takes one; every rank program carries one; the runtime runs what it
says. The choices of each knob are spelled here and nowhere else (the ``Literal`` types and the
tuples derived from them).

Stage boundaries are indexes into the model's *layer chain*: ``0`` is the embedding (everything
before the first repeated block), ``1 .. L`` the blocks, ``L + 1`` the head (final norm, LM head,
loss), as :mod:`passes.analysis.annotate_blocks` numbers them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from passes.ir.errors import ConfigError
from passes.ir.schedule.validate import stream_count

Schedule = Literal["gpipe", "1f1b", "interleaved", "zb1p", "zbv"]
ZeroStage = Literal[0, 1, 2, 3]
Checkpointing = Literal["none", "selective", "full", "dag", "tensor"]
Offload = Literal["none", "activations", "optimizer"]
DType = Literal["fp32", "bf16", "fp16"]
ContextParallelMode = Literal["ring", "ulysses"]

SCHEDULES: tuple[str, ...] = get_args(Schedule)
ZERO_STAGES: tuple[int, ...] = get_args(ZeroStage)
CHECKPOINTING: tuple[str, ...] = get_args(Checkpointing)
OFFLOAD: tuple[str, ...] = get_args(Offload)
DTYPES: tuple[str, ...] = get_args(DType)
CP_MODES: tuple[str, ...] = get_args(ContextParallelMode)
TORCH_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The torch dtype of parameters and activations under each training dtype (``bf16``/``fp16``:
16-bit weights, gradients and activations; the optimizer keeps fp32 master weights)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The training-dtype name (``fp32``, ``bf16``, ``fp16``) of a torch floating dtype."""
    for name, t in TORCH_DTYPES.items():
        if t == dtype:
            return name
    raise ConfigError(f"no training dtype for {dtype}; the runtime trains in {', '.join(TORCH_DTYPES)}")


def is_mixed(dtype: str) -> bool:
    """Whether training dtype ``dtype`` is 16-bit (``bf16``, ``fp16``): 2-byte parameters, gradients
    and activations, with fp32 master weights and fp32 optimizer state (``fp16`` also scales the
    loss). The one place the yes/no is derived from the dtype."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype != "fp32"

# Options of the passes that carry the knobs out (what a pass can do, beyond what the planner asks).
CheckpointPolicy = Literal["none", "full", "selective", "solver"]
"""``checkpoint_policy``'s policies: the knob's three, plus ``solver`` (fewest recompute FLOPs under
a byte budget, :mod:`passes.solvers.checkpoint_solver`)."""
OffloadSelection = Literal["none", "all", "hidden"]
"""``offload_policy``'s selections: ``all`` kept activations (the knob ``offload="activations"``),
or only those whose copies ``hidden`` behind compute on the cost model's numbers."""
CHECKPOINT_POLICIES: tuple[str, ...] = get_args(CheckpointPolicy)
OFFLOAD_SELECTIONS: tuple[str, ...] = get_args(OffloadSelection)

KNOBS = ("dp", "tp", "pp", "cp", "cp_mode", "ep", "virtual_pp", "micro_batch_size", "num_micro_batches", "schedule", "zero_stage",
         "hsdp_shard", "reshard_after_forward", "sequence_parallel", "checkpointing", "offload", "compile")
"""The fields the search chooses and ``fix=`` may pin (``dtype`` is the user's; ``stage_boundaries``
follows from the others; ``compile`` is off unless pinned)."""

_POSITIVE = ("dp", "tp", "pp", "cp", "ep", "virtual_pp", "micro_batch_size", "num_micro_batches")
_CHOICES = {"schedule": SCHEDULES, "zero_stage": ZERO_STAGES, "checkpointing": CHECKPOINTING,
            "offload": OFFLOAD, "dtype": DTYPES, "cp_mode": CP_MODES}


def expert_parallel_refusals(ep: int, *, tp: int | None = None, zero_stage: int | None = None,
                             offload: str | None = None) -> list[str]:
    """The knobs ``ep > 1`` does not run with yet, each as a rule with its fix (None: not known):
    tensor parallelism (the experts' matmuls would need a tp layout of their own), ZeRO-3 (its
    parameter shards and gathers span the whole data axis, not an expert's replicas) and offload.
    ZeRO-1/2 shard the experts' state over the ranks holding the same experts."""
    out = []
    if ep <= 1:
        return out
    if tp is not None and tp > 1:
        out.append(f"ep={ep} with tp={tp} is not supported yet (the experts are not laid out over tp); use tp=1 with "
                   f"ep, or ep=1")
    if zero_stage == 3:
        out.append(f"ep={ep} with zero_stage=3 is not supported yet (its parameter shards span the whole data axis, "
                   f"not the ranks holding the same experts); use zero_stage 0, 1 or 2 with ep, or ep=1")
    if offload is not None and offload != "none":
        out.append(f"ep={ep} with offload={offload!r} is not supported yet; use offload='none' with ep")
    return out


SPLIT_BACKWARD_SCHEDULES = ("zb1p", "zbv")
"""The schedules that run each backward as an input half and a weight half."""


@functools.lru_cache(maxsize=None)
def knob_conflicts(*, zero_stage: int, offload: str, schedule: str, checkpointing: str) -> tuple[str, ...]:
    """The rules between ZeRO, offload, the schedule and checkpointing that a combination breaks,
    each with its fix (part of :meth:`ParallelConfig.problems`; the search asks once per
    combination instead of once per config)."""
    out = []
    split = schedule in SPLIT_BACKWARD_SCHEDULES
    if offload == "optimizer" and zero_stage:
        out.append(f"offload='optimizer' keeps the whole optimizer state on the host, zero_stage="
                   f"{zero_stage} shards it over dp: choose one (zero_stage=0 or offload='none')")
    if zero_stage == 3:
        if split:
            out.append(f"zero_stage=3 gathers a block's parameters for one backward; schedule={schedule!r} "
                       f"splits it in two (input and weight halves), which ZeRO-3 does not run; use "
                       f"schedule=1f1b or interleaved, or zero_stage <= 2")
        if offload == "activations":
            out.append("zero_stage=3 with offload='activations' is not supported (the offload brackets would keep "
                       "the gathered parameters alive until backward); use checkpointing to save activation "
                       "memory, or zero_stage <= 2")
    if checkpointing == "dag" and split:
        out.append(f"checkpointing='dag' keeps op outputs in torch's selective checkpointing, which replays a "
                   f"region for one backward only; schedule={schedule!r} splits each backward in two (input "
                   f"and weight halves); use checkpointing='full' with it, or schedule=1f1b, gpipe or interleaved")
    return tuple(out)


def compile_refusals(*, schedule: str, offload: str, checkpointing: str, cp: int, ep: int) -> list[str]:
    """What ``compile=true`` does not run with yet, each rule with its fix. Under a split backward
    (zb1p, zbv) a compiled stage would be one autograd node, which the input and weight halves
    cannot run apart, so only the weight-free segments between its weight-reading ops compile
    (:func:`runtime.exec.compiled.compile_segments`); a checkpointed region is one call of a
    submodule there, whose inside would stay uncompiled, so those plans are refused. Offload's
    brackets, the checkpoint policies that replay single ops (``dag``, ``tensor``) and the cp and
    ep exchanges were not tried compiled."""
    out, off = [], "or compile=false"
    if schedule in SPLIT_BACKWARD_SCHEDULES and checkpointing != "none":
        out.append(f"compile=true with schedule={schedule!r} compiles the segments between a stage's weight-reading "
                   f"ops, and a checkpointed region ({checkpointing!r}) would run uncompiled inside; use "
                   f"checkpointing='none', schedule=1f1b, gpipe or interleaved, {off}")
    if offload != "none":
        out.append(f"compile=true with offload={offload!r} is not supported yet; use offload='none', {off}")
    if checkpointing in ("dag", "tensor"):
        out.append(f"compile=true with checkpointing={checkpointing!r} is not supported yet; use checkpointing='full' "
                   f"or 'selective', {off}")
    if cp > 1:
        out.append(f"compile=true with cp={cp} is not supported yet; use cp=1, {off}")
    if ep > 1:
        out.append(f"compile=true with ep={ep} is not supported yet; use ep=1, {off}")
    return out


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelConfig:
    """How one training step is spread over ``dp * cp * tp * pp`` devices. Validated on construction.

    Mesh layout (:mod:`passes.ir.program`): tp fastest, then cp, then dp, then pp. The ``dp * cp``
    ranks of one (pipeline rank, tp rank) hold the same parameters and average their gradients
    together (:attr:`dp_cp`), as Megatron-Core and torchtitan do; the ``cp`` consecutive ones among
    them take the same samples, each its share of the sequence."""

    dp: int = 1
    """Data-parallel replicas."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row sharding inside each block)."""
    pp: int = 1
    """Pipeline stages (pipeline ranks)."""
    cp: int = 1
    """Context-parallel degree: the sequence of every activation cut over ``cp`` ranks
    (load-balanced for causal attention: :mod:`passes.rewrites.context_parallel`); attention exchanges
    keys and values over the cp group."""
    cp_mode: ContextParallelMode = "ring"
    """How attention sees the other cp ranks' tokens: ``ring`` (key/value blocks travel round the
    cp ring, online softmax) or ``ulysses`` (all-to-all from sequence shards to head shards and
    back; heads must divide by tp * cp)."""
    ep: int = 1
    """Expert-parallel degree: each mixture-of-experts block's routed experts are spread over ``ep``
    consecutive ranks of the data axis (taken from the ``dp * cp`` ranks, as Megatron-Core and
    torchtitan do); a rank holds ``experts / ep`` of them, the tokens of its ep group are gathered
    for them and their outputs reduce-scattered back (:mod:`passes.rewrites.expert_parallel`).
    Expert gradients average over the ``dp * cp / ep`` ranks that hold the same experts."""
    virtual_pp: int = 1
    """Model chunks per pipeline rank (interleaved schedule; 1 otherwise)."""
    micro_batch_size: int = 1
    """Samples per micro-batch on one data-parallel replica."""
    num_micro_batches: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule."""
    zero_stage: ZeroStage = 0
    """ZeRO over the data-parallel group: 0 none, 1 optimizer state sharded, 2 gradients too, 3
    parameters too (gathered per block for its forward and again for its backward:
    :mod:`passes.rewrites.shard_parameters`)."""
    hsdp_shard: int | None = None
    """ZeRO-3's shard group: ``None`` shards the parameters over the whole dp group; a divisor
    ``s`` of dp (``1 < s < dp``) shards them inside groups of ``s`` consecutive dp ranks (a node)
    and replicates them across the ``dp / s`` groups (HSDP: gradients reduce-scattered inside a
    group, then all-reduced across the replicas)."""
    reshard_after_forward: bool = True
    """ZeRO-3: free a block's gathered parameters after its forward and gather them again for its
    backward (``True``, FSDP's default: the least memory), or keep them from the forward's gather
    to the block's reduce-scatter (``False``: one gather per micro-batch instead of two, and the
    stage's parameters held in full between a micro-batch's forward and its backward)."""
    sequence_parallel: bool = False
    """Shard the tensor-parallel-replicated activations (norms, dropout, residuals) along the sequence."""
    checkpointing: Checkpointing = "none"
    """Activation recomputation: ``selective`` the attention core of each block, ``full`` the whole
    block, ``dag`` op outputs inside blocks (torch's selective checkpointing), ``tensor`` any op
    output of the stage, recomputed one at a time on demand in backward (the peak-bounded remat
    MILP per stage: :mod:`passes.policies.tensor_remat_policy`)."""
    offload: Offload = "none"
    """``activations``: saved activations wait in host memory between forward and backward;
    ``optimizer``: optimizer state and step on the host (ZeRO-Offload style)."""
    dtype: DType = "fp32"
    """Training precision: ``fp32``, or ``bf16``/``fp16`` compute with fp32 master weights."""
    compile: bool = False
    """Run each stage program compiled (``torch.compile``, inductor; random draws as in eager, so a
    compiled plan trains like the uncompiled one): every rank compiles its programs at their first
    forward; under the schedules that split a backward in two (zb1p, zbv), the segments between
    the weight-reading ops, which stay eager for the split to find. Not with offload, ``dag`` or
    ``tensor`` checkpointing, cp or ep yet, nor with any checkpointing under a split backward
    (:meth:`problems` refuses them)."""
    stage_boundaries: tuple[int, ...] | None = None
    """Layer-chain index where each virtual stage ``1 .. pp*virtual_pp - 1`` starts (see the module
    docstring); ``None``: the blocks are spread evenly, the embedding on the first stage, the head on
    the last."""

    def __post_init__(self) -> None:
        if self.stage_boundaries is not None and not isinstance(self.stage_boundaries, tuple):
            object.__setattr__(self, "stage_boundaries", tuple(self.stage_boundaries))
        self.validate()

    @classmethod
    def for_global_batch(cls, global_batch: int, **knobs: Any) -> ParallelConfig:
        """The config whose ``dp * micro_batch_size * num_micro_batches`` is ``global_batch``
        (``micro_batch_size`` follows from the other two)."""
        dp, m = knobs.get("dp", 1), knobs.get("num_micro_batches", 1)
        if not isinstance(global_batch, int) or global_batch < 1 or global_batch % (dp * m):
            raise ConfigError(f"global batch {global_batch!r} must be a positive multiple of dp * num_micro_batches "
                              f"= {dp} * {m}; e.g. {dp * m * max(1, (global_batch if isinstance(global_batch, int) else 1) // (dp * m))}")
        return cls(micro_batch_size=global_batch // (dp * m), **knobs)

    # --------------------------------------------------------------------------------- derived
    @property
    def world_size(self) -> int:
        """Devices the plan uses: ``dp * cp * tp * pp``."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters (one pipeline rank, one tp rank): ``dp * cp``. The
        mesh's data axis runs over them (cp innermost); gradients are averaged, ZeRO shards, over them."""
        return self.dp * self.cp

    @property
    def communicators(self) -> int:
        """Process groups of more than one rank that a rank joins on the mesh that runs this plan, at most
        (:class:`runtime.dist.mesh.Mesh`; tests/test_device_memory.py checks the two agree): the
        mesh's, the pipeline's (two, four for ZB-V's message streams) with the first and last
        stages' for tied weights (``pp > 2``), the data axis's (HSDP: its shard and replica groups
        besides), tensor, context and expert parallelism's. NCCL gives each group a communicator
        with buffers of its own in device memory."""
        hsdp = self.hsdp_shard is not None
        groups = [self.world_size > 1, self.dp_cp > 1, self.tp > 1, self.cp > 1, hsdp, hsdp,
                  self.ep > 1, self.ep > 1 and self.expert_replicas > 1, self.pp > 2]
        return sum(groups) + (stream_count(self.schedule) if self.pp > 1 else 0)

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts, whose expert gradients are averaged together: ``dp * cp / ep``."""
        return self.dp_cp // self.ep

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: ``dp * micro_batch_size * num_micro_batches``."""
        return self.dp * self.micro_batch_size * self.num_micro_batches

    @property
    def n_stages(self) -> int:
        """Virtual pipeline stages: ``pp * virtual_pp``."""
        return self.pp * self.virtual_pp

    def stage_rank(self, stage: int) -> int:
        """Pipeline index of the rank that runs virtual stage ``stage``: ``stage % pp``, or for
        ZBV's V placement ``stage`` on the way down and ``2 * pp - 1 - stage`` on the way back."""
        if self.schedule == "zbv":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def rank_stages(self, pp_index: int) -> tuple[int, ...]:
        """The virtual stages pipeline rank ``pp_index`` runs, in increasing order."""
        return tuple(s for s in range(self.n_stages) if self.stage_rank(s) == pp_index)

    @property
    def shard_degree(self) -> int:
        """Ranks one ZeRO-3 parameter is sharded over (``hsdp_shard``, else ``dp * cp``)."""
        return self.hsdp_shard if self.hsdp_shard is not None else self.dp_cp

    @property
    def split_backward(self) -> bool:
        """Whether the schedule runs each backward as an input half and a weight half."""
        return self.schedule in SPLIT_BACKWARD_SCHEDULES

    # ------------------------------------------------------------------------------ validation
    def problems(self, *, world_size: int | None = None, blocks: int | None = None,
                 heads: int | None = None) -> list[str]:
        """Every rule this config breaks, each as ``constraint: values; fix`` (empty: valid).

        With ``world_size`` (devices of the job), ``blocks`` (repeated layers of the model) or
        ``heads`` (attention heads) the rules that involve them are checked too.
        """
        out: list[str] = []
        for name in _POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{name} must be an integer >= 1, got {value!r}; give a positive count")
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
                out.append(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
        for name in ("sequence_parallel", "reshard_after_forward", "compile"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if out:
            return out  # the rules below compare values that must be well typed first
        if self.schedule == "zbv":
            if self.virtual_pp != 2 or self.pp < 2:
                out.append(f"schedule='zbv' runs two chunks on each of at least 2 pipeline ranks (a V: rank r holds "
                           f"stages r and 2*pp-1-r), got pp={self.pp}, virtual_pp={self.virtual_pp}; set pp >= 2 and "
                           f"virtual_pp=2")
        elif self.virtual_pp > 1 and self.schedule != "interleaved":
            out.append(f"virtual_pp={self.virtual_pp} needs schedule='interleaved' or 'zbv' (gpipe, 1f1b and zb1p run "
                       f"one chunk per rank), got schedule={self.schedule!r}; set schedule=interleaved or "
                       f"virtual_pp=1")
        if self.schedule == "zb1p" and self.pp < 2:
            out.append("schedule='zb1p' splits the backward to fill pipeline bubbles and needs pp >= 2; use "
                       "schedule=1f1b with pp=1")
        if self.schedule == "interleaved" and self.num_micro_batches % self.pp:
            out.append(f"the interleaved schedule needs num_micro_batches ({self.num_micro_batches}) divisible by "
                       f"pp ({self.pp}); use a multiple of {self.pp} micro-batches")
        if self.sequence_parallel and self.tp == 1:
            out.append("sequence_parallel=true needs tp > 1 (it shards what tensor parallelism replicates); "
                       "set tp >= 2 or sequence_parallel=false")
        if self.ep > 1:
            out += self._expert_parallel_refusals()
        if self.cp > 1 and self.hsdp_shard is not None:
            out.append(f"cp={self.cp} with hsdp_shard={self.hsdp_shard}: HSDP's shard groups are not laid out over "
                       f"the dp x cp ranks yet; use hsdp_shard=None (ZeRO-3 shards over all dp * cp ranks)")
        out += knob_conflicts(zero_stage=self.zero_stage, offload=self.offload, schedule=self.schedule,
                              checkpointing=self.checkpointing)
        if self.hsdp_shard is not None:
            s = self.hsdp_shard
            if self.zero_stage != 3:
                out.append(f"hsdp_shard={s!r} is ZeRO-3's shard group and needs zero_stage=3, got zero_stage="
                           f"{self.zero_stage}; set zero_stage=3 or hsdp_shard=None")
            elif not isinstance(s, int) or isinstance(s, bool) or not 1 < s < self.dp or self.dp % s:
                out.append(f"hsdp_shard={s!r} must be a divisor of dp={self.dp} between 2 and dp-1 (groups of "
                           f"hsdp_shard dp ranks shard, the dp/hsdp_shard groups replicate); use None to shard "
                           f"over all of dp")
        if not self.reshard_after_forward and self.zero_stage != 3:
            out.append(f"reshard_after_forward=false keeps ZeRO-3's gathered parameters through backward and needs "
                       f"zero_stage=3, got zero_stage={self.zero_stage}; set zero_stage=3 or reshard_after_forward=true")
        if self.checkpointing == "tensor":
            out += self._tensor_remat_refusals()
        if self.compile:
            out += compile_refusals(schedule=self.schedule, offload=self.offload, checkpointing=self.checkpointing,
                                    cp=self.cp, ep=self.ep)
        if self.stage_boundaries is not None:
            b = self.stage_boundaries
            if len(b) != self.n_stages - 1:
                out.append(f"stage_boundaries has {len(b)} entries for pp*virtual_pp = {self.n_stages} stages; "
                           f"give {self.n_stages - 1} layer-chain indexes, or none to spread the blocks evenly")
            elif any(not isinstance(x, int) or isinstance(x, bool) for x in b) or list(b) != sorted(set(b)) \
                    or (b and b[0] < 1):
                out.append(f"stage_boundaries {list(b)} must be strictly increasing layer-chain indexes >= 1 "
                           f"(0 is the embedding, on the first stage)")
            elif blocks is not None and b and b[-1] > blocks + 1:
                out.append(f"stage_boundaries {list(b)} go past the head (chain index {blocks + 1} of a model "
                           f"with {blocks} blocks); every stage needs a layer")
        if world_size is not None and self.world_size != world_size:
            out.append(f"dp*cp*tp*pp = {self.dp}*{self.cp}*{self.tp}*{self.pp} = {self.world_size} but the job has "
                       f"{world_size} devices; choose knobs whose product is {world_size}")
        if blocks is not None and self.stage_boundaries is None and self.n_stages > blocks:
            out.append(f"pp*virtual_pp = {self.n_stages} stages but the model has {blocks} blocks; use at most "
                       f"{blocks} stages")
        if heads is not None and heads % self.tp:
            out.append(f"tp={self.tp} must divide the attention heads ({heads}); use a divisor of {heads}")
        if heads is not None and self.cp_mode == "ulysses" and heads % (self.tp * self.cp):
            out.append(f"cp_mode='ulysses' gives each of tp*cp = {self.tp * self.cp} ranks its share of the attention "
                       f"heads ({heads}); use a cp dividing {heads // math.gcd(heads, self.tp)} or cp_mode='ring'")
        return out

    def _expert_parallel_refusals(self) -> list[str]:
        out = expert_parallel_refusals(self.ep, tp=self.tp, zero_stage=self.zero_stage, offload=self.offload)
        if self.dp_cp % self.ep:
            out.append(f"ep={self.ep} takes its expert groups from the dp*cp = {self.dp_cp} data ranks; use an ep "
                       f"dividing {self.dp_cp}, or raise dp")
        return out

    def _tensor_remat_refusals(self) -> list[str]:
        """What ``checkpointing="tensor"`` does not run with yet: its executor recomputes one op at a
        time in backward and never runs a collective again (tp, sp and cp exchanges are kept, not
        recomputed), but ZeRO-3 would then hold gathered parameters, offload brackets wrap its
        savers and split backward unpacks twice."""
        out, fix = [], "use checkpointing='dag' or 'full' with it"
        if self.zero_stage == 3:
            out.append(f"checkpointing='tensor' with zero_stage=3: a recompute reading a block's gathered parameters "
                       f"would hold them from forward to backward (ZeRO-3 frees them after forward); {fix}, or "
                       f"zero_stage <= 2")
        if self.offload == "activations":
            out.append(f"checkpointing='tensor' with offload='activations' is not supported (the offload brackets "
                       f"wrap savers the executor runs again); {fix}, or offload='none'")
        if self.split_backward:
            out.append(f"checkpointing='tensor' recomputes for one backward; schedule={self.schedule!r} splits each "
                       f"backward in two (input and weight halves); use schedule=1f1b, gpipe or interleaved")
        return out

    def validate(self, *, world_size: int | None = None, blocks: int | None = None,
                 heads: int | None = None) -> None:
        """Raise :class:`ConfigError` listing every broken rule (see :meth:`problems`)."""
        found = self.problems(world_size=world_size, blocks=blocks, heads=heads)
        if found:
            raise ConfigError("invalid parallel config: " + "; ".join(found))

    # ------------------------------------------------------------------------------- round trip
    def knobs(self) -> dict[str, Any]:
        """The values of :data:`KNOBS` (what ``fix=`` takes to reproduce this config)."""
        return {k: getattr(self, k) for k in KNOBS}

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if out["stage_boundaries"] is not None:
            out["stage_boundaries"] = list(out["stage_boundaries"])
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"parallel config: unknown field(s) {', '.join(unknown)}; fields are "
                              f"{', '.join(sorted(names))}")
        data = dict(data)
        if data.get("stage_boundaries") is not None:
            data["stage_boundaries"] = tuple(data["stage_boundaries"])
        return cls(**data)

    def replace(self, **changes: Any) -> ParallelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def text(self) -> str:
        """One line, ``dp=2 tp=1 pp=2 ...``: the knobs that differ from a single device's, then dtype."""
        default = ParallelConfig()
        parts = [f"{k}={v}" for k, v in self.knobs().items() if v != getattr(default, k) or k in ("dp", "tp", "pp")]
        parts.append(f"dtype={self.dtype}")
        if self.stage_boundaries is not None:
            parts.append("stages@" + ",".join(map(str, self.stage_boundaries)))
        return " ".join(parts)

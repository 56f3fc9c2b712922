"""Every ``node.meta`` / ``gm.meta`` key this project writes, and the dataclass stored under it.

One key per owning pass, one frozen dataclass per key. Sizes are sympy expressions: integers
when the input dims are concrete, polynomials in the named dims (``batch``, ``seq``) otherwise.

Which keys live in ``node.meta`` and which in ``gm.meta``, which pass writes each, and which
nodes must carry a node key once a pass provides it: the one table :data:`KEYS` at the end of this
module (the pass manager's checks and messages derive from it). Each key's value is the dataclass
defined beside the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import sympy
import torch

# Node keys
SHAPE = "shape"
FLOPS = "flops"
MEMORY = "memory"
# Graph keys
CAPTURE = "capture"
FLOP_SUMMARY = "flop_summary"
MEMORY_SUMMARY = "memory_summary"

# torch.export writes these; we read them, never write them.
EXPORT_VAL = "val"
EXPORT_MODULE_STACK = "nn_module_stack"
CAPTURE_WRAPPER = "model"
"""Attribute of the training-step wrapper that capture exports, holding the user's model (its
module paths start with ``model.``; :func:`module_path` strips it)."""


def module_path(node) -> str:
    """Dotted path of the innermost user module an fx node came from (``""`` for top level), from
    export's ``nn_module_stack``."""
    stack = node.meta.get(EXPORT_MODULE_STACK) or {}
    # torch.export marks nodes it made outside any module with this placeholder key.
    stack = {k: v for k, v in stack.items() if k != "_empty_nn_module_stack_from_metadata_hook"}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if path == CAPTURE_WRAPPER:
        return ""
    prefix = CAPTURE_WRAPPER + "."
    return path[len(prefix):] if path.startswith(prefix) else path


def dim_symbol(name: str) -> sympy.Symbol:
    """The sympy symbol of a named input dim (positive integer)."""
    return sympy.Symbol(name, positive=True, integer=True)


Size = sympy.Expr  # an element count or byte count; sympy.Integer when concrete


DUMP_IF_SET = {"dump_if_set": True}
"""Field metadata: the IR dumps leave the field out while it is None (a fact most graphs lack)."""

@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One tensor input of a captured graph.

    ``shape`` entries are ints or names of symbolic dims (e.g. ``"batch"``, ``"seq"``); the same
    name in two inputs is the same dim. Integer inputs (token ids, labels) take values in
    ``[0, high)``.
    """

    name: str
    shape: tuple[int | str, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None

    def dim_names(self) -> tuple[str, ...]:
        return tuple(d for d in self.shape if isinstance(d, str))


@dataclass(frozen=True, kw_only=True)
class DimBound:
    """A named dim's allowed sizes, ``low <= size <= high`` (``high`` None: unbounded), and what
    bounds it (``reason``: an export guard, or the table a position index reads)."""

    name: str
    low: int = 1
    high: int | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ValueBound:
    """An integer input's allowed values, ``low <= v < high`` (``allowed``: values also accepted,
    e.g. a loss's ``ignore_index``), and what bounds them (``reason``: the embedding table the ids
    index, or the loss's number of classes)."""

    name: str
    low: int = 0
    high: int
    allowed: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class InputBounds:
    """What a batch must satisfy beyond the inputs' shapes and dtypes, read from the captured
    graph (:mod:`passes.capture.input_bounds`): the named dims' ranges and the integer inputs' values."""

    dims: tuple[DimBound, ...] = ()
    values: tuple[ValueBound, ...] = ()

    def dim(self, name: str) -> DimBound | None:
        return next((b for b in self.dims if b.name == name), None)

    def value(self, name: str) -> ValueBound | None:
        return next((b for b in self.values if b.name == name), None)


@dataclass(frozen=True, kw_only=True)
class CaptureInfo:
    """How a graph was captured: ``gm.meta[CAPTURE]``.

    ``dims`` maps every named dim to the value used as its example (its *hint*); ``symbolic``
    lists the dims kept symbolic (the rest were specialized to their hint).
    """

    model: str  # spec string or class name of the user's module
    inputs: tuple[InputSpec, ...]
    dims: tuple[tuple[str, int], ...]
    symbolic: tuple[str, ...]
    device: str  # device type the graph's programs run on ("cpu", "cuda")
    dtype: torch.dtype  # floating dtype of parameters and activations
    tied: tuple[tuple[str, ...], ...] = ()  # names of each parameter the module lists under several names
    bounds: InputBounds = InputBounds()  # the batches the graph takes (named dims' ranges, token id ranges)

    def canonical_names(self) -> dict[str, str]:
        """Alias -> canonical (first) name of every tied parameter's names."""
        return {alias: names[0] for names in self.tied for alias in names}

    def hint(self, name: str) -> int:
        return dict(self.dims)[name]

    def symbols(self) -> dict[sympy.Symbol, int]:
        """Each symbolic dim's symbol and its hint value."""
        return {dim_symbol(n): v for n, v in self.dims if n in self.symbolic}


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Shape and dtype of one tensor; ``shape`` entries are sympy expressions."""

    shape: tuple[sympy.Expr, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*self.shape) if self.shape else sympy.Integer(1)

    @property
    def nbytes(self) -> sympy.Expr:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sympy.expand(self.numel * itemsize)


@dataclass(frozen=True, kw_only=True)
class ShapeMeta:
    """``node.meta[SHAPE]``: the tensors a node produces, flattened in output order.

    ``value`` is set instead for nodes that produce a size (``sym_size``) or a Python scalar.
    """

    tensors: tuple[TensorMeta, ...] = ()
    value: sympy.Expr | None = None

    @property
    def tensor(self) -> TensorMeta:
        """The single tensor output (raises if the node has none or several)."""
        if len(self.tensors) != 1:
            raise ValueError(f"node has {len(self.tensors)} tensor outputs, expected 1")
        return self.tensors[0]


@dataclass(frozen=True, kw_only=True)
class FlopMeta:
    """``node.meta[FLOPS]``: floating-point operations of one node, forward and backward.

    Only matmul-class work is counted (matmul, linear, convolution, attention), as
    ``torch.utils.flop_counter`` does: one multiply-add is 2 FLOPs. ``kind`` names the
    formula used ("matmul", "conv", "attention", or "none").
    """

    fwd: sympy.Expr
    bwd: sympy.Expr
    kind: str = "none"


@dataclass(frozen=True, kw_only=True)
class FlopSummary:
    """``gm.meta[FLOP_SUMMARY]``: FLOPs of one forward and one backward of the whole graph.

    ``fwd``/``bwd`` count MoE experts under routing (``node.meta[MOE].flop_scale``);
    ``captured_fwd``/``captured_bwd`` are the graph as captured (a dense-form MoE runs every expert
    on every token), None where no node was scaled."""

    fwd: sympy.Expr
    bwd: sympy.Expr
    captured_fwd: sympy.Expr | None = field(default=None, metadata=DUMP_IF_SET)
    captured_bwd: sympy.Expr | None = field(default=None, metadata=DUMP_IF_SET)


@dataclass(frozen=True, kw_only=True)
class SavedTensor:
    """A storage autograd keeps alive for a node's backward.

    ``owner`` is the node whose output the storage is (a graph input, an earlier activation, or
    this node itself for tensors made inside the op, such as a dropout mask); ``nbytes`` counts
    the whole storage (views of one storage count once).
    """

    owner: str
    nbytes: sympy.Expr


@dataclass(frozen=True, kw_only=True)
class MemoryMeta:
    """``node.meta[MEMORY]``: bytes tied to one node.

    * ``output_bytes``: new storage the node's forward allocates (0 for views).
    * ``saved``: storages autograd saves for this node's backward (what it really saves) and
      keeps on the device.
    * ``offloaded``: storages autograd saves for this node's backward that an activation-offload
      region moves to the host and the node does not also keep on the device.
    * ``kept_bytes``: bytes of this node's own outputs (or internals) that some backward keeps
      alive; summed over nodes this is the activation memory of one forward, with no storage
      counted twice.
    * ``param_bytes``/``grad_bytes``/``optimizer_bytes``: for parameter nodes (``get_attr``).
    """

    output_bytes: sympy.Expr = sympy.Integer(0)
    saved: tuple[SavedTensor, ...] = ()
    offloaded: tuple[SavedTensor, ...] = ()
    kept_bytes: sympy.Expr = sympy.Integer(0)
    param_bytes: sympy.Expr = sympy.Integer(0)
    grad_bytes: sympy.Expr = sympy.Integer(0)
    optimizer_bytes: sympy.Expr = sympy.Integer(0)


@dataclass(frozen=True, kw_only=True)
class MemorySummary:
    """``gm.meta[MEMORY_SUMMARY]``: memory of one training step of the whole graph (bytes).

    ``peak_bytes`` comes from a liveness analysis over forward, backward and the optimizer step;
    ``peak_phase`` and ``peak_node`` say where it happens (at the dims' hint values). With
    symbolic dims ``peak_bytes`` may be a ``sympy.Max`` of the candidate points (see
    ``passes.analysis.liveness``). ``activation_bytes`` sums ``kept_bytes`` over non-input nodes;
    ``input_bytes`` is the bytes of graph inputs that autograd saves (e.g. token ids).
    """

    param_count: sympy.Expr
    param_bytes: sympy.Expr
    grad_bytes: sympy.Expr
    optimizer_bytes: sympy.Expr
    activation_bytes: sympy.Expr
    input_bytes: sympy.Expr
    peak_bytes: sympy.Expr
    peak_phase: str
    peak_node: str
    optimizer: str
    dtype: str
    """The training dtype counted (``fp32``, ``bf16``, ``fp16``; 16-bit: fp32 masters and optimizer state)."""
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Bytes of non-parameter buffers (e.g. batch-norm running stats): live through the step and
    # part of the peak, but neither trained nor activations.
    buffer_bytes: sympy.Expr = sympy.Integer(0)


# --- annotate_blocks ------------------------------------------------------------------------
BLOCK = "block"
LAYER_CHAIN = "layer_chain"


@dataclass(frozen=True, kw_only=True)
class BlockMeta:
    """``node.meta[BLOCK]``: where a node sits in the model's layer chain.

    ``index``: 0 for the embedding (everything before the first block), ``1 .. L`` for the
    blocks, ``L + 1`` for the head (everything after the last one); ``name``: ``"embedding"``,
    the block's module path (``"blocks.3"``) or ``"head"``.
    """

    index: int
    name: str

    @property
    def in_block(self) -> bool:
        """Whether the node belongs to one of the repeated blocks."""
        return self.name not in CHAIN_ENDS


CHAIN_ENDS = ("embedding", "head", "model")
"""Names of the chain indexes that are not blocks (``model``: a graph without blocks)."""


@dataclass(frozen=True, kw_only=True)
class LayerChain:
    """``gm.meta[LAYER_CHAIN]``: the repeated blocks of the model (module paths, in graph order)
    and the containers they were found in (``("blocks",)``; a CNN's stages: ``("layer1", ...)``).
    A model without repeated blocks has none: its whole graph is index 0."""

    blocks: tuple[str, ...]
    containers: tuple[str, ...] = ()

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)

    @property
    def names(self) -> tuple[str, ...]:
        """Name of every chain index: ``("embedding", *blocks, "head")``."""
        return ("embedding", *self.blocks, "head")


# --- pipeline_split ------------------------------------------------------------------------
# Node key (and gm.meta key of each stage module): int stage index. The split's own result,
# :class:`PipelineSplit`, is returned, not stored in meta.
PIPELINE_STAGE = "pipeline_stage"
STAGE_IO = "stage_io"
"""``gm.meta[STAGE_IO]`` on a stage program while it is lowered: its :class:`StageIO` as the
split made it (global shapes), which the sequence-parallel rewrite reads to keep boundary
tensors sharded."""


@dataclass(frozen=True, kw_only=True)
class StageAssignment:
    """Where each node of a graph runs: ``stage_of[node.name]`` in ``0..n_stages-1``.

    Covers every node but the output. Stages never decrease along data dependencies.
    Graph inputs carry the earliest stage reading them, parameters their first user's stage.
    """

    n_stages: int
    stage_of: dict[str, int] = field(hash=False)


@dataclass(frozen=True, kw_only=True)
class StageInput:
    """One positional input of a stage program, in order.

    * ``source`` is the stage it is received from (a boundary tensor), or ``None``: a graph
      input (token ids, targets) fed by the runtime, or, when ``value`` is set, a size (int)
      the runtime evaluates from the micro-batch's named dims.
    * ``meta``: static shape (sympy, symbolic dims allowed) and dtype; ``None`` for a size.
    """

    name: str
    source: int | None
    meta: TensorMeta | None
    value: sympy.Expr | None = None

    @property
    def kind(self) -> str:
        """``"recv"``, ``"graph_input"`` or ``"size"``."""
        if self.value is not None:
            return "size"
        return "graph_input" if self.source is None else "recv"


@dataclass(frozen=True, kw_only=True)
class StageOutput:
    """One element of the tuple a stage program returns, in order.

    ``dests``: stages it is sent to (empty for a graph output only); ``graph_output``: its
    index among the original graph's outputs (the loss is 0), or ``None``.
    """

    name: str
    meta: TensorMeta
    dests: tuple[int, ...]
    graph_output: int | None = None


@dataclass(frozen=True, kw_only=True)
class StageIO:
    """The send/recv contract of one stage: ordered inputs and outputs."""

    stage: int
    inputs: tuple[StageInput, ...]
    outputs: tuple[StageOutput, ...]


@dataclass(frozen=True, kw_only=True)
class PipelineSplit:
    """Result of ``split_pipeline_stages``: one ``fx.GraphModule`` per stage and its contract.

    * ``modules[s]``: stage ``s``'s program; parameters under their original names.
    * ``io[s]``: its :class:`StageIO`.
    * ``tied``: canonical parameter name -> stages holding a copy of it; the runtime sums
      (all-reduces) those copies' gradients. ``aliases[name]``: every name of that parameter
      (``("wte.weight", "lm_head.weight")``); each stage holds the copy under the alias(es) it reads.
    * ``skip``: ``"relay"`` (tensors hop stage to stage) or ``"direct"`` (producer to consumer).
    """

    assignment: StageAssignment
    modules: tuple = field(hash=False)  # tuple[torch.fx.GraphModule, ...]
    io: tuple[StageIO, ...]
    tied: dict[str, tuple[int, ...]] = field(hash=False)
    aliases: dict[str, tuple[str, ...]] = field(hash=False)
    skip: str

    @property
    def n_stages(self) -> int:
        return self.assignment.n_stages


# ---------------------------------------------------------------------------------------------
# Activation checkpointing (passes/policies/checkpoint_policy.py decides, passes/rewrites/apply_checkpoint.py rewrites)
CHECKPOINT = "checkpoint"
CHECKPOINT_PLAN = "checkpoint_plan"


@dataclass(frozen=True, kw_only=True)
class CheckpointMeta:
    """``node.meta[CHECKPOINT]``: the checkpoint region a node belongs to (``None``: none) and
    whether that region is recomputed in backward, under ``policy``."""

    region: int | None
    recompute: bool
    policy: str


@dataclass(frozen=True, kw_only=True)
class CheckpointRegion:
    """One checkpointable region: a contiguous run of compute nodes with its inputs and outputs.

    * ``recompute_flops``: forward FLOPs run again in backward if recomputed.
    * ``bytes_saved``: saved-activation bytes the plan drops because this region is recomputed
      (for a region not recomputed: what recomputing it alone, on top of the plan, would drop).
    * ``submodule``: attribute name of its ``fx.GraphModule`` once ``apply_checkpoint`` ran.
    """

    index: int
    name: str  # e.g. "blocks.2" or "blocks.2.attn (core)"
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    recompute: bool
    recompute_flops: sympy.Expr
    bytes_saved: sympy.Expr
    submodule: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointPlan:
    """``gm.meta[CHECKPOINT_PLAN]``: what the checkpoint policy decided (bytes, FLOPs).

    ``saved_bytes_before``/``saved_bytes_after``: bytes autograd keeps for backward after one
    forward (activations and saved graph inputs, storages counted once, parameters excluded)
    without checkpointing and with this plan. ``budget_bytes`` is the solver's budget.
    """

    policy: str
    regions: tuple[CheckpointRegion, ...]
    recompute_flops: sympy.Expr
    saved_bytes_before: sympy.Expr
    saved_bytes_after: sympy.Expr
    budget_bytes: int | None = None


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (passes/policies/tensor_parallel_patterns.py tags, passes/rewrites/apply_tensor_parallel.py rewrites)
TENSOR_PARALLEL = "tensor_parallel"
TENSOR_PARALLEL_PLAN = "tensor_parallel_plan"


@dataclass(frozen=True, kw_only=True)
class TPMeta:
    """``node.meta[TENSOR_PARALLEL]``: how a node runs under Megatron-style tensor parallelism.

    ``role``: ``"column"`` (linear, output features sharded), ``"row"`` (linear, input features
    sharded, output all-reduced), ``"vocab_embedding"``, ``"vocab_head"`` (LM head, vocabulary
    sharded), ``"vocab_loss"`` (cross-entropy over vocabulary-sharded logits), ``"sharded"`` (an
    op inside a tensor-parallel region), ``"sequence"`` (sequence parallelism: runs on this rank's
    chunk of the sequence, ``shard_dim`` being that sequence dim), or ``"replicated"``. ``shard_dim``: the output dim that is
    split across tp ranks (``None``: replicated output). ``sections``: global sizes of the
    contiguous sections of that dim (fused q/k/v: three), each split evenly across ranks.
    ``reason``: why the node is (not) sharded, for dumps.
    """

    role: str
    shard_dim: int | None = None
    sections: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ParamSharding:
    """How one parameter is split across tp ranks: along ``dim`` (``None``: replicated), each of
    ``sections`` (global sizes along ``dim``) split evenly; ``reason`` says why."""

    dim: int | None
    sections: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class TensorParallelPlan:
    """``gm.meta[TENSOR_PARALLEL_PLAN]``: the tp degree tagged for and every parameter's
    :class:`ParamSharding` (by qualified name); ``rank`` is set on a rewritten rank program.
    ``sequence_parallel``: the rank program runs norms/residuals on sequence chunks;
    ``sequence_parallel_grads``: replicated parameters read there, whose gradients are partial per
    rank and must be summed over the tp group before the dp sync."""

    degree: int
    params: dict[str, ParamSharding] = field(hash=False)
    rank: int | None = None
    sequence_parallel: bool = False
    sequence_parallel_grads: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Activation / optimizer-state offload (passes/policies/offload_policy.py tags, passes/rewrites/apply_offload.py
# rewrites, runtime/kernels/offload.py and runtime/optim/optimizer_offload.py run it)
OFFLOAD = "offload"
OFFLOAD_PLAN = "offload_plan"


@dataclass(frozen=True, kw_only=True)
class OffloadMeta:
    """``node.meta[OFFLOAD]`` on every node that owns storages kept for backward.

    * ``offload``: those storages go to host memory after forward and come back for backward.
    * ``bytes``: their bytes (whole storages, each once; sympy in the named dims).
    * ``transfer_s``: seconds on the host link, both directions, at the dims' hints.
    * ``hidden_behind_s``: compute seconds between the node's forward and the first backward that
      reads them (forward of every later node + backward of every node after the last saver).
    * ``savers``: names of the nodes that save them (the nodes ``apply_offload`` brackets).
    """

    offload: bool
    bytes: sympy.Expr
    transfer_s: float
    hidden_behind_s: float
    reason: str
    savers: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class OffloadPlan:
    """``gm.meta[OFFLOAD_PLAN]``: what the offload policy decided.

    * ``nodes``: owners whose saved activations are offloaded; ``activation_bytes`` their bytes
      (moved to host and back once per step); ``link_s``: host-link seconds of those transfers.
    * ``target_bytes``: the byte target the greedy choice stopped at (``None``: no target).
    * ``optimizer_on_host``: optimizer state (fp32 master, Adam moments) lives on the host and
      the step runs there; ``optimizer_bytes_moved``: bytes over the link per step for it
      (gradients to host + parameters back), ``optimizer_state_bytes``: state kept on host.
    * ``regions``: filled by ``apply_offload``: number of bracketed saver nodes.
    """

    policy: str
    nodes: tuple[str, ...]
    activation_bytes: sympy.Expr
    link_s: float
    target_bytes: int | None
    optimizer_on_host: bool
    optimizer_bytes_moved: sympy.Expr
    optimizer_state_bytes: sympy.Expr
    optimizer_reason: str
    regions: int | None = None


# ---------------------------------------------------------------------------------------------
# DAG rematerialization under checkpointing="dag" (passes/policies/checkpoint_policy.py decides per op
# output which are kept and which recomputed; passes/rewrites/apply_checkpoint.py carries it out with
# torch's selective activation checkpointing).
REMAT = "remat"
DAG_CHECKPOINT_PLAN = "dag_checkpoint_plan"


@dataclass(frozen=True, kw_only=True)
class RematNodeMeta:
    """``node.meta[REMAT]`` on the nodes of a region checkpointed under the ``dag`` policy:
    ``cached`` nodes keep the outputs of their ops (views excluded) from forward to backward;
    the others run again when the region's forward is replayed in backward."""

    region: int
    cached: bool


TENSOR_REMAT = "tensor_remat"
TENSOR_REMAT_PLAN = "tensor_remat_plan"


@dataclass(frozen=True, kw_only=True)
class TensorRematMeta:
    """``node.meta[TENSOR_REMAT]``: a per-tensor decision of the whole-graph remat model
    (:mod:`passes.solvers.remat_solver`) on a plain (not checkpointed) graph, on every node the model
    decides (nodes without it are views, getitems, sizes: made again from their inputs when a
    recompute reads them). ``action``: ``recompute`` (backward finds this node's saved storages
    computed again on demand from its inputs: :class:`passes.rewrites.tensor_remat.TensorRemat`),
    ``save`` (kept from forward), ``none`` (nothing of it is kept for backward)."""

    action: Literal["save", "recompute", "none"]

    @property
    def recompute(self) -> bool:
        return self.action == "recompute"


@dataclass(frozen=True, kw_only=True)
class TensorRematPlan:
    """``gm.meta[TENSOR_REMAT_PLAN]``: what ``checkpointing="tensor"`` decided for this program
    (:func:`passes.policies.tensor_remat_policy.tensor_remat_policy`), at its concrete shapes.

    * ``budget_bytes``: bound on the activation bytes alive at every moment of backward when
      recomputes run on demand; ``peak_bytes``: the decision's (``feasible``: within the budget;
      else the lowest peak any decision reaches); ``none_peak_bytes``: with nothing recomputed.
    * ``recompute_flops``: forward FLOPs (matmul-class) run again in backward; ``recomputed``:
      names of the recomputed nodes, in forward order.
    * ``optimal``: the MILP proved it optimal (within its time limit).
    """

    budget_bytes: int
    peak_bytes: int
    none_peak_bytes: int
    recompute_flops: int
    recomputed: tuple[str, ...]
    feasible: bool
    optimal: bool


@dataclass(frozen=True, kw_only=True)
class DagCheckpointPlan:
    """``gm.meta[DAG_CHECKPOINT_PLAN]``: the ``dag`` policy's decision and what it is compared with.

    * ``budget_bytes``: bound on the bytes kept for backward after one forward (at the dims'
      hints); ``saved_bytes``: what the decision keeps (same count as
      ``CheckpointPlan.saved_bytes_after``). ``stage_budget_bytes``: with pipeline stages, each
      stage's own bound, on the storages its regions decide (empty without stages).
    * ``cached``: names of the nodes whose op outputs are kept inside checkpointed regions.
    * ``recompute_flops``: FLOPs run again in backward (matmul-class, at the hints);
      ``block_recompute_flops`` / ``block_saved_bytes``: block-level checkpointing's
      (``checkpoint_solver``'s choice of whole regions) at the same total budget, the baseline
      the decision never exceeds without stage bounds (with them it may: the baseline is not
      held to them).
    * ``method``: the remat solver that chose the kept outputs (``milp`` or ``min-cut``).
    """

    budget_bytes: int
    saved_bytes: int
    recompute_flops: int
    block_recompute_flops: int
    block_saved_bytes: int
    cached: tuple[str, ...]
    method: str
    stage_budget_bytes: tuple[int, ...] = ()


# ---------------------------------------------------------------------------------------------
# The keys of the rank programs' other records (their dataclasses live with their ops)

# --- annotate_moe ---------------------------------------------------------------------------
MOE = "moe"
MOE_LAYERS = "moe_layers"


@dataclass(frozen=True, kw_only=True)
class MoeNodeMark:
    """``node.meta[MOE]``: a matmul-class node of an MoE block (router, routed expert or shared
    expert), written by :mod:`passes.analysis.annotate_moe` on those nodes only.

    ``flop_scale``: what ``annotate_flops`` multiplies the node's counted FLOPs by so that they are
    the FLOPs under routing: ``top_k / experts * imbalance`` for a routed expert captured in the
    dense form (every expert runs on every token), ``imbalance`` for one captured gathered (one
    row per token and choice), 1 for the router and shared experts."""

    block: str
    """The router node's name (names the block in :class:`MoeLayers`)."""
    role: Literal["router", "expert", "shared"]
    expert: int | None = None
    """Routed expert index in the dense form; None for the router, shared experts and a gathered op."""
    flop_scale: sympy.Expr = sympy.Integer(1)


@dataclass(frozen=True, kw_only=True)
class MoeBlock:
    """One mixture-of-experts block: a router matmul feeding softmax (or sigmoid) and top-k whose
    weights scale the combine of ``experts`` parallel expert MLPs."""

    router: str
    """The router's matmul node."""
    router_weight: str
    """The router's parameter (``get_attr`` target)."""
    topk: str
    """The ``topk`` node."""
    layer: str
    """The block of the layer chain it lies in (``BlockMeta.name``)."""
    experts: int
    top_k: int
    expert_hidden: int
    """The experts' hidden size (the contraction dim of each expert's last matmul)."""
    form: Literal["dense", "gathered"]
    """``dense``: E expert MLPs each on every token, unchosen experts weighted 0 (zoo ``moe``);
    ``gathered``: expert weights indexed by the top-k ids, one row per (token, choice) (HF ``batched_mm``)."""
    expert_params: tuple[tuple[str, ...], ...]
    """Per routed expert its parameters; a stacked ``[E, ...]`` parameter is named ``name[e]``."""
    expert_nodes: tuple[str, ...]
    """The routed experts' matmul nodes (each carries a :class:`MoeNodeMark`)."""
    shared_experts: int = 0
    shared_hidden: int | None = None
    shared_params: tuple[tuple[str, ...], ...] = ()
    imbalance: float = 1.0
    """Load of the busiest expert over the balanced load (tokens * top_k / experts); FLOPs count
    every expert at the balanced load times this. The plan will state it."""
    aux_loss: tuple[str, ...] = ()
    """Nodes of this block's load-balancing loss (``f_e * P_e`` products), if found."""


@dataclass(frozen=True, kw_only=True)
class MoeLayers:
    """``gm.meta[MOE_LAYERS]``: the MoE blocks of the graph (empty for a dense model) and the
    nodes of a load-balancing loss computed outside the blocks (HF ``load_balancing_loss_func``)."""

    blocks: tuple[MoeBlock, ...] = ()
    aux_loss: tuple[str, ...] = ()


CONTEXT_PARALLEL = "context_parallel"
"""``gm.meta`` key of :class:`passes.ir.cp_ops.ContextParallelPlan` (written by
:mod:`passes.rewrites.context_parallel`)."""
EXPERT_PARALLEL = "expert_parallel"
"""``gm.meta[EXPERT_PARALLEL]``: the :class:`passes.ir.moe_ops.ExpertParallelPlan` of a stage program
under ``ep > 1`` (written by :mod:`passes.rewrites.expert_parallel`)."""
ZERO3_PLAN = "zero3_plan"
"""``gm.meta[ZERO3_PLAN]``: the :class:`passes.ir.zero3_ops.Zero3Plan` of a stage program under
``zero_stage=3`` (written by :mod:`passes.rewrites.shard_parameters`)."""


# ---------------------------------------------------------------------------------------------
# Every key, where it lives and who writes it: the pass manager's checks and messages read this

@dataclass(frozen=True, kw_only=True, slots=True)
class KeySpec:
    """What the pass manager knows of one meta key."""

    scope: Literal["node", "graph"]
    """``node``: ``node.meta[key]``; ``graph``: ``gm.meta[key]``."""
    owner: str
    """The pass (or function) that writes it: named when a pipeline lacks it."""
    covers: Literal["values", "computes"] | None = None
    """For node keys a pass provides: which nodes carry it after (``values``: every node that
    produces a value, the output excluded; ``computes``: call nodes only); None: graph keys and
    marks written on the nodes a decision picks."""


KEYS: dict[str, KeySpec] = {
    CAPTURE: KeySpec(scope="graph", owner="passes.capture.capture.capture_model"),
    SHAPE: KeySpec(scope="node", owner="annotate_shapes", covers="values"),
    BLOCK: KeySpec(scope="node", owner="annotate_blocks", covers="values"),
    LAYER_CHAIN: KeySpec(scope="graph", owner="annotate_blocks"),
    FLOPS: KeySpec(scope="node", owner="annotate_flops", covers="computes"),
    FLOP_SUMMARY: KeySpec(scope="graph", owner="annotate_flops"),
    MEMORY: KeySpec(scope="node", owner="annotate_memory", covers="values"),
    MEMORY_SUMMARY: KeySpec(scope="graph", owner="annotate_memory"),
    CONTEXT_PARALLEL: KeySpec(scope="graph", owner="context_parallel"),
    TENSOR_PARALLEL: KeySpec(scope="node", owner="tag_tensor_parallel", covers="values"),
    TENSOR_PARALLEL_PLAN: KeySpec(scope="graph", owner="tag_tensor_parallel"),
    CHECKPOINT: KeySpec(scope="node", owner="checkpoint_policy", covers="values"),
    CHECKPOINT_PLAN: KeySpec(scope="graph", owner="checkpoint_policy"),
    REMAT: KeySpec(scope="node", owner="checkpoint_policy"),
    DAG_CHECKPOINT_PLAN: KeySpec(scope="graph", owner="checkpoint_policy"),
    OFFLOAD: KeySpec(scope="node", owner="offload_policy"),
    OFFLOAD_PLAN: KeySpec(scope="graph", owner="offload_policy"),
    PIPELINE_STAGE: KeySpec(scope="node", owner="tag_pipeline_stages", covers="values"),
    STAGE_IO: KeySpec(scope="graph", owner="passes.lowering.lower.lower"),
    TENSOR_REMAT: KeySpec(scope="node", owner="tensor_remat_policy"),
    TENSOR_REMAT_PLAN: KeySpec(scope="graph", owner="tensor_remat_policy"),
    ZERO3_PLAN: KeySpec(scope="graph", owner="shard_parameters"),
    MOE: KeySpec(scope="node", owner="annotate_moe"),
    MOE_LAYERS: KeySpec(scope="graph", owner="annotate_moe"),
    EXPERT_PARALLEL: KeySpec(scope="graph", owner="apply_expert_parallel"),
}

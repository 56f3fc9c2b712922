"""Per-layer cost profile of a model: the layer chain the planner partitions into stages.

A :class:`ModelProfile` is ``embedding → blocks[0..L) → head``: the repeated transformer blocks
plus everything before them (embeddings, input dropout) and after them (final norm, LM head, loss).
Every number is **per sample** (one sequence of ``seq`` tokens, batch = 1): FLOPs and activation
bytes of these models are linear in the batch, so a micro-batch of ``b`` costs ``b`` times these.

:func:`profile_model` exploits the repetition: it captures the model with only ``sample_layers``
blocks (2 by default) on the meta device, runs the analysis passes (``annotate_flops``,
``annotate_memory``), measures ONE block and replicates it ``L`` times. GPT-3 175B profiles in
seconds, no weights allocated.
"""
from __future__ import annotations

import functools
import inspect
import math
import operator
from dataclasses import dataclass, replace

import sympy
from torch import fx

from passes.policies.checkpoint_policy import checkpoint_policy
from passes.ir.graph_modules import copy_graph_module
from passes.analysis.graph_view import to_networkx
from passes.solvers.remat_solver import plain_backward_peak, problem_from_view
from passes.policies.tensor_remat_policy import decide as decide_tensor_remat
from passes.rewrites.context_parallel import attention_problems, repeat_kv_source, sdpa_args
from passes.rewrites.sequence_parallel import sequence_parallel_refusal
from passes.rewrites.split_backward import held_gradient_nodes
from passes.analysis.weight_decay import no_weight_decay_names
from passes.ir.errors import AnalysisError, ConfigError, PassError
from partitioner.compile.analysis import analyze
from partitioner.inputs.model_spec import ModelSpec
from partitioner.inputs.models import build_model, format_spec, model_keys, parse_spec
from partitioner.zoo.registry import MIXED_LAYERS, REGISTRY, TABLES
from passes.ir.config import TORCH_DTYPES
from passes.ir.meta import BLOCK, CAPTURE, CHECKPOINT_PLAN, FLOPS, LAYER_CHAIN, MEMORY, MOE, MOE_LAYERS, SHAPE, dim_symbol

LAYER_KEYS = ("layers", "num_hidden_layers", "n_layer", "num_layers")
"""Spec keys that set the number of repeated blocks (zoo models, then Hugging Face names)."""

TENSOR_NOT_ASKED = ("not priced: pricing it solves a per-tensor remat MILP over the whole captured graph, "
                    "which the profile does only when asked (tensor_remat=True; choose_plan asks when "
                    "checkpointing='tensor' is pinned)")
"""``LayerProfile.tensor_refusal`` of a profile that was not asked to price ``tensor``."""

DAG_NOT_ASKED = ("not priced yet: a job's profile prices checkpointing='dag' (the dag policy over every block "
                 "of the captured graph) only where it can win: when pinned, or when the search finds memory "
                 "binding (partitioner.search.search.search's price_dag)")
"""``LayerProfile.dag_refusal`` of a profile made with ``dag=False`` and not priced since."""

TENSOR_TIME_LIMIT_S = 30.0
"""Seconds the profile's tensor remat MILP may take (all its solves together); past it the best
decision found prices ``tensor`` and ``LayerProfile.tensor_mip_gap`` says how far from optimal."""

GATHER_OPS = ("aten.embedding", "aten.index_select")
"""Ops that read only the rows of their first input (a table) that they write: they move about
their output's bytes of the table, not the whole table."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Kernel:
    """One matmul-class node of a layer (matmul, linear, conv, attention), ONE sample, no tensor
    parallelism: what the roofline needs to time it (``cost_model.roofline_time``)."""

    fwd_flops: int
    """Forward FLOPs (2 per multiply-add)."""
    bwd_flops: int
    """Backward FLOPs (input and weight gradients: two kernels of about half each)."""
    bytes: int
    """Activation bytes the forward reads and writes per sample: its non-parameter tensor inputs
    plus its outputs (linear in the micro-batch)."""
    weight_bytes: int = 0
    """Bytes of the parameters it reads (once per kernel, whatever the micro-batch)."""
    attention: bool = False
    """An attention-core kernel (what selective checkpointing recomputes): fused attention, or
    a matmul that makes or consumes the [s, s] scores of an unfused one (QKᵀ, probabilities·V)."""
    fused_attention: bool = False
    """A fused attention node (``scaled_dot_product_attention``): the kernel context parallelism
    replaces (ring attention) or runs on head shards (Ulysses)."""
    gathered_expert: bool = False
    """A routed expert's kernel of a block in the gathered form (one row per token and choice):
    under expert parallelism it runs on the ep group's rows, ``ep`` times its own."""


@dataclass(frozen=True, kw_only=True)
class LayerProfile:
    """Costs of one layer of the chain for ONE sample at the profile's sequence length."""

    name: str
    """``"embedding"``, ``"blocks.3"`` or ``"head"``."""
    param_count: int
    """Parameters owned by this layer (shared/tied weights excluded; see ModelProfile)."""
    param_bytes: int
    """Bytes of those parameters in the training dtype."""
    fwd_flops: int
    """Forward FLOPs per sample (matmul-class work, 2 per multiply-add)."""
    bwd_flops: int
    """Backward FLOPs per sample."""
    matmuls: int
    """Number of matmul-class kernels in the forward (sizes the per-kernel efficiency)."""
    ops: int = 0
    """Operators the forward dispatches (every call_function of the captured graph but tuple
    indexing): each costs the framework's per-op overhead, which dominates small models; the
    backward is charged twice as many (its kernels per forward op: about 2 for a GPT block)."""
    attention_flops: int
    """Forward FLOPs of attention-core kernels (QKᵀ, softmax·V): what selective
    checkpointing recomputes."""
    activation_bytes: int
    """Bytes saved for backward per sample (no tensor parallelism)."""
    replicated_activation_bytes: int
    """Part of ``activation_bytes`` whose trailing dim is the hidden size ([b, s, h]: norm inputs,
    residual adds, dropout masks): replicated over tensor-parallel ranks unless sequence
    parallelism shards it; the rest (QKV, MLP 4h, heads) is sharded by tensor parallelism."""
    attention_score_bytes: int
    """Part of ``activation_bytes`` with trailing dims [s, s] (attention scores, softmax, dropout
    mask of an unfused attention): dropped by selective checkpointing. 0 for fused SDPA/flash
    attention, which keeps only its output and log-sum-exp."""
    boundary_bytes: int
    """Bytes per sample of the tensor this layer hands the next one (the hidden state)."""
    saved_tensors: int = 0
    """Tensors saved for backward per micro-batch (nodes whose output autograd keeps): what
    activation offload moves one by one, each a copy out and one back."""
    tp_all_reduces: int
    """Tensor-parallel all-reduces of the boundary tensor per forward (and as many in backward):
    2 for a transformer block (attention and MLP outputs), 1 for embedding and head."""
    kernels: tuple[Kernel, ...] = ()
    """The layer's matmul-class nodes, each timed by the roofline (empty in profiles made before
    per-node costing: then ``matmuls`` equal kernels of ``fwd_flops`` are assumed)."""
    memory_bound_bytes: int = 0
    """Bytes the forward's other kernels (norms, softmax, elementwise ops, dropout, loss) read
    and write, per sample, whose tensors tensor parallelism shards (trailing dim not the hidden
    size: the MLP's 4h activations, vocab-parallel logits)."""
    replicated_memory_bound_bytes: int = 0
    """Bytes as ``memory_bound_bytes`` of the nodes whose output is a [.., h] tensor (layer norms,
    residual adds, dropout of the block outputs, embedding lookups): every tensor-parallel rank
    moves all of them unless sequence parallelism shards them."""
    score_memory_bound_bytes: int = 0
    """Part of ``memory_bound_bytes`` of the nodes with [s, s] outputs (mask, softmax, dropout of
    an unfused attention's scores): selective checkpointing reruns them. 0 for fused attention."""
    dag_activation_bytes: float | None = None
    """Bytes saved for backward per sample under ``checkpointing="dag"`` at its default budget
    (:func:`passes.policies.checkpoint_policy.dag_default_budget`), averaged over the blocks: the policy
    decides over the whole graph and may treat equal blocks differently. None: not profiled (the
    search then does not offer dag)."""
    dag_refusal: str = ""
    """Why ``dag`` is not priced (``dag_activation_bytes`` is None): what the policy said."""
    param_tensors: int = 0
    """Parameter tensors of the layer (tied ones left out, as in ``param_count``): what an
    unsharded optimizer steps one by one (``Device.optimizer_tensor_s`` each)."""
    param_runs: int = 0
    """Runs of consecutive parameters (in first-use order) in the same weight-decay group
    (:func:`passes.analysis.weight_decay.no_weight_decay_names`): the segments a ZeRO-1/2 optimizer cuts
    its flat chunk into."""
    dag_recompute_flops: float = 0.0
    """Forward FLOPs per sample that ``dag`` runs again in backward (the checkpointed block's
    nodes that keep no output), averaged over the blocks."""
    dag_checkpointed: float = 0.0
    """Fraction of the blocks ``dag`` checkpoints (each replays its memory-bound ops and its
    collectives in backward)."""
    tensor_activation_bytes: float | None = None
    """Bytes saved for backward per sample under ``checkpointing="tensor"`` at its default budget:
    the block's activations times the share the whole decision keeps
    (:func:`passes.policies.tensor_remat_policy.decide` on the whole graph; each stage decides on its own
    program, which the plan's memory replay prices exactly). None: not profiled (the search then
    does not offer it): the profile was not asked to (:data:`TENSOR_NOT_ASKED`), or the policy
    refused the graph."""
    tensor_refusal: str = ""
    """Why ``tensor`` is not priced (``tensor_activation_bytes`` is None)."""
    tensor_mip_gap: float | None = None
    """Relative optimality gap of the MILP decision ``tensor`` is priced from (0: proven optimal;
    above 0: :data:`TENSOR_TIME_LIMIT_S` cut it short; inf: no solution in time, priced as
    nothing recomputed); None when not priced."""
    tensor_recompute_flops: float = 0.0
    """Forward FLOPs per sample that ``tensor`` runs again in backward, averaged over the blocks."""
    tensor_recomputed_ops: float = 0.0
    """Fraction of a block's decided ops (those owning activations) that ``tensor`` recomputes,
    averaged over the blocks: the share of its memory-bound work and op overheads run again."""
    experts: int = 0
    """Routed experts of the layer's mixture-of-experts block (0: none)."""
    top_k: int = 0
    """Experts each token is routed to (0: no MoE block)."""
    expert_param_count: int = 0
    """Parameters of those routed experts (what expert parallelism spreads over its ranks)."""
    moe_form: str = ""
    """How the block holds its experts (:class:`passes.ir.meta.MoeBlock`): ``dense`` (one module
    per expert) or ``gathered`` (stacked weights indexed per row); ep spreads both."""
    held_grad_bytes: int = 0
    """Bytes per sample of the output gradients of the layer's weight-reading ops (no tensor
    parallelism): what a split backward (zero-bubble schedules) holds from a micro-batch's input
    half (I) to its weight half (W), which reads them (:func:`passes.rewrites.split_backward.held_gradient_nodes`)."""
    hidden_held_grad_bytes: int = 0
    """Part of ``held_grad_bytes`` from weight-reading ops that are not matmul-class with a [.., h]
    output (norm scales and shifts): replicated over tensor-parallel ranks unless sequence
    parallelism shards it."""
    tensor_working_bytes: float = 0.0
    """Bytes per sample that ``tensor``'s recomputes hold at the fullest moment of backward on top
    of what forward kept (the decision's backward peak minus its saved bytes, whole graph): held
    once per device, for the micro-batch whose backward runs."""


@dataclass(frozen=True, kw_only=True)
class AttentionProfile:
    """The attention of one block as context parallelism sees it (:mod:`passes.rewrites.context_parallel`):
    what the cp ops move and whether the rewrite can cut this model's sequence at all."""

    sites: int
    """``scaled_dot_product_attention`` nodes per block (each exchanges over the cp group)."""
    heads: int
    """Query heads."""
    kv_heads: int
    """Heads of the K and V the cp ops read: the kv heads of grouped-query attention (the rewrite
    reads the tensor before its ``repeat_kv``), else ``heads``."""
    head_dim: int
    causal: bool
    cp_refusal: str = ""
    """Why the cp rewrite cannot run on this model (an explicit mask, attention dropout, no
    ``seq`` dim); empty when it can."""


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """The layer chain ``embedding, *blocks, head`` with model facts the planner needs."""

    model: str
    """The spec string profiled (with the real layer count)."""
    seq: int
    """Sequence length every per-sample number is measured at."""
    dtype: str
    """Training dtype (``bf16``/``fp16`` mean mixed precision with fp32 master weights)."""
    hidden: int
    """Hidden size (the boundary tensor's last dim)."""
    heads: int
    """Attention heads; tensor parallelism must divide them."""
    embedding: LayerProfile
    blocks: tuple[LayerProfile, ...]
    head: LayerProfile
    shared_param_count: int = 0
    """Parameters used by both the embedding and the head (tied word embeddings): with several
    pipeline stages the first and the last stage each hold a copy."""
    shared_param_bytes: int = 0
    attention: AttentionProfile | None = None
    """The blocks' attention (None: no ``scaled_dot_product_attention`` in a block): what the
    search needs to offer and price context parallelism."""

    @functools.cached_property
    def dag_asked(self) -> bool:
        """Whether ``checkpointing="dag"`` was priced (or refused) on this profile's graph."""
        return not self.blocks or self.blocks[0].dag_refusal != DAG_NOT_ASKED

    @functools.cached_property
    def tensor_remat_asked(self) -> bool:
        """Whether the profile was asked to price ``checkpointing="tensor"`` (priced or refused)."""
        return not self.blocks or self.blocks[0].tensor_refusal != TENSOR_NOT_ASKED

    def sequence_parallel_refusal(self, tp: int, cp: int = 1) -> str:
        """Why sequence parallelism cannot run with ``tp`` x ``cp`` ranks on this model ("" when it
        can): the lowering's rule (:func:`passes.rewrites.sequence_parallel.sequence_parallel_refusal`) on
        the profiled sequence (``seq`` 0: the inputs name no sequence dim)."""
        return sequence_parallel_refusal(self.seq or None, tp, cp)

    @functools.cached_property
    def context_parallel(self) -> bool:
        """Whether the sequence can be cut over cp ranks (:mod:`passes.rewrites.context_parallel`)."""
        return self.attention is not None and not self.attention.cp_refusal and self.seq > 0

    @functools.cached_property
    def layers(self) -> tuple[LayerProfile, ...]:
        """The whole chain: embedding, blocks, head."""
        return (self.embedding, *self.blocks, self.head)

    @functools.cached_property
    def experts(self) -> int:
        """Routed experts every MoE block divides into (their gcd; 0 for a dense model): the ep
        degrees the search offers divide it."""
        return math.gcd(*(b.experts for b in self.blocks)) if any(b.experts for b in self.blocks) else 0

    @functools.cached_property
    def ep_refusal(self) -> str:
        """Why expert parallelism cannot spread this model's experts (empty when it can)."""
        if not self.experts:
            return "the model has no mixture-of-experts block"
        return ""

    @functools.cached_property
    def param_count(self) -> int:
        """All parameters, shared ones once."""
        return sum(layer.param_count for layer in self.layers) + self.shared_param_count

    @functools.cached_property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers) + self.shared_param_bytes

    @functools.cached_property
    def fwd_flops(self) -> int:
        """Forward FLOPs per sample."""
        return sum(layer.fwd_flops for layer in self.layers)

    @functools.cached_property
    def bwd_flops(self) -> int:
        """Backward FLOPs per sample."""
        return sum(layer.bwd_flops for layer in self.layers)

    @functools.cached_property
    def activation_bytes(self) -> int:
        """Saved activation bytes per sample, all layers."""
        return sum(layer.activation_bytes for layer in self.layers)


def _int(expr, subs: dict | None = None) -> int:
    value = sympy.sympify(expr)
    if subs and not value.is_Integer:
        value = value.xreplace(subs)
    if not value.is_Integer:
        raise AnalysisError(f"profile expected a concrete number, got {value}; capture with concrete dims")
    return int(value)


def _spec_defaults(name: str) -> dict[str, object]:
    """The registered defaults of model ``name``'s keys (hf-* builders take any key: these name theirs)."""
    return TABLES[name][1] if name in TABLES else {}


def _layer_count_key(name: str, kwargs: dict) -> str | None:
    keys = model_keys(name)
    for key in LAYER_KEYS:
        if key in kwargs or (keys is not None and key in keys) or key in _spec_defaults(name):
            return key
    return None


def _default_layers(name: str, key: str) -> int:
    defaults = _spec_defaults(name)
    if key in defaults:
        return int(defaults[key])
    param = inspect.signature(REGISTRY[name][0]).parameters.get(key)
    if param is None or param.default is inspect.Parameter.empty:
        raise ConfigError(f"model {name!r} needs an explicit {key}= in its spec to be profiled")
    return int(param.default)


def profile_model(spec: str, *, seq: int | None = None, dtype: str = "bf16",
                  sample_layers: int | None = 2, optimizer: str = "adamw", tensor_remat: bool = False) -> ModelProfile:
    """Profile ``spec`` (a zoo or ``hf-*`` spec string) at sequence length ``seq``, batch 1.

    ``sample_layers``: capture only this many blocks and replicate the measured block to the
    spec's layer count (``None``: capture the full model; used to check the replication; always
    for a model whose layers differ, :data:`partitioner.zoo.registry.MIXED_LAYERS`).
    ``tensor_remat``: price ``checkpointing="tensor"`` (its MILP runs on the captured sample, so
    its cost does not grow with the layer count unless ``sample_layers=None``; seconds even so, up
    to :data:`TENSOR_TIME_LIMIT_S`: off unless the user pins ``tensor``, as for a captured graph).
    All numbers are per sample; multiply by the micro-batch size (linear in batch).
    """
    name, kwargs = parse_spec(spec)
    key = _layer_count_key(name, kwargs)
    if key is None:
        raise ConfigError(f"model {name!r} has no layer-count key ({', '.join(LAYER_KEYS)}); "
                          f"profile_model needs a repeated-block model such as gpt or llama")
    layers = int(kwargs[key]) if key in kwargs else _default_layers(name, key)
    if name in MIXED_LAYERS:
        sample_layers = None  # a sample of its first layers would stand for layers unlike them
    captured = layers if sample_layers is None else min(layers, max(1, sample_layers))
    small = format_spec(name, {**kwargs, key: captured})
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(TORCH_DTYPES)}")
    model = build_model(small, device="meta", dtype=TORCH_DTYPES[dtype])
    analysis = analyze(model, batch=1, seq=seq, dtype=dtype, optimizer=optimizer)
    seq_len = int(analysis.dims.get("seq", 0) or 0)  # 0: a model without a sequence dim (mlp, resnet)
    shared = _shared_params(model.module)
    embedding, blocks, head, hidden, heads, attention = _chain(analysis.graph, seq_len, shared,
                                                               tensor_remat=tensor_remat)
    if len(blocks) != captured:
        raise AnalysisError(f"profile of {small!r}: found {len(blocks)} repeated blocks, expected {captured}")
    if sample_layers is not None and captured < layers:
        # Every block of a stack has the same costs; take the last (its boundary is a plain block
        # output) and check the others agree.
        ref = blocks[-1]
        for b in blocks[:-1]:
            if replace(b, name=ref.name) != ref:
                raise AnalysisError(f"profile of {small!r}: blocks differ ({b} vs {ref}); "
                                    f"use sample_layers=None to capture the whole model")
        blocks = [replace(ref, name=f"{ref.name.rsplit('.', 1)[0]}.{i}") for i in range(layers)]
    shared_count = sum(n for n, _ in shared.values())
    shared_bytes = sum(b for _, b in shared.values())
    return ModelProfile(model=format_spec(name, {**kwargs, key: layers}), seq=seq_len, dtype=dtype,
                        hidden=hidden, heads=heads, embedding=embedding, blocks=tuple(blocks), head=head,
                        shared_param_count=shared_count, shared_param_bytes=shared_bytes, attention=attention)


def _shared_params(module) -> "_SharedMap":
    """Tied parameters (one parameter under several names): ``{first name: (numel, bytes)}``."""
    names: dict[int, list[str]] = {}
    params = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
        params[id(p)] = p
    tied = {pid: ns for pid, ns in names.items() if len(ns) > 1}
    first = {ns[0]: (params[pid].numel(), params[pid].numel() * params[pid].element_size())
             for pid, ns in tied.items()}
    return _SharedMap(first, {n for ns in tied.values() for n in ns})


class _SharedMap(dict):
    """``{first name: (numel, bytes)}`` of tied parameters, plus ``all_names`` (every alias)."""

    def __init__(self, data: dict, all_names: set[str]):
        super().__init__(data)
        self.all_names = all_names


def _chain(gm: fx.GraphModule, seq: int, shared: _SharedMap, subs: dict | None = None, *, tensor_remat: bool,
           dag: bool = True):
    """Group the analysed nodes by their layer-chain index (``annotate_blocks``) and sum their costs;
    ``tensor_remat``: also price ``checkpointing="tensor"`` (a MILP over all of ``gm``); ``dag``:
    price ``checkpointing="dag"`` (the dag policy over every block of ``gm``)."""
    chain = gm.meta.get(LAYER_CHAIN)
    if chain is None or not chain.blocks:
        raise AnalysisError("profile found no repeated blocks (no module path like 'blocks.0'); the planner "
                            "partitions a chain of repeated blocks")
    stack = list(chain.blocks)
    groups: dict[str, list[fx.Node]] = {g: [] for g in chain.names}
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "output"):
            groups[n.meta[BLOCK].name].append(n)
    boundary = {}
    for g in stack:
        outs = [n for n in groups[g] if n.op != "get_attr" and SHAPE in n.meta and len(n.meta[SHAPE].tensors) == 1]
        boundary[g] = outs[-1].meta[SHAPE].tensor
    hidden = int(boundary[stack[0]].shape[-1])
    heads = _heads(gm)
    no_decay = no_weight_decay_names(gm)  # the runtime's weight-decay groups (ZeRO cuts its chunk where they change)
    mixing = frozenset(held_gradient_nodes(gm))
    layers = {g: _sum(g, ns, seq, hidden, boundary.get(g), shared, no_decay, subs, mixing) for g, ns in groups.items()}
    dag = _dag_per_block(gm, stack, subs) if dag else DAG_NOT_ASKED
    layers.update({g: _dag_priced(layers[g], dag) for g in stack})
    for block in getattr(gm.meta.get(MOE_LAYERS), "blocks", ()):
        if block.layer in layers:
            layers[block.layer] = replace(layers[block.layer], experts=block.experts, top_k=block.top_k, moe_form=block.form,
                                          expert_param_count=_expert_params(gm, block, subs))
    tensor = _tensor_per_block(gm, stack) if tensor_remat else TENSOR_NOT_ASKED
    layers.update({g: _tensor_priced(layers[g], tensor) for g in stack})
    bnd = layers[stack[0]].boundary_bytes
    emb = replace(layers["embedding"], boundary_bytes=bnd, tp_all_reduces=1)
    head = replace(layers["head"], boundary_bytes=bnd, tp_all_reduces=1)
    attention = _attention(groups[stack[0]], seq, subs)
    return emb, [layers[g] for g in stack], head, hidden, heads, attention


def _expert_params(gm: fx.GraphModule, block, subs: dict | None) -> int:
    """Parameters of ``block``'s routed experts (a stacked ``name[e]`` counts 1/experts of ``name``)."""
    shapes = {str(n.target): n.meta[SHAPE].tensor for n in gm.graph.nodes if n.op == "get_attr" and SHAPE in n.meta}
    total = 0
    for names in block.expert_params:
        for name in names:
            base, _, index = name.partition("[")
            if base in shapes:
                numel = _int(shapes[base].numel, subs)
                total += numel // block.experts if index else numel
    return total


def _dag_priced(layer: LayerProfile, dag: tuple[float, float, float] | str) -> LayerProfile:
    """``layer`` with :func:`_dag_per_block`'s price of ``dag`` (or why there is none)."""
    if isinstance(dag, str):
        return replace(layer, dag_refusal=dag)
    return replace(layer, dag_activation_bytes=layer.activation_bytes - dag[0], dag_recompute_flops=dag[1],
                   dag_checkpointed=dag[2], dag_refusal="")


def with_dag(profile: ModelProfile, gm: fx.GraphModule) -> ModelProfile:
    """``profile`` with ``checkpointing="dag"`` priced on ``gm``, the analysed graph it was made
    from (:func:`profile_graph` with ``dag=False``)."""
    stack = _profiled_stack(profile, gm, "with_dag")
    dag = _dag_per_block(gm, stack, _profiled_dims(gm))
    return replace(profile, blocks=tuple(_dag_priced(b, dag) for b in profile.blocks))


def _profiled_dims(gm: fx.GraphModule) -> dict:
    """The symbolic dims of a captured graph as a profile evaluates them: batch 1, the others at
    their capture hints."""
    return {dim_symbol(n): sympy.Integer(1 if n == "batch" else v) for n, v in gm.meta[CAPTURE].dims}


def _profiled_stack(profile: ModelProfile, gm: fx.GraphModule, where: str) -> list[str]:
    """The block names of ``gm``, checked to be ``profile``'s (the graph it was profiled from)."""
    chain = gm.meta.get(LAYER_CHAIN)
    stack = list(chain.blocks) if chain is not None else []
    if [b.name for b in profile.blocks] != stack:
        raise AnalysisError(f"{where}: the graph's {len(stack)} blocks are not the profile's "
                            f"{len(profile.blocks)} ({profile.model}); pass the analysed graph the profile was made "
                            f"from (profile_graph(graph))")
    return stack


def _dag_per_block(gm: fx.GraphModule, stack: list[str], subs: dict | None) -> tuple[float, float, float] | str:
    """(bytes no longer saved, recompute FLOPs, checkpointed fraction) per sample and block,
    averaged over ``stack``'s blocks, under the ``dag`` checkpoint policy at its default budget;
    or why the policy cannot be priced on this graph (the search then does not offer it, and
    says why when it is pinned)."""
    try:
        plan = checkpoint_policy(_tagging_copy(gm), policy="dag").meta[CHECKPOINT_PLAN]
    except (PassError, ConfigError) as e:
        return f"the dag checkpoint policy failed on this model's graph ({e})"
    regions = {r.name: r for r in plan.regions}
    missing = [g for g in stack if g not in regions]
    if not stack or missing:
        return (f"the dag checkpoint policy found no region for block(s) {', '.join(missing[:3]) or '(none)'} "
                f"(a block with no cut point around it)")
    picked = [regions[g] for g in stack]
    n = len(picked)
    return (sum(_int(r.bytes_saved, subs) for r in picked if r.recompute) / n,
            sum(_int(r.recompute_flops, subs) for r in picked if r.recompute) / n,
            sum(r.recompute for r in picked) / n)


def _tagging_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of ``gm`` for a policy that tags its nodes and meta, sharing the parameters and
    buffers (a policy reads them, never writes them), so a real model's weights are not copied."""
    return copy_graph_module(gm, share=(*gm.parameters(), *gm.buffers()))


def with_tensor_remat(profile: ModelProfile, gm: fx.GraphModule) -> ModelProfile:
    """``profile`` with ``checkpointing="tensor"`` priced on ``gm``, the analysed graph it was
    profiled from (:func:`profile_graph` without ``tensor_remat``): what a job that pins
    ``tensor`` adds to the profile it already has. Solves one MILP over all of ``gm`` (at most
    :data:`TENSOR_TIME_LIMIT_S` seconds)."""
    stack = _profiled_stack(profile, gm, "with_tensor_remat")
    tensor = _tensor_per_block(gm, stack)
    return replace(profile, blocks=tuple(_tensor_priced(b, tensor) for b in profile.blocks))


@dataclass(frozen=True, kw_only=True, slots=True)
class _TensorPrice:
    """``checkpointing="tensor"`` per sample and block, from one decision on the whole graph."""

    kept: float
    """Share of the activation bytes kept after forward (the decision's over recomputing nothing's)."""
    recompute_flops: float
    """Forward FLOPs run again in backward, averaged over the blocks."""
    recomputed_ops: float
    """Share of a block's decided ops recomputed, averaged over the blocks."""
    working_bytes: float
    """Bytes the recomputes hold at the fullest moment of backward on top of what forward kept."""
    mip_gap: float
    """The MILP's relative optimality gap (0: optimal; inf: no solution in time)."""


def _tensor_priced(layer: LayerProfile, tensor: _TensorPrice | str) -> LayerProfile:
    """``layer`` with its ``tensor_*`` fields from :func:`_tensor_per_block`'s answer (or its refusal)."""
    if isinstance(tensor, str):
        return replace(layer, tensor_activation_bytes=None, tensor_refusal=tensor, tensor_mip_gap=None)
    return replace(layer, tensor_activation_bytes=layer.activation_bytes * tensor.kept, tensor_refusal="",
                   tensor_recompute_flops=tensor.recompute_flops, tensor_recomputed_ops=tensor.recomputed_ops,
                   tensor_working_bytes=tensor.working_bytes, tensor_mip_gap=tensor.mip_gap)


def _tensor_per_block(gm: fx.GraphModule, stack: list[str]) -> _TensorPrice | str:
    """Per sample and block, averaged over ``stack``'s blocks, under ``checkpointing="tensor"`` at
    its default budget on the whole graph (the profile's batch of one), within
    :data:`TENSOR_TIME_LIMIT_S` seconds of MILP; or why it cannot be priced.

    The share kept is the whole decision's (its saved bytes over recomputing nothing's), not each
    block's own: a stage decides on its own program at the same fraction of its own range, and
    which blocks give up how much moves with the blocks sharing the budget (two profiled blocks
    are not the stage's)."""
    try:
        problem = problem_from_view(to_networkx(gm))
        decision = decide_tensor_remat(problem, time_limit_s=TENSOR_TIME_LIMIT_S)
    except (PassError, ConfigError) as e:
        return f"the tensor remat policy failed on this model's graph ({e})"
    none = plain_backward_peak(problem)
    block = {n.name: n.meta[BLOCK].name for n in gm.graph.nodes if BLOCK in n.meta}
    flops, share = 0.0, 0.0
    for g in stack:
        mine = [d for d in decision.nodes if block.get(d.node) == g and d.action != "none"]
        redone = [d for d in mine if d.action == "recompute"]
        flops += sum(d.recompute_flops for d in redone)
        share += len(redone) / len(mine) if mine else 0.0
    n = len(stack)
    kept = decision.saved_bytes / none if none else 1.0
    gap = decision.mip_gap if decision.mip_gap is not None else math.inf  # no gap known: none proven
    return _TensorPrice(kept=kept, recompute_flops=flops / n, recomputed_ops=share / n,
                        working_bytes=float(decision.peak_bytes - decision.saved_bytes), mip_gap=gap)


_SDPA = "aten.scaled_dot_product_attention"


def _attention(nodes: list[fx.Node], seq: int, subs: dict | None) -> AttentionProfile | None:
    """The attention of one block (its ``scaled_dot_product_attention`` nodes; None without one:
    an unfused attention, matmuls and a softmax, is not what the cp rewrite cuts), and whether
    :func:`passes.rewrites.context_parallel.apply_context_parallel` can rewrite it: no explicit mask, no
    attention dropout, a named ``seq`` dim."""
    sites = [n for n in nodes if n.op == "call_function" and str(n.target).startswith(_SDPA)]
    if not sites:
        return None
    a = sdpa_args(sites[0])
    q = a["query"].meta[SHAPE].tensors[0].shape if SHAPE in a["query"].meta else ()
    dims = [sympy.sympify(d).xreplace(subs) if subs else sympy.sympify(d) for d in q]
    if len(dims) != 4 or not all(d.is_Integer for d in dims):
        return None
    heads, head_dim = int(dims[1]), int(dims[3])
    k_src, v_src = repeat_kv_source(a["key"]), repeat_kv_source(a["value"])
    kv_heads = k_src[1] if k_src is not None and v_src is not None and k_src[1] == v_src[1] else heads
    # the rewrite's own rules (passes.rewrites.context_parallel), the first that breaks
    problems = [p for n in sites for p in attention_problems(n)]
    refusal = ("the model's inputs have no dim named 'seq' to cut" if seq <= 0 else problems[0] if problems else "")
    return AttentionProfile(sites=len(sites), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            causal=bool(a["is_causal"]), cp_refusal=refusal)


def _heads(gm) -> int:
    for n in gm.graph.nodes:
        f = n.meta.get(FLOPS)
        if n.meta[BLOCK].in_block and f is not None and f.kind == "attention" and SHAPE in n.meta:
            return int(n.meta[SHAPE].tensors[0].shape[1])  # (batch, heads, seq, head_dim)
    return 1


def _tensor_bytes(node: fx.Node, subs: dict | None) -> int:
    """Bytes of every tensor ``node`` produces (0 for a node without shape facts)."""
    sm = node.meta.get(SHAPE)
    if sm is None:
        return 0
    return sum(_int(t.nbytes, subs) for t in sm.tensors)


def _moved_bytes(n: fx.Node, subs: dict | None) -> tuple[int, int]:
    """(activation bytes, parameter bytes) one forward kernel of ``n`` reads and writes: its
    non-parameter tensor inputs plus its outputs, and its parameter (``get_attr``) inputs.

    A view (no new storage: ``MemoryMeta.output_bytes`` 0) launches no kernel and moves nothing;
    a gather reads only the table rows it writes (:data:`GATHER_OPS`), counted as activation bytes.
    """
    mem = n.meta.get(MEMORY)
    out = _tensor_bytes(n, subs)
    if mem is not None and not _int(mem.output_bytes, subs):
        return 0, 0
    inputs = list(n.all_input_nodes)
    act, weights = out, 0
    for i, a in enumerate(inputs):
        if i == 0 and str(n.target).startswith(GATHER_OPS):
            act += out
        elif a.op == "get_attr":
            weights += _tensor_bytes(a, subs)
        else:
            act += _tensor_bytes(a, subs)
    return act, weights


def _trailing(n: fx.Node, k: int, subs: dict | None) -> tuple[int, ...]:
    """The last ``k`` dims of ``n``'s first output (``()`` if it has fewer or they are symbolic)."""
    sm = n.meta.get(SHAPE)
    if sm is None or not sm.tensors or len(sm.tensors[0].shape) < k:
        return ()
    dims = [sympy.sympify(d) for d in sm.tensors[0].shape[-k:]]
    dims = [d.xreplace(subs) if subs else d for d in dims]
    return tuple(int(d) for d in dims) if all(d.is_Integer for d in dims) else ()


def _hidden_output(n: fx.Node, hidden: int, subs: dict | None) -> bool:
    """Whether ``n``'s first output has the hidden size as its trailing dim ([.., h])."""
    return _trailing(n, 1, subs) == (hidden,)


def _scores(n: fx.Node, seq: int, subs: dict | None) -> bool:
    """Whether ``n`` makes an [.., s, s] tensor (attention scores or probabilities)."""
    return _trailing(n, 2, subs) == (seq, seq)


def _attention_core(n: fx.Node, kind: str, seq: int, subs: dict | None) -> bool:
    """A fused attention node, or a matmul that makes or consumes [s, s] scores."""
    return kind == "attention" or _scores(n, seq, subs) or any(_scores(a, seq, subs) for a in n.all_input_nodes)


def _sum(name, nodes, seq, hidden, boundary, shared: _SharedMap, no_decay: frozenset[str],
         subs: dict | None = None, mixing: frozenset[fx.Node] = frozenset()) -> LayerProfile:
    params = pbytes = fwd = bwd = matmuls = attn = act = repl = score = saved = ops = held = hidden_held = 0
    decays: list[bool] = []  # weight-decay group of each parameter tensor, in first-use order
    kernels: list[Kernel] = []
    mem_bytes = repl_mem_bytes = score_mem_bytes = 0
    for n in nodes:
        mem = n.meta.get(MEMORY)
        if n.op == "get_attr":
            if mem is None or n.target in shared.all_names:
                continue  # tied weights are counted once, in ModelProfile.shared_param_*
            pbytes += _int(mem.param_bytes, subs)
            if _int(mem.param_bytes, subs):
                params += _int(n.meta[SHAPE].tensor.numel, subs)
                decays.append(str(n.target) not in no_decay)
            continue
        is_size = SHAPE in n.meta and n.meta[SHAPE].value is not None  # size arithmetic dispatches no kernel
        dispatched = n.op == "call_function" and n.target is not operator.getitem and not is_size
        if dispatched:
            ops += 1
        f = n.meta.get(FLOPS)
        node_fwd = _int(f.fwd, subs) if f is not None else 0
        if f is not None:
            fwd += node_fwd
            bwd += _int(f.bwd, subs)
            if node_fwd:
                matmuls += 1
            if f.kind == "attention":
                attn += node_fwd
        if n in mixing:
            nbytes = _int(n.meta[SHAPE].tensors[0].nbytes, subs)
            held += nbytes
            if not node_fwd and _hidden_output(n, hidden, subs) and not str(n.target).startswith(GATHER_OPS):
                hidden_held += nbytes
        if node_fwd:
            moved, weights = _moved_bytes(n, subs)
            # a routed expert captured in the dense form runs on every token: the kernel is timed
            # at what runs (its FLOPs count, for the model's FLOPs and MFU, the routed tokens only)
            mark = n.meta.get(MOE)
            ran = sympy.Integer(1) / mark.flop_scale if mark is not None and mark.expert is not None else 1
            kernels.append(Kernel(fwd_flops=_int(node_fwd * ran), bwd_flops=_int(f.bwd * ran, subs), bytes=moved,
                                  weight_bytes=weights, attention=_attention_core(n, f.kind, seq, subs),
                                  fused_attention=f.kind == "attention",
                                  gathered_expert=mark is not None and mark.role == "expert" and mark.expert is None))
        elif dispatched:  # no matmul work: the kernel is bound by the bytes it moves
            # its parameters (norm scales and shifts) are a few KiB: left out of the per-sample bytes
            moved = _moved_bytes(n, subs)[0]
            if _hidden_output(n, hidden, subs):
                repl_mem_bytes += moved
            else:
                mem_bytes += moved
                if _scores(n, seq, subs):
                    score_mem_bytes += moved
        if mem is not None and _int(mem.kept_bytes, subs):
            kept = _int(mem.kept_bytes, subs)
            act += kept
            saved += 1
            shape = n.meta[SHAPE].tensors[0].shape if SHAPE in n.meta and n.meta[SHAPE].tensors else ()
            shape = [sympy.sympify(d).xreplace(subs) if subs else sympy.sympify(d) for d in shape]
            dims = [int(d) for d in shape] if all(d.is_Integer for d in shape) else []
            if len(dims) >= 2 and dims[-1] == seq and dims[-2] == seq:
                score += kept
            elif dims and dims[-1] == hidden:
                repl += kept
    bnd = _int(boundary.nbytes, subs) if boundary is not None else 0
    return LayerProfile(name=name, param_count=params, param_bytes=pbytes, fwd_flops=fwd, bwd_flops=bwd,
                        matmuls=max(matmuls, 1), attention_flops=attn, activation_bytes=act,
                        replicated_activation_bytes=repl, attention_score_bytes=score, boundary_bytes=bnd,
                        saved_tensors=saved, ops=ops, tp_all_reduces=2, kernels=tuple(kernels),
                        memory_bound_bytes=mem_bytes, replicated_memory_bound_bytes=repl_mem_bytes,
                        score_memory_bound_bytes=score_mem_bytes, param_tensors=len(decays),
                        held_grad_bytes=held, hidden_held_grad_bytes=hidden_held,
                        param_runs=sum(1 for k, d in enumerate(decays) if k == 0 or d != decays[k - 1]))


def profile_spec(spec: ModelSpec, *, dtype: str = "fp32", optimizer: str = "adamw",
                 tensor_remat: bool = False) -> ModelProfile:
    """A :class:`ModelProfile` of any repeated-block ModelSpec, captured whole at batch 1 (pass a
    copy on the meta device to allocate no weights); :func:`profile_model` is the faster path for
    zoo spec strings, which captures two blocks and replicates them. ``tensor_remat``: price
    ``checkpointing="tensor"`` (a MILP over the whole graph, whose time grows with depth: off
    unless the user pins it; the search offers ``tensor`` only when priced)."""
    analysis = analyze(spec, batch=1, dtype=dtype, optimizer=optimizer)
    seq = int(analysis.dims.get("seq", 0) or 0)
    shared = _shared_params(spec.module)
    embedding, blocks, head, hidden, heads, attention = _chain(analysis.graph, seq, shared, tensor_remat=tensor_remat)
    return ModelProfile(model=spec.name, seq=seq, dtype=dtype, hidden=hidden, heads=heads, embedding=embedding,
                        blocks=tuple(blocks), head=head, shared_param_count=sum(n for n, _ in shared.values()),
                        shared_param_bytes=sum(b for _, b in shared.values()), attention=attention)


def profile_graph(gm: fx.GraphModule, *, dtype: str = "fp32", name: str | None = None,
                  tensor_remat: bool = False, dag: bool = True) -> ModelProfile:
    """A :class:`ModelProfile` of an already captured and analysed graph (shapes, blocks, FLOPs,
    memory; symbolic dims are evaluated at batch 1 and their hints): what a job that captured its
    model once plans from. Tied parameters come from the capture, so they count once.
    ``tensor_remat``: price ``checkpointing="tensor"`` (a MILP over the whole graph, whose time
    grows with depth: off unless the user pins it, see :func:`with_tensor_remat`). ``dag=False``:
    leave ``checkpointing="dag"`` unpriced (:data:`DAG_NOT_ASKED`; the dag policy over every block
    also grows with depth) for :func:`with_dag` to price when it can win."""
    info = gm.meta[CAPTURE]
    hints = dict(info.dims)
    subs = _profiled_dims(gm)
    seq = int(hints.get("seq", 0) or 0)
    params = dict(gm.named_parameters(remove_duplicate=False))
    tied = {}
    for names in info.tied:
        present = [n for n in names if n in params]
        if present:
            p = params[present[0]]
            tied[names[0]] = (p.numel(), p.numel() * p.element_size())
    shared = _SharedMap(tied, {n for names in info.tied for n in names})
    embedding, blocks, head, hidden, heads, attention = _chain(gm, seq, shared, subs, tensor_remat=tensor_remat,
                                                               dag=dag)
    return ModelProfile(model=name or info.model, seq=seq, dtype=dtype, hidden=hidden, heads=heads,
                        embedding=embedding, blocks=tuple(blocks), head=head,
                        shared_param_count=sum(n for n, _ in tied.values()),
                        shared_param_bytes=sum(b for _, b in tied.values()), attention=attention)

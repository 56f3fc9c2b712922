"""Rewrite: Megatron sequence parallelism (Korthikanti et al. 2022) on a tensor-parallel rank program.

Called by ``apply_tensor_parallel(..., sequence_parallel=True)`` on the graph its tp rewrite
produced. With tp alone, the regions between a row-parallel output and the next column-parallel
input (residual adds, LayerNorm / RMSNorm, dropout) run replicated on every tp rank; here they
run on this rank's contiguous chunk of the sequence dim instead. Patterns (ops of
``passes.ir.ops``; ``d`` the sequence dim, ``tp`` the degree)::

    row:     linear(x_shard, W) -> reduce_from_tp          becomes  -> reduce_scatter_seq(., d)
    embed:   vocab-parallel embedding -> reduce_from_tp    becomes  -> reduce_scatter_seq(., d)
    column:  copy_to_tp(x_seq) -> linear                   becomes  all_gather_seq(x_seq, d) -> linear
    mixed:   op(x_seq, y_full)      (y of full sequence)   becomes  op(x_seq, scatter_to_seq(y, d))
    stage input (float, has a sequence dim)                -> scatter_to_seq
    received boundary tensor (float, has a sequence dim)   arrives as this rank's chunk (no op)
    boundary tensor sent on (float, has a sequence dim)    leaves as this rank's chunk
                                                           (scatter_to_seq if it is not one)
    other op / graph output reading a chunk                -> gather_from_seq first (exact fallback)
    sym_size(x_seq, d)                                     -> sym_size * tp   (sizes stay global)
    view/reshape inside the region, size at d              -> size // tp

The region is found by propagating "sequence-sharded at dim d" forward from the entries through
pointwise ops, layer norm, reductions over other dims (RMSNorm's mean), replicated linears and
views that keep the sequence dim whole. Replicated operands broadcast over the sequence
(norm weights and biases, the row-parallel bias) get per-rank partial gradients: parameters
read only there are listed in ``TensorParallelPlan.sequence_parallel_grads`` (the runtime sums
their gradients over the tp group); any other such operand that needs a gradient gets a
``copy_to_tp`` (all-reduce of its gradient in backward). The sequence dim of a tensor is found
from its global shape (``node.meta[SHAPE]`` before the tp rewrite): the dim whose size is the
captured ``seq`` dim (the last such dim before the features).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import sympy
import torch
from torch import fx

import passes.ir.ops  # noqa: F401  (defines torch.ops.partitioner.*)
from passes.ir.errors import ConfigError
from passes.ir.meta import CAPTURE, TENSOR_PARALLEL, ShapeMeta, StageIO, TensorMeta, TPMeta, dim_symbol
from passes.policies.tensor_parallel_patterns import _PASSTHROUGH, _VIEWS, _groups, _same_size

aten = torch.ops.aten
tp_ops = torch.ops.partitioner

_NORMS = {aten.layer_norm.default}
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default}
_LINEARS = {aten.linear.default}


SEQ_DIM = "seq"
"""The named dim sequence parallelism cuts (an InputSpec shape such as ``("batch", "seq")``)."""


def sequence_parallel_refusal(seq: int | None, tp: int = 1, cp: int = 1, *, seq_dim: str = SEQ_DIM) -> str:
    """Why sequence parallelism cannot run on a model, "" when it can: the one rule the lowering
    (:func:`sequence_size`) and the plan search both apply. ``seq``: the captured size of the
    named sequence dim ``seq_dim`` in tokens (None: the model's inputs name no such dim, e.g. an
    image model); ``tp``, ``cp``: the tensor- and context-parallel degrees (each tp rank takes a
    chunk of each cp rank's ``seq / cp`` tokens, so ``tp * cp`` must divide ``seq``)."""
    if seq is None:
        return (f"sequence parallelism needs a named sequence dim {seq_dim!r} (it cuts the sequence over the tp "
                f"ranks) and this model's inputs name none; set sequence_parallel=false, or name the dim "
                f"{seq_dim!r} in the InputSpec shapes, e.g. ('batch', {seq_dim!r}, ...)")
    if seq % (tp * cp):
        ranks = f"tp={tp}" if cp == 1 else f"tp*cp = {tp}*{cp} = {tp * cp}"
        return (f"sequence parallelism: sequence length {seq_dim}={seq} is not divisible by {ranks}; use a "
                f"{seq_dim} that is a multiple of {tp * cp} or sequence_parallel=false")
    return ""


def sequence_size(gm: fx.GraphModule, tp: int, seq_dim: str = SEQ_DIM) -> sympy.Expr:
    """The captured size of the named sequence dim (a symbol when symbolic); ConfigError
    (:func:`sequence_parallel_refusal`) when the capture has no such dim or its example size is
    not divisible by ``tp``."""
    info = gm.meta.get(CAPTURE)
    dims = dict(info.dims) if info is not None else {}
    why = sequence_parallel_refusal(dims.get(seq_dim), tp, seq_dim=seq_dim)
    if why:
        raise ConfigError(f"{why} (the capture's dims: {sorted(dims)})")
    return dim_symbol(seq_dim) if seq_dim in info.symbolic else sympy.Integer(dims[seq_dim])


def boundary_shard_dim(meta: TensorMeta | None, seq: sympy.Expr | None) -> int | None:
    """The dim along which a pipeline boundary tensor of global ``meta`` travels as each tp
    rank's chunk under sequence parallelism: its sequence dim (the last dim before the
    features whose size is ``seq``) for a floating tensor; None (it travels whole) otherwise."""
    if meta is None or seq is None or not meta.dtype.is_floating_point:
        return None
    hits = [i for i, s in enumerate(meta.shape[:-1]) if _same_size(sympy.sympify(s), seq)]
    return hits[-1] if hits and len(meta.shape) >= 2 else None


def shard_stage_io(io: StageIO, tp: int, seq: sympy.Expr | None) -> StageIO:
    """``io`` with each boundary tensor (received, or sent to another stage) that travels
    sharded (:func:`boundary_shard_dim`) at this rank's chunk size: what a tp rank's program
    receives and sends under sequence parallelism."""
    def chunk(meta: TensorMeta) -> TensorMeta:
        d = boundary_shard_dim(meta, seq)
        if d is None:
            return meta
        shape = list(meta.shape)
        shape[d] = sympy.sympify(shape[d]) / tp
        return dataclasses.replace(meta, shape=tuple(shape))

    inputs = tuple(dataclasses.replace(i, meta=chunk(i.meta)) if i.kind == "recv" else i for i in io.inputs)
    outputs = tuple(dataclasses.replace(o, meta=chunk(o.meta)) if o.dests else o for o in io.outputs)
    return dataclasses.replace(io, inputs=inputs, outputs=outputs)


def apply_sequence_parallel(graph: fx.Graph, shapes: dict[str, ShapeMeta], params: dict[str, torch.nn.Parameter],
                            *, tp: int, group: str, seq: sympy.Expr, io: StageIO | None = None) -> tuple[str, ...]:
    """Rewrite ``graph`` (a tp rank program) in place for sequence parallelism; returns the names
    of replicated parameters whose gradients must be summed over the tp group (sorted). A
    received input that arrives as this rank's chunk is tagged ``sequence`` with its dim
    (``node.meta[TENSOR_PARALLEL]``), as every node running on a chunk is.

    ``shapes``: node name -> global :class:`ShapeMeta` (None: not a tensor) of every node of the
    graph before the tp rewrite.
    ``seq``: the sequence size in those shapes (from :func:`sequence_size`).
    ``io``: the stage's contract (global shapes): its boundary tensors are received and sent as
    chunks (:func:`boundary_shard_dim`); without it every boundary tensor travels whole.
    """
    return _SeqRewriter(graph, shapes, params, tp, group, seq, io).run()


class _SeqRewriter:
    def __init__(self, graph, shapes, params, tp, group, seq, io=None):
        self.graph, self.shapes, self.params = graph, shapes, params
        self.tp, self.group, self.seq = tp, group, seq
        # boundary tensors that travel as chunks: received ones by name, sent ones by output position
        self.received = {i.name: boundary_shard_dim(i.meta, seq) for i in (io.inputs if io else ())
                         if i.kind == "recv"}
        self.sent = {k: boundary_shard_dim(o.meta, seq) for k, o in enumerate(io.outputs if io else ()) if o.dests}
        self.state: dict[fx.Node, int] = {}  # node -> sequence dim of its output chunk
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.scattered: dict[tuple[fx.Node, int], fx.Node] = {}
        self.broadcast: list[tuple[fx.Node, fx.Node]] = []  # (replicated operand, sequence-parallel user)

    # --- shapes ---------------------------------------------------------------------------
    def shape(self, node: Any):
        """Global shape of a tensor node, or None; nodes the tp rewrite inserted (collectives,
        the row bias add, masking) keep their first input's shape."""
        while isinstance(node, fx.Node):
            if node.name in self.shapes:
                meta = self.shapes[node.name]
                return meta.tensor.shape if meta is not None and len(meta.tensors) == 1 else None
            node = node.args[0] if node.args else None
        return None

    def requires_grad(self, node: fx.Node) -> bool:
        while isinstance(node, fx.Node):
            if node.name in self.shapes:
                meta = self.shapes[node.name]
                return meta is not None and len(meta.tensors) == 1 and meta.tensor.requires_grad
            node = node.args[0] if node.args else None
        return False

    def seq_dim(self, node: fx.Node) -> int | None:
        shape = self.shape(node)
        if not shape or len(shape) < 2:
            return None
        hits = [i for i, s in enumerate(shape[:-1]) if _same_size(sympy.sympify(s), self.seq)]
        return hits[-1] if hits else None

    # --- helpers --------------------------------------------------------------------------
    def _insert(self, target, args, *, before=None, after=None, role="", dim=None, reason=""):
        ctx = self.graph.inserting_before(before) if before is not None else self.graph.inserting_after(after)
        with ctx:
            n = self.graph.call_function(target, args)
        if role:
            n.meta[TENSOR_PARALLEL] = TPMeta(role=role, shard_dim=dim, reason=reason)
        return n

    def _replace(self, node: fx.Node, target, args, **tag) -> fx.Node:
        """A new node (named for its op, so dumps read right) in place of ``node``."""
        new = self._insert(target, args, before=node, **tag)
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        return new

    def _tag(self, node: fx.Node, dim: int, reason: str) -> None:
        self.state[node] = dim
        node.meta[TENSOR_PARALLEL] = TPMeta(role="sequence", shard_dim=dim, reason=reason)

    def _gathered(self, a: fx.Node, user: fx.Node) -> fx.Node:
        """``a`` all-gathered along its sequence dim (one gather however many users need it)."""
        if a not in self.gathered:
            self.gathered[a] = self._insert(tp_ops.gather_from_seq.default, (a, self.state[a], self.tp, self.group),
                                            after=a, role="replicated",
                                            reason=f"{user.name} cannot run on a sequence chunk: all-gathered")
        return self.gathered[a]

    def _gather(self, a: fx.Node, user: fx.Node) -> None:
        user.replace_input_with(a, self._gathered(a, user))

    def _scatter(self, a: fx.Node, pos: int, user: fx.Node) -> None:
        key = (a, pos)
        if key not in self.scattered:
            n = self._insert(tp_ops.scatter_to_seq.default, (a, pos, self.tp, self.group), after=a)
            self._tag(n, pos, "replicated operand cut to this rank's sequence chunk")
            self.scattered[key] = n
        user.replace_input_with(a, self.scattered[key])

    # --- the walk -------------------------------------------------------------------------
    def run(self) -> tuple[str, ...]:
        for node in list(self.graph.nodes):
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "output":
                self._output(node)
            elif node.op == "call_function":
                self._visit(node)
        return self._grads()

    def _output(self, node: fx.Node) -> None:
        """Boundary tensors leave as this rank's chunk along the contract's dim; graph outputs
        (the loss) and what travels whole are gathered."""
        outs = list(node.args[0]) if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
        for k, a in enumerate(outs):
            if not isinstance(a, fx.Node):
                continue
            d = self.sent.get(k)
            if d is not None and self.state.get(a) == d:
                continue
            if a in self.state:
                a = self._gathered(a, node)
            if d is not None:  # sent as a chunk although made whole: this rank's piece of it
                a = self._insert(tp_ops.scatter_to_seq.default, (a, d, self.tp, self.group), before=node)
                self._tag(a, d, "boundary tensor sent as this rank's sequence chunk")
            outs[k] = a
        node.args = (tuple(outs) if isinstance(node.args[0], (tuple, list)) else outs[0],)

    def _placeholder(self, node: fx.Node) -> None:
        if self.received.get(node.name) is not None:  # the sender sent this rank's chunk
            self._tag(node, self.received[node.name], "received as this rank's sequence chunk")
            return
        meta = self.shapes.get(node.name)
        d = self.seq_dim(node)
        if meta is None or d is None or len(meta.tensors) != 1 or not meta.tensor.dtype.is_floating_point:
            return  # ids and targets stay whole (the vocab-parallel embedding and the loss read them)
        users = list(node.users)
        first = next(n for n in self.graph.nodes if n.op != "placeholder")  # keep placeholders together
        n = self._insert(tp_ops.scatter_to_seq.default, (node, d, self.tp, self.group), before=first)
        self._tag(n, d, "stage input cut to this rank's sequence chunk")
        for u in users:
            u.replace_input_with(node, n)

    def _visit(self, node: fx.Node) -> None:
        t = node.target
        sp_in = [a for a in node.all_input_nodes if a in self.state]
        if t is tp_ops.reduce_from_tp.default and not sp_in:
            d = self.seq_dim(node)
            if d is not None:
                new = self._replace(node, tp_ops.reduce_scatter_seq.default, (node.args[0], d, self.tp, self.group))
                self._tag(new, d, "partial sums reduce-scattered along the sequence")
            return
        if not sp_in:
            return
        if t is tp_ops.copy_to_tp.default:
            x = node.args[0]
            self._replace(node, tp_ops.all_gather_seq.default, (x, self.state[x], self.tp, self.group),
                          role="replicated", reason="sequence all-gathered into a tp region")
            return
        if t is aten.sym_size.int:
            x, dim = node.args
            if dim % len(self.shape(x)) == self.state[x]:
                users = list(node.users)
                full = self._insert(operator.mul, (node, self.tp), after=node)
                for u in users:  # sizes stay global; views inside the region divide them again
                    u.replace_input_with(node, full)
            return
        if t is aten._assert_tensor_metadata.default:
            if node.kwargs.get("size") is None and len(node.args) < 2:
                return  # dtype/device checks hold on a chunk
        out = self._out_dim(node, sp_in)
        if out is None:
            for a in sp_in:
                self._gather(a, node)
            return
        self._tag(node, out, "runs on this rank's sequence chunk")

    def _out_dim(self, node: fx.Node, sp_in: list[fx.Node]) -> int | None:
        """The output's sequence dim if ``node`` can run on chunks (rewriting its operands / sizes), else None."""
        t = node.target
        out_shape = self.shape(node)
        if out_shape is None:
            return None
        nd = len(out_shape)
        x = node.args[0] if node.args else None
        if t in _PASSTHROUGH and sp_in == [x] and len(node.all_input_nodes) == 1:
            return self.state[x]
        if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
            return self._pointwise(node, sp_in, nd)
        if t in _NORMS and x in self.state:
            d = self.state[x]
            if d >= nd - len(node.args[1]):
                return None
            self._operands(node, [a for a in node.all_input_nodes if a is not x], d, nd)
            return d
        if t in _REDUCTIONS and sp_in == [x]:
            d, nd_in = self.state[x], len(self.shape(x))
            dims = [r % nd_in for r in node.args[1]]
            keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
            if d in dims:
                return None
            return d if keep else d - sum(r < d for r in dims)
        if t in _LINEARS and sp_in == [x]:
            d = self.state[x]
            if d >= nd - 1 or node.meta.get(TENSOR_PARALLEL, TPMeta(role="")).role != "replicated":
                return None
            self._operands(node, [a for a in node.all_input_nodes if a is not x], None, nd)
            return d
        if t is aten.unsqueeze.default and sp_in == [x]:
            d, pos = self.state[x], node.args[1] % nd
            return d + (1 if pos <= d else 0)
        if (t in _VIEWS or t is aten.flatten.using_ints) and sp_in == [x]:
            return self._view(node, x, out_shape)
        return None

    def _pointwise(self, node, sp_in, nd) -> int | None:
        dims = {self.state[a] - len(self.shape(a)) + nd for a in sp_in}
        if len(dims) != 1:
            return None
        d = dims.pop()
        others = [a for a in node.all_input_nodes if a not in self.state]
        if not self._operands(node, others, d, nd):
            return None
        return d

    def _operands(self, node, others, d, nd) -> bool:
        """Replicated operands of a sequence-parallel node: cut those of full sequence size at
        ``d`` (None: the op reads them whole, as a linear's weight) and record those broadcast."""
        plan = []
        for a in others:
            shape = self.shape(a)
            pos = None if d is None or shape is None else d - (nd - len(shape))
            if shape is not None and pos is not None and 0 <= pos < len(shape) and shape[pos] != 1:
                if not _same_size(sympy.sympify(shape[pos]), self.seq):
                    return False
                plan.append((a, pos))
            else:
                plan.append((a, None))
        for a, pos in plan:
            if pos is not None:
                self._scatter(a, pos, node)
            else:
                self.broadcast.append((a, node))
        return True

    def _view(self, node, x, out_shape) -> int | None:
        d = self.state[x]
        groups = _groups(list(self.shape(x)), list(out_shape))
        if groups is None:
            return None
        for ins, outs in groups:
            if d not in ins:
                continue
            real_in = [i for i in ins if i == d or self.shape(x)[i] != 1]
            real_out = [o for o in outs if _same_size(sympy.sympify(out_shape[o]), self.seq)]
            if real_in != [d] or len(real_out) != 1:
                return None  # the sequence dim is merged with or split into other dims
            o = real_out[0]
            if node.target is aten.flatten.using_ints:
                return o
            sizes = list(node.args[1])
            s = sizes[o]
            if isinstance(s, fx.Node):
                sizes[o] = self._insert(operator.floordiv, (s, self.tp), before=node)
            elif s != -1:
                if s % self.tp:
                    return None
                sizes[o] = s // self.tp
            node.update_arg(1, sizes)
            return o
        return None

    # --- gradients of replicated operands -------------------------------------------------
    def _grads(self) -> tuple[str, ...]:
        names: set[str] = set()
        seen: set[fx.Node] = set()
        for a, user in self.broadcast:
            if a in seen:
                continue
            seen.add(a)
            if a.op == "get_attr":
                p = self.params.get(a.target)
                if p is None or not p.requires_grad:
                    continue  # a buffer or constant: no gradient
                if all(u in self.state for u in a.users):
                    names.add(a.target)
                    continue
            elif not self.requires_grad(a):
                continue
            # read by replicated ops too: reduce only this use's gradient, in the graph
            sp_users = [u for u in a.users if u in self.state]
            n = self._insert(tp_ops.copy_to_tp.default, (a, self.group), after=a, role="replicated",
                             reason="replicated operand broadcast over sequence chunks: gradient all-reduced")
            for u in sp_users:
                u.replace_input_with(a, n)
        return tuple(sorted(names))

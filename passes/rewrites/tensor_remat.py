"""Executor of a per-tensor rematerialization decision: run a forward graph so that backward
finds the outputs of the nodes marked ``recompute`` computed again on demand, one node at a time.

``torch.utils.checkpoint`` recomputes whole regions and keeps each region's inputs; the
whole-graph remat model (:mod:`passes.solvers.remat_solver`) decides per node: a node is recomputed from
whatever its inputs are (saved, or recomputed in turn), as AOTAutograd's partitioner would place
the recompute in the backward graph. This module carries such a decision out in eager PyTorch:

* forward runs node by node (an ``fx.Interpreter``) inside ``saved_tensors_hooks``. Every tensor
  autograd saves is packed into a handle; when the node that saved it has run, a handle whose
  storage belongs to a recomputed node (the node whose output first had the storage, or the
  saving node itself for a tensor its op made inside: layer-norm statistics, a dropout mask)
  drops the tensor and keeps a token: owner node, which of its tensors, and the view (size,
  stride, offset, dtype) backward asked for;
* the outputs of saved nodes that a recomputed node reads are held (through views: the storage a
  view reads is its base's), graph inputs too; nothing else is held;
* backward unpacks a token by recomputing its owner from its inputs (held, or recomputed in turn,
  memoised), with the same inputs requiring grad as in forward so the op saves the same tensors
  (its internal ones are taken from that replay, matched by order), and under the RNG state the
  owner drew with in forward (dropout draws the same numbers). A recomputed value is dropped once
  every token and every recomputed reader of it has used it; a held one once its readers have
  (counted after forward, over the recomputes backward will need: those with tokens and what
  they read, recursively).

The result is bit-identical to the plain graph on deterministic kernels: the same ops run on
the same values. What stays on device between forward and backward is the saved nodes' saved
storages plus the held ones: ``RematDecision.saved_bytes`` counts exactly these.

Not handled here (refused): ``offload`` actions, and graphs whose recomputed nodes are written in
place (the remat model never marks those recomputable).

Memory: with ``trace_memory=True`` the executor measures ``backward_peak_bytes``, the most
activation bytes alive (autograd's saved storages, held and recomputed values) at any unpack or
recompute of backward: the quantity :func:`passes.solvers.remat_solver.backward_peak` predicts and
``solve_milp(..., bound="peak")`` bounds. Decisions made under the default bound (bytes saved
after forward) can peak above keeping everything: a tensor recomputed for an early use in
backward stays until its last use.

The decision is read from ``node.meta[TENSOR_REMAT]`` (written by :func:`passes.policies.tensor_remat_policy.mark_recomputed`, e.g.
through ``passes.policies.tensor_remat_policy``), or given as an actions dict. The memory analysis replays
the same marks as this executor runs them. A program lowered under ``checkpointing="tensor"``
carries :class:`TensorRematCodeGen` (``passes.rewrites.apply_tensor_remat``): its ``forward`` hands the
call to this executor, so whoever calls the module (the runtime's stage executor, a measurement)
runs the decision, and nothing else needs to know it.
"""
from __future__ import annotations

import weakref
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from passes.analysis.graph_view import draws_random, is_project_op
from passes.ir.errors import PassError
from passes.policies.tensor_remat_policy import check_actions, marked_actions
from passes.solvers.remat_solver import Action


@dataclass(frozen=True)
class _View:
    """How a packed tensor sits on its storage."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @staticmethod
    def of(t: torch.Tensor) -> "_View":
        return _View(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


@dataclass(frozen=True)
class _Owner:
    """Who made a storage: ``node``, as its ``index``-th output tensor (``kind="out"``) or as the
    ``index``-th tensor its op packed (``kind="pack"``), laid out as ``view``."""

    ref: StorageWeakRef
    node: fx.Node
    kind: str
    index: int
    view: _View


@dataclass(frozen=True)
class _Token:
    owner: _Owner
    view: _View


class _Handle:
    """What autograd stores for one saved tensor: the tensor, or a token to recompute it from."""

    __slots__ = ("tensor", "token", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor: torch.Tensor | None = tensor
        self.token: _Token | None = None


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _rng_devices(args: Iterable[Any]) -> list[torch.device]:
    return sorted({t.device for t in tree_leaves(list(args)) if isinstance(t, torch.Tensor) and t.device.type == "cuda"},
                  key=str)


class TensorRemat:
    """Runs ``gm``'s forward under a per-node decision ``actions`` (node name -> action; nodes not
    named are views, getitems, sizes: recomputed freely when a recompute needs them; ``None``:
    the graph's ``node.meta[TENSOR_REMAT]`` marks). Call it like ``gm``; then backward recomputes
    on demand. Each call keeps its own state until its backward has run (micro-batches may run
    several forwards before their backwards)."""

    def __init__(self, gm: fx.GraphModule, actions: Mapping[str, Action] | None = None, *,
                 trace_memory: bool = False):
        self.gm = gm
        if actions is None:
            actions = marked_actions(gm)
        self.trace_memory = trace_memory  # measure backward_peak_bytes (costs a scan per unpack)
        nodes = {n.name: n for n in gm.graph.nodes}
        check_actions(actions, nodes)
        self.actions = dict(actions)
        self.recompute = {nodes[name] for name, a in actions.items() if a == "recompute"}
        self.held_nodes, self.reads = self._reads()
        self.random = {n for n in self.recompute if draws_random(n)}
        self._ops = fx.Interpreter(gm)  # runs one node's op on given values (fetch_attr, call_*)

    def _run(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        if node.op not in ("call_function", "call_method", "call_module"):
            raise PassError(f"tensor remat: cannot run node {node.name!r} ({node.op}) again")
        return getattr(self._ops, node.op)(node.target, args, kwargs)

    def _sources(self, node: fx.Node) -> set[fx.Node]:
        """The nodes a recompute of ``node`` takes values from: its inputs, seen through nodes
        outside the decision (views, getitems) to the decided nodes, graph inputs and attributes
        they read."""
        out, stack, seen = set(), list(node.all_input_nodes), set()
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a.op in ("placeholder", "get_attr") or a.name in self.actions:
                out.add(a)
            elif is_project_op(a):  # would run a collective again on this rank alone
                raise PassError(f"tensor remat: recomputing {node.name!r} would run {a.name!r} ({a.target}) again, "
                                f"which the decision does not keep; decide on this graph with the remat model "
                                f"(it saves what its recomputes read)")
            else:
                stack.extend(a.all_input_nodes)
        return out

    def _reads(self) -> tuple[set[fx.Node], dict[fx.Node, set[fx.Node]]]:
        """(saved nodes and graph inputs some recompute reads, each recomputed node's sources)."""
        held, sources = set(), {}
        for r in self.recompute:
            sources[r] = {a for a in self._sources(r) if a.op != "get_attr"}
            for a in sources[r]:
                if a.op != "placeholder" and self.actions[a.name] not in ("save", "recompute"):
                    raise PassError(f"tensor remat: recomputing {r.name!r} reads {a.name!r}, whose action is "
                                    f"{self.actions[a.name]!r}; the decision must save or recompute what a "
                                    f"recomputed node reads")
                if a not in self.recompute:
                    held.add(a)
        return held, sources

    # -- forward --------------------------------------------------------------------------------

    def __call__(self, *args: Any) -> Any:
        step = self.last = _Step(self)  # its own state: several forwards may await their backward
        with torch.autograd.graph.saved_tensors_hooks(step._pack, step._unpack):
            out = _Forward(step).run(*args)
        step._count_uses()
        return out

    @property
    def tokens(self) -> int:
        """Saved tensors the last forward turned into tokens (recomputed in backward)."""
        return self.last.tokens

    @property
    def backward_peak_bytes(self) -> int:
        """With ``trace_memory``: the most activation bytes alive at an unpack or recompute of the
        last forward's backward so far."""
        return self.last.backward_peak_bytes

    def saved_bytes(self) -> int:
        """Bytes of the distinct storages, parameters and buffers left out, that the last forward
        left for backward (what autograd holds, tokens excepted, and what this executor holds): the
        quantity ``RematDecision.saved_bytes`` bounds. Call it between forward and backward."""
        return self.last._live_bytes()


class _Step:
    """One forward of a :class:`TensorRemat` and its backward: what it holds, memoises and counts."""

    def __init__(self, remat: TensorRemat):
        self.gm, self.actions, self.recompute, self.reads = remat.gm, remat.actions, remat.recompute, remat.reads
        self.held_nodes, self.random, self.trace_memory = remat.held_nodes, remat.random, remat.trace_memory
        self._ops, self._run = remat._ops, remat._run
        self.held: dict[fx.Node, Any] = {}
        self.memo: dict[fx.Node, tuple[Any, list[torch.Tensor]]] = {}
        self.uses: dict[fx.Node, int] = {}
        self.rng: dict[fx.Node, tuple[torch.Tensor, list[torch.Tensor], list[torch.device]]] = {}
        self.grad_flags: dict[fx.Node, tuple[bool, ...]] = {}
        self.owners: dict[int, _Owner] = {}
        self.packed: list[_Handle] = []
        self.handles: list[weakref.ref] = []
        self.tokens = 0
        self.backward_peak_bytes = 0
        self.with_packs: set[fx.Node] = set()

    def _count_uses(self) -> None:
        """After forward: the recomputed nodes backward will need (those with tokens, and what
        their recomputes read, recursively) each use their sources once; held values no needed
        recompute reads are dropped now."""
        needed = [n for n in self.recompute if self.uses.get(n, 0) > 0]
        seen = set(needed)
        while needed:
            for a in self.reads[needed.pop()]:
                self.uses[a] = self.uses.get(a, 0) + 1
                if a in self.recompute and a not in seen:
                    seen.add(a)
                    needed.append(a)
        for a in [a for a in self.held if self.uses.get(a, 0) == 0]:
            del self.held[a]

    def _pack(self, t: torch.Tensor) -> _Handle:
        h = _Handle(t)
        self.packed.append(h)
        self.handles.append(weakref.ref(h))
        return h

    def _live_bytes(self, *extra: torch.Tensor) -> int:
        """Bytes of the distinct activation storages alive for backward: what autograd still holds
        (tokens excepted), what this executor holds and has recomputed, and ``extra``."""
        params = {_key(t) for t in [*self.gm.parameters(), *self.gm.buffers()]}
        tensors = [h.tensor for h in (r() for r in self.handles) if h is not None and h.tensor is not None]
        values = [*self.held.values(), *self.memo.values()]
        tensors += [t for v in values for t in tree_leaves(v) if isinstance(t, torch.Tensor)]
        storages = {_key(t): t.untyped_storage().nbytes() for t in [*tensors, *extra] if _key(t) not in params}
        return sum(storages.values())

    def _owner(self, t: torch.Tensor) -> _Owner | None:
        o = self.owners.get(_key(t))
        return None if o is None or o.ref.expired() else o

    def after(self, node: fx.Node, out: Any, handles: list[_Handle]) -> None:
        """``node`` has run with output ``out``, packing ``handles``: record the storages it made,
        turn handles on recomputed nodes' storages into tokens, hold what recomputes will read."""
        for i, t in enumerate(x for x in tree_leaves(out) if isinstance(x, torch.Tensor)):
            if self._owner(t) is None:
                self.owners[_key(t)] = _Owner(StorageWeakRef(t.untyped_storage()), node, "out", i, _View.of(t))
        for k, h in enumerate(handles):
            t = h.tensor
            owner = self._owner(t)
            if owner is None:  # made inside the op: it owns it
                owner = self.owners[_key(t)] = _Owner(StorageWeakRef(t.untyped_storage()), node, "pack", k, _View.of(t))
            if owner.node in self.recompute:
                h.token, h.tensor = _Token(owner, _View.of(t)), None
                if owner.kind == "pack":  # its recompute replays the op with grad, once for all tokens
                    self.with_packs.add(owner.node)
                self.uses[owner.node] = self.uses.get(owner.node, 0) + 1
                self.tokens += 1
        if node in self.held_nodes:
            self.held[node] = out

    # -- backward -------------------------------------------------------------------------------

    def _unpack(self, h: _Handle) -> torch.Tensor:
        if h.token is None:
            if self.trace_memory:
                self.backward_peak_bytes = max(self.backward_peak_bytes, self._live_bytes())
            return h.tensor
        owner, view = h.token.owner, h.token.view
        out, packs = self._value(owner.node)
        base = packs[owner.index] if owner.kind == "pack" else \
            [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)][owner.index]
        if self.trace_memory:  # with the value just recomputed, before its last use drops it
            self.backward_peak_bytes = max(self.backward_peak_bytes, self._live_bytes(base))
        self._used(owner.node)
        if base.dtype != view.dtype:
            base = base.view(view.dtype)
        return base.as_strided(view.size, view.stride, view.offset - owner.view.offset + base.storage_offset())

    def _used(self, node: fx.Node) -> None:
        self.uses[node] -= 1
        if self.uses[node] <= 0:
            self.memo.pop(node, None)
            self.held.pop(node, None)

    def _value(self, node: fx.Node) -> tuple[Any, list[torch.Tensor]]:
        """``node``'s output (and the tensors its op packs, when a token needs one of those),
        recomputed if it is not memoised; its sources are used once."""
        hit = self.memo.get(node)
        if hit is not None:
            return hit
        need_packs = node in self.with_packs
        args, kwargs = self._args(node)
        packs: list[torch.Tensor] = []
        state = self.rng.get(node)
        with torch.random.fork_rng(devices=state[2] if state else [], enabled=state is not None):
            if state is not None:
                torch.set_rng_state(state[0])
                for dev, s in zip(state[2], state[1]):
                    torch.cuda.set_rng_state(s, dev)
            if need_packs:
                flags = iter(self.grad_flags.get(node, ()))
                args, kwargs = fx.node.map_aggregate((args, kwargs), lambda x: _as_input(x, flags))
                # The replay's graph keeps nothing (a saved output returned as is would make a
                # cycle, output -> grad_fn -> output, that outlives the step); it is never run.
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                        lambda t: packs.append(t.detach()), _never_unpacked):
                    out = self._run(node, args, kwargs)
                out = fx.node.map_aggregate(out, lambda x: x.detach() if isinstance(x, torch.Tensor) else x)
            else:
                with torch.no_grad():
                    out = self._run(node, args, kwargs)
        self.memo[node] = (out, packs)
        if self.trace_memory:  # the recompute's sources and its result, both alive
            self.backward_peak_bytes = max(self.backward_peak_bytes, self._live_bytes())
        for a in self.reads[node]:
            self._used(a)
        return out, packs

    def _args(self, node: fx.Node) -> tuple[tuple, dict]:
        cache: dict[fx.Node, Any] = {}

        def value(a: fx.Node) -> Any:
            if a in cache:
                return cache[a]
            if a.op == "get_attr":  # a buffer the op updates (batch-norm statistics) is updated once, in forward
                v = self._ops.fetch_attr(a.target)
                v = v.clone() if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter) else v
            elif a in self.held:
                v = self.held[a]
            elif a in self.recompute:
                v = self._value(a)[0]
            elif a.op == "placeholder" or a.name in self.actions:
                raise PassError(f"tensor remat: recomputing {node.name!r} needs {a.name!r}, which was neither "
                                f"held nor recomputable")
            else:  # a view, a getitem, a size: cheap, made again from its own inputs
                inner_args, inner_kwargs = fx.node.map_arg((a.args, a.kwargs), value)
                with torch.no_grad():
                    v = self._run(a, inner_args, inner_kwargs)
            cache[a] = v
            return v

        try:
            return fx.node.map_arg((node.args, node.kwargs), value)
        finally:  # ``value`` calls itself through its closure: a cycle that would keep the values until gc
            cache.clear()


class _Forward(fx.Interpreter):
    def __init__(self, remat: _Step):
        super().__init__(remat.gm)
        self.remat = remat

    def run_node(self, n: fx.Node) -> Any:
        remat = self.remat
        if n in remat.random:
            devices = _rng_devices(self.env.values())
            remat.rng[n] = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices], devices)
        if n in remat.recompute:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            remat.grad_flags[n] = tuple(x.requires_grad for x in tree_leaves((args, kwargs))
                                        if isinstance(x, torch.Tensor))
        start = len(remat.packed)
        out = super().run_node(n)
        handles = remat.packed[start:]
        del remat.packed[start:]
        remat.after(n, out, handles)
        return out


def _never_unpacked(_: None) -> torch.Tensor:
    raise PassError("tensor remat: a recompute's own graph was run backward; it is only run to see what it saves")


def _as_input(x: Any, flags) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    flag = next(flags, False)
    return x.detach().requires_grad_(flag) if flag and (x.is_floating_point() or x.is_complex()) else x.detach()


# ---------------------------------------------------------------------------------------------
# The lowered program: its forward runs the executor.

class TensorRematCodeGen(fx.graph.CodeGen):
    """Code of a program lowered under ``checkpointing="tensor"``: ``forward`` returns
    :func:`run_marked` of its arguments, so every call of the module runs the decision its nodes
    carry. The nodes' own code follows, never reached, so ``gm.code`` still reads as the graph.
    Set by ``passes.rewrites.apply_tensor_remat``; it survives ``recompile`` and ``copy.deepcopy`` (the
    graph keeps its code generator)."""

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, *, expanded_def: bool = False) -> str:
        head = super().gen_fn_def(free_vars, maybe_return_annotation, expanded_def=expanded_def)
        # free_vars: "self", then "name", "name: Type" or "name = default" per placeholder (after super())
        names = [re.match(r"\s*(\**\w+)", v).group(1) for v in free_vars if v.strip() != "self"]
        return head + f"\n    return _run_tensor_remat(self, ({''.join(n + ', ' for n in names)}))"

    def additional_globals(self) -> list[tuple[str, Any]]:
        return [*super().additional_globals(), ("_run_tensor_remat", run_marked)]


def run_marked(gm: fx.GraphModule, args: tuple) -> Any:
    """Run ``gm`` on ``args`` under the decision its nodes carry (``node.meta[TENSOR_REMAT]``).
    A fresh executor per call reads the graph as it is now (building one walks the graph once,
    far less than interpreting it)."""
    return TensorRemat(gm)(*args)

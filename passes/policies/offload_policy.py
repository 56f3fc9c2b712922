"""Transform (tag half): choose which saved activations wait in host memory between forward and
backward, and whether the optimizer state lives on the host. :mod:`passes.rewrites.apply_offload`
carries it out.

Unit of choice: an *owner* node and the storages it owns that autograd keeps for backward (its
outputs, or tensors made inside it such as a dropout mask), as ``annotate_memory`` observes
them on fake tensors (parameters, buffers and graph inputs are not activations and never move:
the caller keeps its inputs alive anyway). Offloading an owner moves each of its storages to host
once, whichever nodes (its *savers*) save views of it.

Cost model, at the dims' hints, with the caller's :class:`passes.ir.cost.CostHooks` (the
cluster the plan is lowered for): its ``compute_seconds`` over ``node.meta[FLOPS]`` and its
``host_copy_seconds``:

* ``transfer_s`` = Σ over its storages of 2 · ``host_copy_seconds(bytes)``: to host and back;
* ``hidden_behind_s`` = forward time of every node after the owner + backward time of every
  node after its last saver (backward runs in reverse, so those run before the first backward
  that reads the storage). Only matmul-class FLOPs count, so the window is a lower bound.

Selections
    * ``hidden``: owners with ``transfer_s <= hidden_behind_s``, largest first, while the link's
      total busy time stays within the step's compute time (one link carries every transfer),
      until ``target_bytes`` (if given) is reached.
    * ``all``: every owner of kept activations (the knob ``offload="activations"``).
    * ``none``: nothing; the meta still says what each owner would cost.

Optimizer state (``optimizer_on_host``): ``None`` decides from ``gm.meta[MEMORY_SUMMARY]``: the
state goes to the host when the step's peak does not fit in ``cost.device_memory_bytes``;
per step the gradients go to host and the updated parameters come back.
Writes ``node.meta[OFFLOAD]`` on every owner of kept activations and ``gm.meta[OFFLOAD_PLAN]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
from torch import fx

from passes.ir.config import OFFLOAD_SELECTIONS
from passes.ir.cost import CostHooks
from passes.ir.errors import ConfigError, PassError
# annotate_memory's forward observation (storages, owners, savers); private there, shared here.
from passes.analysis.annotate_memory import observe_saved_tensors as _observe_saved
from passes.ir.meta import (CAPTURE, FLOPS, MEMORY_SUMMARY, OFFLOAD, OFFLOAD_PLAN, OffloadMeta, OffloadPlan)

_OFFLOADABLE = ("activation", "internal")
_ZERO = sympy.Integer(0)


@dataclass(frozen=True)
class OwnedStorage:
    """One kept storage of an owner: its bytes and the nodes that save it."""

    bytes: sympy.Expr
    hint: int
    savers: tuple[fx.Node, ...]


def kept_storages(gm: fx.GraphModule) -> dict[fx.Node, list[OwnedStorage]]:
    """Owner node -> the activation storages it owns that autograd keeps for backward, in
    graph order (from ``annotate_memory``'s forward run on fake tensors)."""
    run = _observe_saved(gm)
    out: dict[fx.Node, list[OwnedStorage]] = {}
    for st in run.storages.values():
        if st.kept and st.kind in _OFFLOADABLE and st.owner is not None:
            savers = tuple(sorted(dict.fromkeys(run.outer(v) for v in st.savers), key=run.index.__getitem__))
            out.setdefault(run.outer(st.owner), []).append(OwnedStorage(st.size, st.hint, savers))
    return dict(sorted(out.items(), key=lambda kv: run.index[kv[0]]))



def offload_policy(gm: fx.GraphModule, ctx: Any = None, *, cost: CostHooks, selection: str = "hidden",
                   target_bytes: int | None = None, optimizer_on_host: bool | None = None) -> fx.GraphModule:
    """Decide which owners' saved activations go to host; write :class:`OffloadMeta` on every
    owner of kept activations and :class:`OffloadPlan` under ``gm.meta[OFFLOAD_PLAN]``.

    ``cost``: the device and host link of the cluster the plan is for; ``selection``: one of
    :data:`passes.ir.config.OFFLOAD_SELECTIONS`;
    ``target_bytes``: stop once this many bytes are offloaded (``hidden`` only);
    ``optimizer_on_host``: force the optimizer-state decision (``None``: decide, see module doc).
    Needs ``annotate_flops`` (and ``annotate_memory`` for the automatic optimizer decision).
    """
    if selection not in OFFLOAD_SELECTIONS:
        raise ConfigError(f"unknown offload selection {selection!r}; choose one of {', '.join(OFFLOAD_SELECTIONS)}")
    if target_bytes is not None and target_bytes < 0:
        raise ConfigError(f"offload target_bytes must be >= 0 (bytes), got {target_bytes}")
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    missing = [n.name for n in compute if FLOPS not in n.meta]
    if missing:
        raise PassError(f"offload_policy: node {missing[0]!r} has no node.meta[{FLOPS!r}]; run annotate_shapes "
                        f"and annotate_flops first")
    hints = gm.meta[CAPTURE].symbols() if CAPTURE in gm.meta else {}
    dtype = str(gm.meta[CAPTURE].dtype).removeprefix("torch.") if CAPTURE in gm.meta else "fp32"

    def seconds(flops: sympy.Expr) -> float:
        value = float(sympy.sympify(flops).subs(hints))
        return cost.compute_seconds(value, dtype) if value else 0.0

    order = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(order)}
    fwd = [seconds(n.meta[FLOPS].fwd) if FLOPS in n.meta else 0.0 for n in order]
    bwd = [seconds(n.meta[FLOPS].bwd) if FLOPS in n.meta else 0.0 for n in order]
    fwd_after = _suffix_sums(fwd)  # fwd_after[i]: forward seconds of nodes i+1..end
    bwd_after = _suffix_sums(bwd)
    step_s = sum(fwd) + sum(bwd)

    owners = kept_storages(gm)
    facts = {}
    for owner, storages in owners.items():
        nbytes = sympy.expand(sympy.Add(*[s.bytes for s in storages]))
        transfer = sum(2 * cost.host_copy_seconds(s.hint) for s in storages)
        last_saver = max((index[v] for s in storages for v in s.savers), default=index[owner])
        hidden = fwd_after[index[owner]] + bwd_after[last_saver]
        savers = tuple(dict.fromkeys(v.name for s in storages for v in s.savers))
        facts[owner] = (nbytes, sum(s.hint for s in storages), transfer, hidden, savers)

    chosen: dict[fx.Node, str] = {}
    reasons: dict[fx.Node, str] = {}
    if selection == "all":
        chosen = {o: "selection 'all'" for o in owners}
    elif selection == "none":
        reasons = {o: "selection 'none'" for o in owners}
    else:
        busy, moved = 0.0, 0
        for owner in sorted(owners, key=lambda o: (-facts[o][1], index[o])):  # largest first
            _, hint, transfer, hidden, _ = facts[owner]
            if target_bytes is not None and moved >= target_bytes:
                reasons[owner] = f"target of {target_bytes} bytes already met"
            elif transfer > hidden:
                reasons[owner] = f"transfer {transfer:.3g} s > compute {hidden:.3g} s until its backward use"
            elif busy + transfer > step_s:
                reasons[owner] = f"host link busy: {busy:.3g} s + {transfer:.3g} s > step compute {step_s:.3g} s"
            else:
                busy += transfer
                moved += hint
                chosen[owner] = f"transfer {transfer:.3g} s hides behind {hidden:.3g} s of compute"

    for owner, (nbytes, _, transfer, hidden, savers) in facts.items():
        owner.meta[OFFLOAD] = OffloadMeta(offload=owner in chosen, bytes=nbytes, transfer_s=transfer,
                                          hidden_behind_s=hidden, reason=chosen.get(owner) or reasons[owner],
                                          savers=savers)
    for node in order:
        if node not in owners:
            node.meta.pop(OFFLOAD, None)  # a re-run must not leave stale decisions

    opt = _optimizer_decision(gm, cost, optimizer_on_host, hints)
    names = tuple(o.name for o in owners if o in chosen)
    gm.meta[OFFLOAD_PLAN] = OffloadPlan(
        policy=selection, nodes=names,
        activation_bytes=sympy.expand(sympy.Add(*[facts[o][0] for o in chosen])) if chosen else _ZERO,
        link_s=sum(facts[o][2] for o in chosen), target_bytes=target_bytes, **opt)
    return gm


def _suffix_sums(values: list[float]) -> list[float]:
    """``out[i] = sum(values[i+1:])``."""
    out = [0.0] * len(values)
    for i in range(len(values) - 2, -1, -1):
        out[i] = out[i + 1] + values[i + 1]
    return out


def _optimizer_decision(gm: fx.GraphModule, cost: CostHooks, forced: bool | None, hints: dict) -> dict:
    summary = gm.meta.get(MEMORY_SUMMARY)
    if summary is None:
        if forced is None:
            return dict(optimizer_on_host=False, optimizer_bytes_moved=_ZERO, optimizer_state_bytes=_ZERO,
                        optimizer_reason="no gm.meta['memory_summary']: run annotate_memory to decide")
        params = [p for p in gm.parameters() if p.requires_grad]
        pbytes = sympy.Integer(sum(p.numel() * p.element_size() for p in params))
        state = sympy.Integer(sum(p.numel() * 4 * 3 for p in params))  # fp32 master + 2 Adam moments
        return dict(optimizer_on_host=forced, optimizer_bytes_moved=2 * pbytes if forced else _ZERO,
                    optimizer_state_bytes=state if forced else _ZERO, optimizer_reason="forced by the caller")
    moved = sympy.expand(summary.grad_bytes + summary.param_bytes)  # grads to host, params back
    state = sympy.expand(summary.optimizer_bytes + 4 * summary.param_count)  # moments + fp32 master
    peak = int(sympy.sympify(summary.peak_bytes).subs(hints))
    if forced is not None:
        on_host, reason = forced, "forced by the caller"
    elif peak > cost.device_memory_bytes:
        on_host = True
        reason = (f"step peak {peak} bytes > device memory {int(cost.device_memory_bytes)} bytes: keep the "
                  f"optimizer state on the host")
    else:
        on_host = False
        reason = f"step peak {peak} bytes fits in device memory {int(cost.device_memory_bytes)} bytes"
    if on_host and int(sympy.sympify(state).subs(hints)) > cost.host_memory_bytes:
        raise PassError(f"offload_policy: optimizer state of {state} bytes does not fit in the host memory of one "
                        f"device ({int(cost.host_memory_bytes)} bytes); shard it (ZeRO) across more devices")
    return dict(optimizer_on_host=on_host, optimizer_bytes_moved=moved if on_host else _ZERO,
                optimizer_state_bytes=state if on_host else _ZERO, optimizer_reason=reason)

"""The optimizer of a run: any ``torch.optim`` optimizer, built from parameter groups.

A run names its optimizer as one of

* ``None``: AdamW (torch's defaults, weight decay 0.01) with no weight decay on norms, biases
  and embeddings, as Megatron-LM and torchtitan train, stepped by torch's fused kernel
  (:func:`fused_where_supported`);
* a name of the optimizer table (:data:`passes.ir.optimizers.OPTIMIZERS`: ``"adamw"`` is the
  default above, ``"adam"`` (fused too), ``"adamw_unfused"`` and ``"adam_unfused"`` (torch's
  default implementation), ``"sgd"``, ``"sgd_momentum"``), torch's defaults otherwise, with the
  same two groups;
* a dict: AdamW's keyword arguments, with the same two groups (fused unless it names
  ``fused`` or ``foreach``);
* a factory ``f(param_groups) -> torch.optim.Optimizer``, e.g.
  ``lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9)``. It is called with the two
  groups of :func:`param_groups` (``"decay"`` then ``"no_decay"``, the second with
  ``weight_decay=0.0``), always both and in that order, so that a scheduler with one lambda per
  group sees the same groups on every rank. A factory that wants one group merges them.

Every rank builds the optimizer over the tensors it steps: its parameters, the fp32 masters of a
16-bit plan, or (ZeRO-1/2) the pieces of its flat chunk, which are grouped the same way. Sharding
is exact only for an *elementwise* optimizer (each element's update reads that element's
gradient and state alone): :data:`ELEMENTWISE` lists the torch ones; anything else is refused
under ZeRO (:func:`check_shardable`).

State layout (what checkpoints hold, what a load materialises): :func:`state_keys`.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from passes.ir.errors import ConfigError
from passes.ir.optimizers import FUSED_DEVICES, OPTIMIZERS

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]

ELEMENTWISE: tuple[type, ...] = (
    torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
)
"""torch optimizers whose step is elementwise (ZeRO shards them exactly)."""

GROUP_NAMES = ("decay", "no_decay")


def as_factory(optimizer: None | str | Mapping | OptimizerFactory) -> OptimizerFactory:
    """The factory of an optimizer argument (see the module docstring)."""
    if optimizer is None:
        return lambda groups: torch.optim.AdamW(groups, **fused_where_supported(groups))
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ConfigError(f"optimizer: unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}, or "
                              f"pass a factory f(param_groups) -> torch.optim.Optimizer")
        model = OPTIMIZERS[optimizer]
        cls, named_kwargs = getattr(torch.optim, model.torch_class), dict(model.torch_kwargs)
        if model.fused:
            return lambda groups: cls(groups, **named_kwargs, **fused_where_supported(groups))
        return lambda groups: cls(groups, **named_kwargs)
    if isinstance(optimizer, Mapping):
        kwargs = dict(optimizer)
        try:
            torch.optim.AdamW([torch.zeros(1, requires_grad=True)], **kwargs)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"optimizer: AdamW does not take {kwargs}: {exc}; pass AdamW's keyword arguments "
                              f"or a factory f(param_groups) -> torch.optim.Optimizer") from None
        if {"fused", "foreach", "differentiable"} & set(kwargs):  # the caller chose the implementation
            return lambda groups: torch.optim.AdamW(groups, **kwargs)
        return lambda groups: torch.optim.AdamW(groups, **kwargs, **fused_where_supported(groups))
    if callable(optimizer):
        return optimizer
    raise ConfigError(f"optimizer: got {type(optimizer).__name__}; pass None (AdamW), a name "
                      f"({', '.join(OPTIMIZERS)}), a dict of AdamW's keyword arguments, or a factory "
                      f"f(param_groups) -> torch.optim.Optimizer")


def fused_where_supported(groups: list[dict]) -> dict:
    """``{"fused": True}`` when torch's fused kernel can step every parameter of ``groups``
    (floating point, on a device type of :data:`passes.ir.optimizers.FUSED_DEVICES`), else ``{}``
    (torch's default implementation): what the named Adam-family optimizers build."""
    params = [p for g in groups for p in g["params"]]
    if params and all(torch.is_floating_point(p) and p.device.type in FUSED_DEVICES for p in params):
        return {"fused": True}
    return {}


def param_groups(params: Sequence[torch.Tensor], no_decay: Sequence[bool]) -> list[dict]:
    """The two parameter groups of ``params`` (``no_decay[i]``: parameter i takes no weight
    decay): ``[{"params": [...], "name": "decay"}, {"params": [...], "name": "no_decay",
    "weight_decay": 0.0}]``, both always present, each in the order given."""
    decay = [p for p, nd in zip(params, no_decay) if not nd]
    rest = [p for p, nd in zip(params, no_decay) if nd]
    return [{"params": decay, "name": GROUP_NAMES[0]}, {"params": rest, "name": GROUP_NAMES[1], "weight_decay": 0.0}]


def takes_no_decay(name: str, p: torch.Tensor, embeddings: Iterable[str] = ()) -> bool:
    """Norm weights and biases (fewer than 2 dims) and embedding tables take no weight decay."""
    return p.dim() < 2 or name in set(embeddings)


def module_param_groups(module: nn.Module) -> list[dict]:
    """:func:`param_groups` of a plain ``module`` (a single-device reference): each trainable
    parameter once, the weights of ``nn.Embedding`` modules and every 0/1-D parameter in
    ``"no_decay"``; the same split the lowering records for a rank's parameters."""
    embeddings = {f"{m_name}.weight" if m_name else "weight" for m_name, m in module.named_modules()
                  if isinstance(m, nn.Embedding)}
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    aliases: dict[int, set[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(n)
    flags = [p.dim() < 2 or bool(aliases[id(p)] & embeddings) for _, p in named]
    return param_groups([p for _, p in named], flags)


def build(factory: OptimizerFactory, groups: list[dict]) -> torch.optim.Optimizer:
    """``factory(groups)``, checked to be a torch optimizer with one group per given group."""
    opt = factory(groups)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(f"optimizer: the factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    if len(opt.param_groups) != len(groups):
        raise ConfigError(f"optimizer: the factory made {len(opt.param_groups)} param groups from {len(groups)}; "
                          f"pass the groups it is given to the optimizer")
    return opt


def check_shardable(opt: torch.optim.Optimizer, zero_stage: int) -> None:
    """Refuse, under ZeRO, an optimizer whose step is not elementwise."""
    if type(opt) not in ELEMENTWISE:
        raise ConfigError(f"optimizer: ZeRO-{zero_stage} shards the optimizer state elementwise, and "
                          f"{type(opt).__name__} is not one of the elementwise optimizers "
                          f"({', '.join(c.__name__ for c in ELEMENTWISE)}); use one of them or plan with zero_stage=0")


def state_keys(opt: torch.optim.Optimizer, group: Mapping) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(scalar keys, elementwise tensor keys) of the per-parameter state ``opt`` keeps for a
    parameter of ``group`` once it has stepped (torch's layouts)."""
    kind = type(opt)
    if kind in (torch.optim.AdamW, torch.optim.Adam):
        return ("step",), ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
    if kind is torch.optim.SGD:
        return (), (("momentum_buffer",) if group.get("momentum", 0) else ())
    if kind is torch.optim.Adamax:
        return ("step",), ("exp_avg", "exp_inf")
    if kind is torch.optim.NAdam:
        return ("step", "mu_product"), ("exp_avg", "exp_avg_sq")
    if kind is torch.optim.RAdam:
        return ("step",), ("exp_avg", "exp_avg_sq")
    if kind is torch.optim.RMSprop:
        return ("step",), (("square_avg",) + (("momentum_buffer",) if group.get("momentum", 0) else ())
                           + (("grad_avg",) if group.get("centered") else ()))
    if kind is torch.optim.Adagrad:
        return ("step",), ("sum",)
    raise ConfigError(f"optimizer: the state layout of {kind.__name__} is not known; checkpoints hold the state of "
                      f"{', '.join(c.__name__ for c in ELEMENTWISE)}")


_SCALAR_START = {"step": 0.0, "mu_product": 1.0}


def init_state(opt: torch.optim.Optimizer) -> None:
    """Allocate the state of every parameter that has none yet, as zeros (``step`` 0,
    ``mu_product`` 1): what a load reads into. For the Adam family these are exactly the values
    the first step would start from; for SGD with momentum a zero buffer is not the first step's
    (``buf = grad``) unless dampening is 0, so only a load, which overwrites it, may call this."""
    for group in opt.param_groups:
        scalars, tensors = state_keys(opt, group)
        for p in group["params"]:
            state = opt.state[p]
            if state:
                continue
            # the fused kernel keeps ``step`` on the parameter's device in fp32 (as torch's own
            # first step makes it); the other implementations keep it on the host
            on_device = bool(group.get("fused") or group.get("capturable"))
            for key in scalars:
                state[key] = (torch.full((), _SCALAR_START[key], dtype=torch.float32, device=p.device) if on_device
                              else torch.tensor(_SCALAR_START[key], dtype=torch.get_default_dtype()))
            for key in tensors:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def init_state_exact(opt: torch.optim.Optimizer) -> None:
    """:func:`init_state` where it is exactly what the first step allocates (the Adam family),
    so the state exists from the start (its memory stays put); other optimizers keep torch's
    lazy state."""
    if type(opt) in (torch.optim.AdamW, torch.optim.Adam, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam):
        init_state(opt)


def current_lr(opt: torch.optim.Optimizer) -> float:
    """The learning rate of the first group (what a scheduler set for the next step)."""
    lr = opt.param_groups[0]["lr"]
    return float(lr)


def planner_optimizer(factory: OptimizerFactory) -> str:
    """The name the planner costs this optimizer's state by (a key of
    :data:`passes.ir.optimizers.OPTIMIZERS`): the factory is built once over a one-element tensor
    to see what it makes, and whether it asked for the fused kernel. Optimizers whose state is two
    elementwise tensors cost as unfused Adam, one as SGD with momentum."""
    probe = build(factory, param_groups([torch.zeros(1, requires_grad=True)], [False]))
    kind = type(probe)
    fused = bool(probe.defaults.get("fused"))
    if kind is torch.optim.AdamW:
        return "adamw" if fused else "adamw_unfused"
    if kind is torch.optim.Adam:
        return "adam" if fused else "adam_unfused"
    if kind is torch.optim.SGD:
        return "sgd_momentum" if probe.param_groups[0].get("momentum", 0) else "sgd"
    if kind in ELEMENTWISE:
        _, tensors = state_keys(probe, probe.param_groups[0])
        return {0: "sgd", 1: "sgd_momentum"}.get(len(tensors), "adam_unfused")
    raise ConfigError(f"optimizer: the planner costs the state of {', '.join(c.__name__ for c in ELEMENTWISE)}; "
                      f"{kind.__name__}'s is not known, so its plan's memory could not be trusted")

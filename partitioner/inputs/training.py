"""What a model trains with: :class:`Training`, one typed group that every front door takes.

``auto_parallelize(model, training=Training(global_batch=16, optimizer="sgd"))``,
``plan(model, cluster, training=Training(global_batch=512, dtype="bf16"))`` and the ``plan`` and
``train`` commands (``--global-batch``, ``--optimizer``, ``--dtype``, ``--clip-grad-norm``, ...)
read the same fields with the same defaults. Each field is checked when the group is made, so a
bad value is refused before any rank starts work, with a :class:`ConfigError` naming the field,
the rule and a fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

from partitioner.inputs.run_options import check_option
from passes.ir.config import DTYPES, DType
from passes.ir.errors import ConfigError
from runtime.optim.lr_schedules import SchedulerFactory
from runtime.optim.optimizers import OptimizerFactory, as_factory, planner_optimizer

NONFINITE: tuple[str, ...] = ("stop", "skip")


@dataclass(frozen=True, kw_only=True, slots=True)
class Training:
    """What to train with: the batch, the optimizer and its schedule, clipping, the dtype."""

    global_batch: int
    """Samples per optimizer step, over the whole job (``--global-batch``)."""
    optimizer: str | Mapping[str, Any] | OptimizerFactory | None = "adamw"
    """A name of the optimizer table (:data:`passes.ir.optimizers.OPTIMIZERS`: ``"adamw"``,
    ``"adam"``, ``"adamw_unfused"``, ``"adam_unfused"``, ``"sgd"``, ``"sgd_momentum"``;
    ``--optimizer``), AdamW's keyword arguments (``{"lr": 3e-4}``), or a factory
    ``f(param_groups) -> torch.optim.Optimizer`` over the two groups ``decay`` and ``no_decay``
    (:mod:`runtime.optim.optimizers`; under ZeRO an elementwise one). ``"adamw"`` (or ``None``):
    AdamW with torch's defaults, stepped by its fused kernel, and no weight decay on norms,
    biases and embeddings. The planner counts the state of the optimizer this makes."""
    lr_scheduler: SchedulerFactory | None = None
    """``f(optimizer) -> torch.optim.lr_scheduler.LRScheduler``, stepped with every optimizer step
    taken (``runtime.warmup_cosine(warmup_steps, total_steps)``; ``--warmup``). ``None``: the
    optimizer's learning rate throughout. Planning ignores it."""
    clip_grad_norm: float | None = None
    """Clip the global gradient norm (over every rank) to this (``--clip-grad-norm``); ``None``:
    no clipping."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf gradient ``"stop"`` s the run (:class:`NonFiniteError` naming the step) or its step
    is ``"skip"`` ped on every rank."""
    dtype: DType | None = None
    """``"fp32"``, ``"bf16"`` or ``"fp16"`` (``--dtype``): a 16-bit dtype trains 16-bit parameters,
    gradients and activations with fp32 master weights and optimizer state (fp16 with dynamic
    loss scaling). ``None``: a given plan's dtype, else the cluster's
    (:attr:`partitioner.cost.cluster.Cluster.default_dtype`: bf16 on GPUs, fp32 on CPU ranks)."""

    def __post_init__(self) -> None:
        check_option("global_batch", self.global_batch, spelled="Training.global_batch")
        self.optimizer_name()  # a bad name, dict or factory is refused here, naming the field
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise ConfigError(f"Training.lr_scheduler is {type(self.lr_scheduler).__name__}, not a factory; pass "
                              f"f(optimizer) -> LRScheduler, e.g. runtime.warmup_cosine(warmup_steps=100, "
                              f"total_steps=1000), or None")
        if self.clip_grad_norm is not None:
            check_option("clip_grad_norm", self.clip_grad_norm, spelled="Training.clip_grad_norm")
        if self.nonfinite not in NONFINITE:
            raise ConfigError(f"Training.nonfinite={self.nonfinite!r}; choose 'stop' (a NaN/inf gradient stops the "
                              f"run) or 'skip' (that step is skipped on every rank)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError(f"Training.dtype {self.dtype!r} is not a training dtype; choose one of "
                              f"{', '.join(DTYPES)}, or None (the cluster's: bf16 on GPUs, fp32 on CPU ranks)")

    def optimizer_factory(self) -> OptimizerFactory:
        """The factory ``f(param_groups) -> torch.optim.Optimizer`` of :attr:`optimizer`."""
        try:
            return as_factory(self.optimizer)
        except ConfigError as exc:
            raise ConfigError(f"Training.{exc}") from None

    def optimizer_name(self) -> str:
        """The name the planner counts this optimizer's state by (a key of
        :data:`passes.ir.optimizers.OPTIMIZERS`): the name given, or what the factory makes."""
        if isinstance(self.optimizer, str):
            self.optimizer_factory()  # an unknown name is refused, naming the choices
            return self.optimizer
        factory = self.optimizer_factory()
        try:
            return planner_optimizer(factory)  # builds it once over a one-element parameter
        except ConfigError as exc:
            raise ConfigError(f"Training.{exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's factory: say so, in one line
            raise ConfigError(f"Training.optimizer: the factory raised {type(exc).__name__}: {exc}; pass "
                              f"f(param_groups) -> torch.optim.Optimizer over the groups it is given "
                              f"(decay, no_decay)") from exc

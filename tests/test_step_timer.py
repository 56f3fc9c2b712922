"""``runtime.observe.measure.StepTimer``'s split of the optimizer step: the gradient norm's all-reduce
(it waits for the mesh's last rank) and a ZeRO optimizer's all-gather are collectives, the rest
of ``STEP`` is the optimizer; and while the optimizer runs after the norm, the running action is
``STEP`` again (what a fault message names)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from runtime.observe.measure import StepTimer

NORM_S, GATHER_S, OPTIMIZER_S = 0.05, 0.03, 0.04


class _Model:
    """What StepTimer instruments, with known seconds in each part of the step."""

    def __init__(self):
        noop = lambda *a, **k: None  # noqa: E731
        self.executor = SimpleNamespace(**{name: noop for name in (
            "_forward", "_backward", "_backward_weight", "_recv_f", "_recv_b", "_send_f", "_send_b", "_flush",
            "_take_recvs", "_wait_sends")})
        self.mesh = SimpleNamespace(device=torch.device("cpu"), rank=0)
        self.optimizer = SimpleNamespace(publish=lambda: time.sleep(GATHER_S))
        self.params = []
        self.seen: list = []

    def _grad_sync(self):
        pass

    def _grad_norm(self, grads):
        time.sleep(NORM_S)
        return 1.0

    def _step(self):
        self._grad_norm([])
        self.seen.append(self.timer.last_action)  # the optimizer runs now
        time.sleep(OPTIMIZER_S)
        self.optimizer.publish()

    def train_step(self):
        self._grad_sync()
        self._step()
        return 0.0


def test_the_norm_and_the_gather_are_collectives_and_step_is_running_again_after_them():
    model = _Model()
    model.timer = StepTimer(model, track_memory=False)
    m = model.timer.measure(1, model.train_step)
    assert m.collective_s == pytest.approx(NORM_S + GATHER_S, abs=0.02)
    assert m.optimizer_s == pytest.approx(OPTIMIZER_S, abs=0.02)
    assert model.seen == ["STEP"]
    labels = [label for label, _, _ in m.timeline]
    assert labels == ["ALL_REDUCE", "GRAD_NORM", "ALL_GATHER", "STEP"]

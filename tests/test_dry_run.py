"""The dry run: a 16-rank job's distinct rank programs run here, on fake tensors and a fake group."""
from __future__ import annotations

import pytest

from partitioner import Training
from partitioner.api.dry_run import Collective, RankRun, check_sequences, dry_run, representatives
from passes.ir.config import ParallelConfig
from runtime.kernels.collectives import get_group, register_group

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=16"
FIX = "dp=4,tp=2,pp=2"
TRAINING = Training(global_batch=16)


@pytest.fixture(scope="module")
def plan():
    from partitioner.api.planning import plan as make_plan

    return make_plan(MODEL, "dgx-h100", nodes=2, training=TRAINING, fix=FIX)


def test_representatives_stand_for_every_rank():
    config = ParallelConfig.for_global_batch(16, dp=4, tp=2, pp=2)
    reps = representatives(config)
    assert reps == {0: (0, 2, 4, 6), 1: (1, 3, 5, 7), 8: (8, 10, 12, 14), 9: (9, 11, 13, 15)}
    cp = ParallelConfig.for_global_batch(8, dp=2, cp=2, tp=2)
    assert representatives(cp) == {0: (0, 4), 1: (1, 5), 2: (2, 6), 3: (3, 7)}  # cp ranks differ, replicas not


def test_sixteen_ranks_run_and_agree(plan):
    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan)
    assert report.world_size == 16 and report.ok, report.text()
    assert sorted(m for r in report.ranks for m in r.stands_for) == list(range(16))
    by_rank = {r.rank: r for r in report.ranks}
    assert sorted(by_rank) == [0, 1, 8, 9]
    for a, b in ((0, 1), (8, 9)):  # the tp peers issue the same collectives on their tp group
        calls = [[c.key() for c in by_rank[r].collectives if c.group == (a, b)] for r in (a, b)]
        assert calls[0] == calls[1] and any(k[0] == "reduce_scatter" for k in calls[0])
    for r in report.ranks:  # the data-parallel gradient all-reduce runs over the rank's 4 replicas
        assert any(c.op == "all_reduce" and c.group == r.stands_for for c in r.collectives)
    sends = [c for c in by_rank[0].collectives if c.op == "send"]
    assert sends and sends[0].peer == 8
    assert "rank 9 (pp=1 tp=1 cp=0) for ranks (9, 11, 13, 15): OK" in report.text()


class _SkipFirstAllReduce:
    """A tp group that skips its first all-reduce (a collective missing on one rank)."""

    def __init__(self, inner):
        self.inner, self.skipped = inner, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_reduce(self, t, op):
        if not self.skipped:
            self.skipped = True
            return t.clone()
        return self.inner.all_reduce(t, op)


def test_a_collective_missing_on_one_tp_rank_is_named(plan):
    def plant(rank, model):
        if rank == 1:
            register_group(model.tp_group_name, _SkipFirstAllReduce(get_group(model.tp_group_name)))

    report = dry_run(MODEL, "dgx-h100", nodes=2, training=TRAINING, plan=plan, ranks=(0, 1), edit=plant)
    assert all(r.ok for r in report.ranks) and not report.ok
    assert len(report.mismatches) == 1, report.mismatches
    message = report.mismatches[0]
    assert message.startswith("group (0, 1): call ") and "rank 0 all_reduce" in message and "rank 1 " in message


def test_a_rank_that_raises_is_named_and_the_cli_fails(plan, tmp_path, monkeypatch, capsys):
    from partitioner.cli.main import main
    from runtime.exec.parallel_model import ParallelModel

    real = ParallelModel.train_step

    def train_step(self, batch):
        if self.mesh.rank == 9:
            raise RuntimeError("planted failure")
        return real(self, batch)

    monkeypatch.setattr(ParallelModel, "train_step", train_step)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    code = main(["dry-run", "--plan", str(path), "--cluster", "dgx-h100", "--nodes", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "rank 9 (pp=1 tp=1 cp=0) for ranks (9, 11, 13, 15): FAILED: RuntimeError: planted failure" in out
    assert "rank 0 (pp=0 tp=0 cp=0) for ranks (0, 2, 4, 6): OK" in out


def test_messages_are_matched_by_shape():
    send = Collective("send", (0, 2), (4, 8), "torch.float32", peer=2, group_id="5")
    recv = Collective("recv", (0, 2), (4, 16), "torch.float32", peer=0, group_id="5")
    runs = [RankRun(0, (0,), 0, 0, 0, ok=True, collectives=[send]),
            RankRun(2, (2,), 1, 0, 0, ok=True, collectives=[recv])]
    (problem,) = check_sequences(runs)
    assert problem == ("messages rank 0 -> rank 2 on (0, 2): message 0 is [4, 8] float32 as sent and "
                       "[4, 16] float32 as received (1 sent, 1 received)")

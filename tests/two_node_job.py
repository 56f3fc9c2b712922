"""One rank of the two-node test job (tests/test_two_node.py), started by torchrun.

It trains as ``partitioner train`` does (:func:`partitioner.api.auto.auto_parallelize`, then
:func:`partitioner.cli.demo.train_loop` on :func:`partitioner.cli.demo.batch_for`) and writes
``<out>/rank<R>.json``: where torchrun put this rank (global rank, world size, node and local
rank, which launcher started it), its pipeline and data-parallel peers, and the loss of every
step at full precision (the CLI prints four digits, too few to compare to 1e-5).

    python -m torch.distributed.run ... tests/two_node_job.py --model M --global-batch 8 --steps 4 \
        --fix dp=2,pp=2 --cluster C.json --out DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

LAUNCHER_ENV = "TWO_NODE_LAUNCHER"
"""Which of the two launchers (0 or 1) started this rank: set by the test on each launcher."""


@dataclass(frozen=True, kw_only=True)
class RankRecord:
    """What one rank of the job reports."""

    rank: int
    world_size: int
    group_rank: int
    """torchrun's node rank of this rank (GROUP_RANK): c10d assigns it at rendezvous."""
    local_rank: int
    launcher: int
    """The launcher that started this rank (:data:`LAUNCHER_ENV`)."""
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    losses: tuple[float, ...]

    @classmethod
    def read(cls, path: Path) -> RankRecord:
        data = json.loads(path.read_text())
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--fix", required=True)
    parser.add_argument("--cluster", required=True, help="preset or cluster file")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective/receive may wait")
    parser.add_argument("--out", required=True, help="directory for rank<R>.json")
    args = parser.parse_args(argv)

    import torch.distributed as dist

    from partitioner import Job, Training
    from partitioner.api.auto import auto_parallelize
    from partitioner.cli.demo import batch_for, train_loop

    trainer = auto_parallelize(args.model, args.cluster, training=Training(global_batch=args.global_batch),
                               fix=args.fix, job=Job(timeout_s=args.timeout))
    losses = train_loop(trainer, args.steps, lambda k: batch_for(trainer.spec, k, args.global_batch), echo=False)
    mesh = trainer.model.mesh
    record = RankRecord(rank=dist.get_rank(), world_size=dist.get_world_size(),
                        group_rank=int(os.environ["GROUP_RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                        launcher=int(os.environ[LAUNCHER_ENV]), pp_ranks=tuple(mesh.pp_ranks),
                        dp_ranks=tuple(mesh.dp_ranks), losses=tuple(losses))
    trainer.finish()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{record.rank}.json").write_text(json.dumps(dataclasses.asdict(record)))
    from runtime.dist import heartbeat

    heartbeat.stop()  # as `partitioner train` does: the beat thread's store connection ends before the groups
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

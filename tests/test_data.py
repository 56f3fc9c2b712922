"""Data per rank (:mod:`runtime.exec.data`): the sharded, resumable sampler, the loader that reads only
the fields a rank's stages consume, the text dataset, ``AutoParallel.fit`` on 4 gloo ranks against
``train_step`` on the same global batches, and ``partitioner train --data`` through the CLI."""
from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from passes.ir.errors import ConfigError
from passes.ir.meta import InputSpec
from runtime.exec.data import BYTE_VOCAB, RankLoader, ShardedSampler, TokenFileDataset, probe_dataset
from runtime.dist.launch import spawn
from tests.train_cli import launch_train, outputs_of_success

MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=8,dropout=0.0"
SEQ, GLOBAL, SEED = 8, 8, 7


def _text(lines: int = 200) -> str:
    """A few KB of learnable text with some non-ASCII bytes."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "naïve", "café"]
    return "".join(f"{words[i % 10]} {words[(3 * i) % 10]} {words[(7 * i + 1) % 10]} {i % 13}.\n"
                   for i in range(lines))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(_text(), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------
# ShardedSampler

def test_order_is_a_function_of_seed_and_epoch_and_steps_run_across_epochs():
    n, b = 10, 4
    s = ShardedSampler(n, b, seed=3)
    flat = sum((s.global_indices(k) for k in range(5)), [])  # 20 positions: exactly two epochs
    assert sorted(flat[:n]) == list(range(n)) and sorted(flat[n:]) == list(range(n))
    assert flat[:n] != flat[n:], "each epoch gets its own permutation"
    assert flat == sum((ShardedSampler(n, b, seed=3).global_indices(k) for k in range(5)), [])
    assert flat != sum((ShardedSampler(n, b, seed=4).global_indices(k) for k in range(5)), [])
    assert ShardedSampler(n, b, seed=0).global_indices(1) != ShardedSampler(n, b, seed=1).global_indices(0)


def test_resume_at_step_k_continues_the_uninterrupted_sequence():
    whole = ShardedSampler(37, 6, dp=2, dp_index=1, seed=SEED)
    expected = [whole.take() for _ in range(15)]
    first = ShardedSampler(37, 6, dp=2, dp_index=1, seed=SEED)
    got = [first.take() for _ in range(4)]
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps
    resumed = ShardedSampler(37, 6, dp=2, dp_index=1, seed=0)
    resumed.load_state_dict(state)
    assert resumed.seed == SEED and resumed.step == 4
    got += [resumed.take() for _ in range(11)]
    assert got == expected


def test_dp_shares_concatenate_to_the_global_batch_and_a_replanned_job_continues():
    one = ShardedSampler(23, 8, seed=SEED)
    for dp in (2, 4, 8):
        ranks = [ShardedSampler(23, 8, dp=dp, dp_index=d, seed=SEED) for d in range(dp)]
        for k in range(7):
            assert sum((r.indices(k) for r in ranks), []) == one.global_indices(k)
    # stopped at step 3 with dp=1, continued with dp=2: the same global sequence
    for _ in range(3):
        one.take()
    halves = [ShardedSampler(23, 8, dp=2, dp_index=d) for d in range(2)]
    for h in halves:
        h.load_state_dict(one.state_dict())
    assert [halves[0].take() + halves[1].take() for _ in range(3)] == [one.take() for _ in range(3)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), per_rank=st.integers(1, 6), dp=st.sampled_from([1, 2, 3, 4]), seed=st.integers(0, 2**40),
       stop=st.integers(0, 12))
def test_any_sizes_shares_partition_each_step_and_resume_anywhere(n, per_rank, dp, seed, stop):
    b = per_rank * dp
    whole = ShardedSampler(n, b, seed=seed)
    ranks = [ShardedSampler(n, b, dp=dp, dp_index=d, seed=seed) for d in range(dp)]
    for k in range(stop + 3):
        assert sum((r.indices(k) for r in ranks), []) == whole.global_indices(k)
    # positions [0, E*n) cover every sample E times
    epochs = (stop + 3) * b // n
    flat = sum((whole.global_indices(k) for k in range(stop + 3)), [])[:epochs * n]
    assert sorted(flat) == sorted(list(range(n)) * epochs)
    resumed = ShardedSampler(n, b, dp=dp, dp_index=dp - 1)
    first = ShardedSampler(n, b, dp=dp, dp_index=dp - 1, seed=seed)
    for _ in range(stop):
        first.take()
    resumed.load_state_dict(first.state_dict())
    assert [resumed.take() for _ in range(3)] == [ranks[-1].indices(k) for k in range(stop, stop + 3)]


def test_another_global_batch_resumes_at_the_same_sample_position_or_is_refused():
    a = ShardedSampler(50, 4, seed=1)
    for _ in range(6):
        a.take()
    state = a.state_dict()  # 24 samples consumed
    b = ShardedSampler(50, 8, seed=1)
    b.load_state_dict(state)
    assert b.step == 3 and b.take() == a.take() + a.take()
    with pytest.raises(ConfigError, match="multiple of the global batch 16"):
        ShardedSampler(50, 16).load_state_dict(state)
    with pytest.raises(ConfigError, match="same data"):
        ShardedSampler(51, 4).load_state_dict(state)
    with pytest.raises(ConfigError, match="multiple of dp"):
        ShardedSampler(50, 6, dp=4)


def test_sampler_serves_as_a_dataloader_batch_sampler():
    ds = [torch.tensor([i]) for i in range(12)]
    s = ShardedSampler(12, 4, dp=2, dp_index=1, seed=2)
    loader = iter(torch.utils.data.DataLoader(ds, batch_sampler=s))
    for k in range(5):
        assert next(loader).flatten().tolist() == s.indices(k)


# ---------------------------------------------------------------------------------------------
# RankLoader

INPUTS = (InputSpec(name="x", shape=("batch", "seq", 3), dtype=torch.float32),
          InputSpec(name="y", shape=("batch", "seq"), dtype=torch.long, high=5))


class Recording(torch.utils.data.Dataset):
    """Wraps a dataset and records every index read (picklable: ranks get it by value)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []
        if hasattr(inner, "vocab_size"):
            self.vocab_size = inner.vocab_size

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        self.reads.append(int(i))
        return self.inner[i]


class Samples(torch.utils.data.Dataset):
    """``n`` samples ``(x, y)`` of seq 4 (tuples in input order); sample ``odd`` has seq 5."""

    def __init__(self, n: int, odd: int | None = None):
        self.n, self.odd = n, odd

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        seq = 5 if i == self.odd else 4
        return (torch.full((seq, 3), float(i)), torch.arange(seq) % 5)


def test_loader_keeps_only_consumed_fields_of_its_share_and_counts_their_bytes():
    ds = Recording(Samples(10))
    sampler = ShardedSampler(10, 4, dp=2, dp_index=1, seed=SEED)
    loader = RankLoader(ds, sampler, ("x",), INPUTS)
    assert ds.reads == [0]  # the probe
    for k in range(4):
        rows, dims = loader.next()
        share = ShardedSampler(10, 4, dp=2, dp_index=1, seed=SEED).indices(k)
        assert dims == {"seq": 4} and set(rows) == {"x"}
        assert rows["x"].shape == (2, 4, 3) and rows["x"][:, 0, 0].tolist() == [float(i) for i in share]
        assert loader.last_step_bytes == 2 * 4 * 3 * 4
    assert loader.loaded_bytes == 4 * 2 * 4 * 3 * 4
    assert ds.reads[1:] == sum((ShardedSampler(10, 4, dp=2, dp_index=1, seed=SEED).indices(k) for k in range(4)), [])


def test_a_rank_that_consumes_nothing_never_indexes_the_dataset_after_the_probe():
    ds = Recording(Samples(10))
    loader = RankLoader(ds, ShardedSampler(10, 4, seed=SEED), (), INPUTS)
    for _ in range(5):
        rows, dims = loader.next()
        assert rows == {} and dims == {"seq": 4}
    assert ds.reads == [0] and loader.loaded_bytes == 0 and loader.sampler.step == 5


def test_samples_of_another_shape_or_values_out_of_range_are_refused():
    sampler = ShardedSampler(10, 10, seed=SEED)
    with pytest.raises(ConfigError, match="fixed shapes"):
        RankLoader(Samples(10, odd=6), sampler, ("x", "y"), INPUTS).next()
    with pytest.raises(ConfigError, match=r"takes \[0, 3\)"):
        RankLoader(Samples(10), ShardedSampler(10, 10), ("y",), (INPUTS[0], InputSpec(
            name="y", shape=("batch", "seq"), dtype=torch.long, high=3))).next()
    with pytest.raises(ConfigError, match="missing"):
        probe_dataset([{"x": torch.zeros(4, 3)}], INPUTS)
    with pytest.raises(ConfigError, match="one sample is"):
        probe_dataset([(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long))], INPUTS)


# ---------------------------------------------------------------------------------------------
# TokenFileDataset

def test_byte_level_windows_round_trip_the_text(text_file):
    ds = TokenFileDataset(text_file, SEQ)
    raw = text_file.read_bytes()
    assert ds.vocab_size == BYTE_VOCAB and len(ds) == (len(raw) - 1) // SEQ
    ids = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    assert bytes(ids.tolist()) == raw[:len(ds) * SEQ]
    last = ds[len(ds) - 1]
    assert bytes(last["labels"].tolist()) == raw[(len(ds) - 1) * SEQ + 1:len(ds) * SEQ + 1]
    for i in (0, 5, len(ds) - 1):
        s = ds[i]
        assert s["input_ids"].dtype == s["labels"].dtype == torch.int64
        assert torch.equal(s["input_ids"][1:], s["labels"][:-1])
    assert ds.decode(torch.cat([ds[0]["input_ids"], ds[0]["labels"][-1:]])) == raw[:SEQ + 1].decode()
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_model_vocab_below_the_tokens_is_refused_naming_the_fix(text_file):
    ds = TokenFileDataset(text_file, SEQ, names=("idx", "targets"))
    small = [InputSpec(name=n, shape=("batch", "seq"), dtype=torch.long, high=64) for n in ("idx", "targets")]
    with pytest.raises(ConfigError, match="vocab of at least 256"):
        probe_dataset(ds, small)
    with pytest.raises(ConfigError, match="fewer than one window"):
        TokenFileDataset(text_file, len(text_file.read_bytes()))


def test_hugging_face_tokenizer_by_name_or_a_clear_error(tmp_path, text_file, monkeypatch):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: no network retries
    with pytest.raises(ConfigError, match="cannot load tokenizer 'no-such/tokenizer-here'"):
        TokenFileDataset(text_file, SEQ, tokenizer="no-such/tokenizer-here")
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([_text()], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    ds = TokenFileDataset(text_file, 4, tokenizer=str(tmp_path / "tok"))
    ids = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    assert ds.vocab_size == len(tok.get_vocab()) and int(ids.max()) < ds.vocab_size
    assert ds.decode(ids[:3]) == " ".join(_text().split()[:3])
    assert len(ds) == (ds.num_tokens - 1) // 4


# ---------------------------------------------------------------------------------------------
# AutoParallel.fit on 4 ranks (dp=2, pp=2)

def _fit_rank(path: str, steps: int) -> dict:
    from partitioner import Job, Training
    from partitioner.api.auto import auto_parallelize

    ds = Recording(TokenFileDataset(path, SEQ, names=("idx", "targets")))
    a = auto_parallelize(MODEL, training=Training(global_batch=GLOBAL), fix="dp=2,pp=2", job=Job(timeout_s=120.0))
    per_step = []
    fit_losses = a.fit(ds, steps=steps, seed=SEED, on_step=lambda step, loss: per_step.append(a.loader.last_step_bytes))
    out = dict(consumed=a.model.consumed_inputs, dp_index=a.model.mesh.dp_index, pp_index=a.model.mesh.pp_index,
               reads=list(ds.reads), per_step=per_step, total=a.loader.loaded_bytes, fit=fit_losses,
               sampler=a.sampler.state_dict())
    # the same run driven by train_step: fresh weights (built with the same seed), the global batches
    b = auto_parallelize(MODEL, training=Training(global_batch=GLOBAL), plan=a.plan, job=Job(timeout_s=120.0))
    plain = TokenFileDataset(path, SEQ, names=("idx", "targets"))
    order = ShardedSampler(len(plain), GLOBAL, seed=SEED)
    out["train_step"] = []
    for k in range(steps):
        samples = [plain[i] for i in order.global_indices(k)]
        batch = tuple(torch.stack([s[n] for s in samples]) for n in ("idx", "targets"))
        out["train_step"].append(b.train_step(batch))
    return out


@pytest.mark.slow
def test_fit_loads_each_ranks_share_only_and_matches_train_step(text_file):
    steps = 3
    results = spawn(_fit_rank, 4, str(text_file), steps, timeout_s=600.0)
    n = len(TokenFileDataset(text_file, SEQ))
    share = GLOBAL // 2 * SEQ * torch.tensor([], dtype=torch.int64).element_size()  # one field of a dp shard
    seen = {}
    for r in results:
        seen[(r["dp_index"], r["pp_index"])] = r["consumed"]
        assert r["consumed"] == (("idx",) if r["pp_index"] == 0 else ("targets",))
        assert r["per_step"] == [share] * steps and r["total"] == share * steps
        mine = ShardedSampler(n, GLOBAL, dp=2, dp_index=r["dp_index"], seed=SEED)
        assert r["reads"] == [0] + sum((mine.indices(k) for k in range(steps)), [])  # probe, then its share
        assert r["sampler"]["step"] == steps
        assert r["fit"] == results[0]["fit"]
        assert r["fit"] == pytest.approx(r["train_step"], rel=1e-6, abs=0)
    assert len(seen) == 4


# ---------------------------------------------------------------------------------------------
# partitioner train --data on 2 ranks, with metrics, checkpoints and a resume

CLI_MODEL = "gpt:layers=2,hidden=32,heads=2,vocab=256,seq=16,dropout=0.0"


def _train(world: int, *args: str, timeout_s: float = 420.0) -> list[str]:
    return outputs_of_success(launch_train(world, list(args), timeout_s=timeout_s))


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_cli_train_on_a_text_file_loss_falls_and_a_resume_continues_it(tmp_path, text_file):
    from runtime.checkpoint.directory import complete_checkpoints, step_dir_name

    common = ["--model", CLI_MODEL, "--global-batch", "8", "--steps", "20", "--fix", "dp=2", "--lr", "1e-2",
              "--data", str(text_file), "--seed", "3"]
    ckpt = tmp_path / "ckpt"
    out = _train(2, *common, "--metrics", str(tmp_path / "a.jsonl"), "--save-dir", str(ckpt), "--save-every", "10",
                 "--keep", "2")[0]
    assert re.search(r"^data: .*corpus.txt, \d+ windows of 17 tokens \(byte-level, vocab 256\)", out, re.M), out
    assert "step  20/20" in out
    a = _jsonl(tmp_path / "a.jsonl")
    losses = [m["loss"] for m in a]
    assert len(losses) == 20 and all(m["tokens"] == 8 * 16 for m in a)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"loss {first:.3f} -> {last:.3f}")
    assert last < 0.75 * first, losses
    assert [p.name for p in complete_checkpoints(ckpt)] == [step_dir_name(10), step_dir_name(20)]

    out = _train(2, *common, "--metrics", str(tmp_path / "b.jsonl"), "--resume", str(ckpt / step_dir_name(10)))[0]
    assert "at step 10" in out and "step  11/20" in out and "step  10/20" not in out
    resumed = [m["loss"] for m in _jsonl(tmp_path / "b.jsonl")]
    assert resumed == pytest.approx(losses[10:], rel=1e-6, abs=0)  # same weights, optimizer state and data order

"""Bad input is refused at the door with an error of our own type that names the cause and the fix.

Two tables: API calls (model specs, --fix knobs, the search's refusals, cluster files, run options)
and command lines run as subprocesses (``python -m partitioner plan|analyze|train|models``), each
with the exception type or exit code expected and a regex the message must contain. Command
lines must print one ``error:`` line and never a traceback; they run concurrently (a handful at a
time) to keep this file to about a minute.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import partitioner
from partitioner import Job, Training
from partitioner.api.auto import auto_parallelize
from partitioner.cost.cluster import PRESET_DIR, Cluster
from partitioner.errors import (
    ClusterSpecError,
    ConfigError,
    ModelSpecError,
    PartitionerError,
)
from partitioner.inputs.knobs import check_fix
from partitioner.inputs.models import build_model
from partitioner.api.planning import parse_fix
from partitioner.search.profile import profile_model
from partitioner.search.search import candidates
from partitioner.search.search import search

GPT = "gpt:layers=2,hidden=32,heads=2,vocab=64,seq=8,dropout=0.0"
"""Two blocks, two heads, 8 positions: small enough to profile in a second."""
DGX = "dgx-a100-80gb"  # one node of 8 devices
HAS_HF = importlib.util.find_spec("transformers") is not None
REPO = Path(__file__).resolve().parents[1]

_PRESET = (PRESET_DIR / "dgx-a100-80gb.yaml").read_text()
CLUSTER_FILES = {
    "binary.yaml": b"\x89PNG\r\n\x1a\n\x00\xff\xfe",
    "latin1.yaml": _PRESET.replace("A100-SXM4-80GB", "A100\xe9").encode("latin-1"),
    "list.yaml": b"- a\n- b\n",
    "empty.yaml": b"",
    "unknown.yaml": (_PRESET + "colour: blue\n").encode(),
    "unknown_device.yaml": _PRESET.replace("  name: A100-SXM4-80GB", "  name: A100-SXM4-80GB\n  cores: 5").encode(),
    "negative.yaml": _PRESET.replace("bandwidth_bytes_per_s: 300GB/s", "bandwidth_bytes_per_s: -3").encode(),
    "negative_unit.yaml": _PRESET.replace("bandwidth_bytes_per_s: 300GB/s", "bandwidth_bytes_per_s: -300GB/s").encode(),
    "nan.yaml": _PRESET.replace("memory_bandwidth_bytes_per_s: 2039GB/s", "memory_bandwidth_bytes_per_s: .nan").encode(),
    "overhead.yaml": _PRESET.replace("  memory_bytes: 80GiB", "  memory_bytes: 80GiB\n  kernel_overhead_s: abc").encode(),
    "bad_yaml.yaml": b"name: [unclosed\n",
    "bad.json": b"{not json",
    "nodes0.yaml": _PRESET.replace("nodes: 1", "nodes: 0").encode(),
    "link_kind.yaml": _PRESET.replace("kind: nvswitch", "kind: carrier-pigeon").encode(),
}


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clusters")
    for name, data in CLUSTER_FILES.items():
        (root / name).write_bytes(data)
    return root


@pytest.fixture(scope="module")
def profile():
    return profile_model(GPT, dtype="fp32")


# ---------------------------------------------------------------------------------------------
# API table: (id, call, exception type, regex naming the cause and the fix)
# A call takes a context with the profile and the cluster directory.
# ---------------------------------------------------------------------------------------------


class Ctx:
    def __init__(self, profile, cluster_dir: Path):
        self.profile, self.dir = profile, cluster_dir

    def search(self, fix, global_batch: int = 8, cluster: str = DGX):
        return search(self.profile, Cluster.load(cluster), global_batch=global_batch, fix=fix)

    def cluster(self, name: str):
        return Cluster.load(self.dir / name)


def _spec(text):
    return lambda ctx: build_model(text, device="meta")


def _fix(text):
    return lambda ctx: parse_fix(text)


def _search(fix, **kw):
    return lambda ctx: ctx.search(fix, **kw)


def _cluster(name):
    return lambda ctx: ctx.cluster(name)


def _auto(training: dict | None = None, **kw):
    """auto_parallelize of GPT with ``Training(global_batch=4, **training)`` and ``kw``."""
    return lambda ctx: auto_parallelize(GPT, training=Training(**{"global_batch": 4, **(training or {})}), **kw)


def _raises(groups):
    raise ValueError("no such optimizer here")


T8 = Training(global_batch=8)
BARE = r"a bare nn\.Module \(Linear\) does not say its inputs or its loss; wrap it in a ModelSpec: ModelSpec\(module=model, "


API = [
    # model specs: type, range, divisibility, unknown and repeated keys
    ("layers-word", _spec("gpt:layers=two"), ModelSpecError, r"gpt: layers must be an integer >= 1, got 'two'; e\.g\. layers=2"),
    ("layers-negative", _spec("gpt:layers=-1"), ModelSpecError, r"layers must be an integer >= 1, got -1; e\.g\. layers="),
    ("layers-float", _spec("gpt:layers=2.5"), ModelSpecError, r"layers must be an integer >= 1, got 2\.5"),
    ("layers-bool", _spec("gpt:layers=true"), ModelSpecError, r"layers must be an integer >= 1, got True"),
    ("vocab-zero", _spec("gpt:vocab=0"), ModelSpecError, r"gpt: vocab must be an integer >= 1, got 0; e\.g\. vocab="),
    ("heads-zero", _spec("gpt:heads=0"), ModelSpecError, r"heads must be an integer >= 1, got 0"),
    ("heads-not-dividing", _spec("gpt:hidden=64,heads=3"), ModelSpecError,
     r"hidden=64 must be divisible by heads=3 .*pick heads among 1, 2, 4, 8"),
    ("heads-default-hidden", _spec("gpt:heads=3"), ModelSpecError, r"hidden=128 must be divisible by heads=3"),
    ("dropout-above", _spec("gpt:dropout=1.5"), ModelSpecError, r"dropout must be a number in \[0, 1\), got 1\.5; e\.g\."),
    ("dropout-one", _spec("gpt:dropout=1"), ModelSpecError, r"dropout must be a number in \[0, 1\), got 1"),
    ("dropout-negative", _spec("gpt:dropout=-0.1"), ModelSpecError, r"dropout must be a number in \[0, 1\)"),
    ("dropout-word", _spec("gpt:dropout=high"), ModelSpecError, r"dropout must be a number in \[0, 1\), got 'high'"),
    ("unknown-key", _spec("gpt:foo=1"), ModelSpecError, r"unknown key 'foo' for model 'gpt'; its keys are: layers, hidden"),
    ("typo-key", _spec("gpt:hiden=64"), ModelSpecError, r"did you mean 'hidden'"),
    ("key-twice", _spec("gpt:layers=2,layers=3"), ModelSpecError, r"key 'layers' is given twice .*keep one"),
    ("malformed-item", _spec("gpt:layers"), ModelSpecError, r"malformed item 'layers'.*key=value"),
    ("unknown-model", _spec("gptx:layers=2"), ModelSpecError, r"unknown model 'gptx'.*did you mean 'gpt'"),
    ("llama-kv-zero", _spec("llama:kv_heads=0"), ModelSpecError, r"llama: kv_heads must be an integer >= 1, got 0"),
    ("llama-odd-head-dim", _spec("llama:hidden=60,heads=4"), ModelSpecError,
     r"head dim hidden/heads = 15 must be even for RoPE.*pick heads among"),
    ("llama-kv-not-dividing", _spec("llama:heads=4,kv_heads=3"), ModelSpecError,
     r"heads=4 must be a multiple of kv_heads=3 .*pick kv_heads among 1, 2, 4"),
    ("llama-theta", _spec("llama:theta=0"), ModelSpecError, r"theta must be a number > 0, got 0"),
    ("bert-seq-zero", _spec("bert:seq=0"), ModelSpecError, r"bert: seq must be an integer >= 1, got 0"),
    ("mlp-hidden-zero", _spec("mlp:hidden=0"), ModelSpecError, r"mlp: hidden must be an integer >= 1"),
    ("mlp-layers-negative", _spec("mlp:layers=-1"), ModelSpecError, r"mlp: layers must be an integer >= 0, got -1"),
    ("mlp-loss", _spec("mlp:loss=l1"), ModelSpecError, r"loss='l1' is not supported; use loss=mse or loss=ce"),
    ("resnet-image", _spec("resnet:image=0"), ModelSpecError, r"resnet: image must be an integer >= 1"),
    ("resnet-blocks", _spec("resnet:blocks=2-x"), ModelSpecError,
     r"blocks must be an integer or dash-separated integers >= 1, got '2-x'; e\.g\. blocks=2-2"),
    ("hf-heads", _spec("hf-gpt2:n_head=3"), ModelSpecError, r"hf-gpt2: n_embd=64 must be divisible by n_head=3.*pick n_head"),
    ("hf-layers-word", _spec("hf-gpt2:n_layer=two"), ModelSpecError, r"hf-gpt2: n_layer must be an integer >= 1, got 'two'"),
    ("hf-llama-kv", _spec("hf-llama:num_key_value_heads=3"), ModelSpecError,
     r"num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
    ("hf-seq-zero", _spec("hf-bert:seq=0"), ModelSpecError, r"hf-bert: seq must be an integer >= 1"),
    pytest.param("hf-config-field", _spec("hf-gpt2:layer_norm_epsilon=abc"), ModelSpecError,
                 r"GPT2Config refuses layer_norm_epsilon='abc'.*expected float.*fix that key",
                 marks=pytest.mark.skipif(not HAS_HF, reason="transformers not installed")),
    ("analyze-spec", lambda ctx: partitioner.analyze("gpt:layers=two"), ModelSpecError, r"layers must be an integer"),
    # --fix knobs: names, values, ranges, duplicates, malformed items
    ("fix-tp-zero", _fix("tp=0"), ConfigError, r"--fix tp=0: tp must be an integer >= 1 .*give a positive count"),
    ("fix-pp-zero", _fix("pp=0"), ConfigError, r"pp must be an integer >= 1 \(pipeline stages\), got 0"),
    ("fix-m-zero", _fix("num_micro_batches=0"), ConfigError, r"num_micro_batches must be an integer >= 1"),
    ("fix-dp-negative", _fix("dp=-1"), ConfigError, r"dp must be an integer >= 1 .*got -1"),
    ("fix-mbs-zero", _fix("micro_batch_size=0"), ConfigError, r"micro_batch_size must be an integer >= 1"),
    ("fix-twice", _fix("tp=2,tp=4"), ConfigError, r"--fix: tp is given twice \(tp=2, tp=4\); keep one"),
    ("fix-checkpointing", _fix("checkpointing=sometimes"), ConfigError,
     r"checkpointing 'sometimes' is not one of none, selective, full"),
    ("fix-schedule", _fix("schedule=foo"), ConfigError, r"schedule 'foo' is not one of gpipe, 1f1b, interleaved"),
    ("fix-offload", _fix("offload=gpu"), ConfigError, r"offload 'gpu' is not one of none, activations, optimizer"),
    ("fix-zero-stage", _fix("zero_stage=5"), ConfigError, r"zero_stage 5 is not one of 0, 1, 2"),
    ("fix-bool", _fix("sequence_parallel=maybe"), ConfigError, r"sequence_parallel=maybe: use true or false"),
    ("fix-word", _fix("tp=eight"), ConfigError, r"tp=eight: tp takes an integer"),
    ("fix-unknown", _fix("tpp=2"), ConfigError, r"unknown knob 'tpp' in --fix; did you mean 'tp'\? knobs: dp, tp, pp"),
    ("fix-dtype", _fix("dtype=bf16"), ConfigError, r"dtype is not a knob; give the training dtype as --dtype"),
    ("fix-malformed", _fix("tp=2,pp"), ConfigError, r"malformed --fix item 'pp'; write knob=value"),
    ("fix-empty-value", _fix("tp="), ConfigError, r"malformed --fix item 'tp='"),
    ("fix-dict-zero", lambda ctx: check_fix({"tp": 0}), ConfigError, r"fix tp=0: tp must be an integer >= 1"),
    ("fix-dict-float", lambda ctx: check_fix({"pp": 2.0}), ConfigError, r"pp must be an integer >= 1 .*got 2\.0"),
    ("fix-dict-bool-stage", lambda ctx: check_fix({"zero_stage": True}), ConfigError, r"zero_stage True is not one of 0, 1, 2"),
    ("fix-not-a-dict", lambda ctx: check_fix(["tp", 2]), ConfigError, r"fix must be a dict of knobs or text"),
    # the search names the rule that removed the last candidates
    ("search-tp-zero-dict", _search({"tp": 0}), ConfigError, r"tp must be an integer >= 1"),
    ("search-product", _search("dp=2,tp=2,pp=1"), ConfigError,
     r"dp\*tp\*pp = 2\*2\*1 = 4 but the cluster has 8 devices; choose knobs whose product is 8"),
    ("search-pp-blocks", _search("pp=8"), ConfigError, r"pp=8 needs at least 8 blocks, the model has 2; use pp <= 2"),
    ("search-too-many", _search("dp=8,tp=2"), ConfigError, r"tp=2 with dp=8 needs 16 devices, the cluster has 8"),
    ("search-gpipe-virtual", _search("schedule=gpipe,virtual_pp=2,pp=2"), ConfigError,
     r"gpipe does not take virtual_pp > 1 .*set schedule=interleaved or virtual_pp=1"),
    ("search-tp-heads", _search("tp=3"), ConfigError, r"tp=3 must divide the model's 2 attention heads; use tp among 1, 2"),
    ("search-dp-batch", _search("dp=2", global_batch=3), ConfigError,
     r"dp=2 does not divide the global batch 3; use a global batch that is a multiple of 2"),
    ("search-m-batch", _search("num_micro_batches=3"), ConfigError,
     r"global batch 8 is not divisible by num_micro_batches = 3; use a multiple of 3"),
    ("search-split-batch", _search("dp=2,num_micro_batches=2,micro_batch_size=4"), ConfigError,
     r"dp\*num_micro_batches\*micro_batch_size = 2\*2\*4 = 16 but the global batch is 8"),
    ("search-interleaved-v1", _search("schedule=interleaved,virtual_pp=1"), ConfigError,
     r"interleaved needs virtual_pp >= 2"),
    ("search-interleaved-blocks", _search("schedule=interleaved"), ConfigError,
     r"interleaved schedule with pp=2, virtual_pp=2 has 4 stages, more than the model's 2 blocks"),
    ("search-gpipe-one-stage", _search("schedule=gpipe,pp=1"), ConfigError, r"schedule gpipe needs pp >= 2"),
    ("search-sp-tp1", _search("sequence_parallel=true,tp=1"), ConfigError, r"sequence_parallel=true needs tp > 1"),
    ("search-offload-zero", _search("tp=2,offload=optimizer,zero_stage=1"), ConfigError,
     r"offload='optimizer' keeps the whole optimizer state on the host, zero_stage=1 .*choose one"),
    ("search-batch-zero", _search(None, global_batch=0), ConfigError, r"global_batch must be an integer >= 1"),
    ("search-batch-float", lambda ctx: candidates(ctx.profile, Cluster.load(DGX), 2.5), ConfigError,
     r"global_batch must be an integer >= 1 \(samples per step\), got 2\.5"),
    ("plan-seq-positions", lambda ctx: partitioner.plan(GPT, DGX, training=T8, seq=100), ModelSpecError,
     r"seq 100 is longer than the 8 positions of .*use seq <= 8 or build the model with seq=100"),
    ("plan-fix-twice", lambda ctx: partitioner.plan(GPT, DGX, training=T8, fix="tp=2,tp=4"), ConfigError,
     r"tp is given twice"),
    ("plan-preset", lambda ctx: partitioner.plan(GPT, "dgx-z900", training=T8), ClusterSpecError,
     r"unknown cluster preset 'dgx-z900'; known presets: .*dgx-a100-80gb"),
    # cluster files: the file and the field
    ("cluster-binary", _cluster("binary.yaml"), ClusterSpecError,
     r"cluster file \S*binary\.yaml is not UTF-8 text \(byte 0x89 at offset 0\); give a YAML or JSON"),
    ("cluster-latin1", _cluster("latin1.yaml"), ClusterSpecError, r"latin1\.yaml is not UTF-8 text"),
    ("cluster-list", _cluster("list.yaml"), ClusterSpecError,
     r"in cluster file \S*list\.yaml: cluster: expected a mapping of Cluster fields, got \['a', 'b'\] \(list\)"),
    ("cluster-empty", _cluster("empty.yaml"), ClusterSpecError, r"empty\.yaml: .*expected a mapping .*got None"),
    ("cluster-unknown", _cluster("unknown.yaml"), ClusterSpecError,
     r"unknown\.yaml: cluster: unknown key\(s\) 'colour'; Cluster takes name, nodes"),
    ("cluster-unknown-device", _cluster("unknown_device.yaml"), ClusterSpecError,
     r"cluster\.device: unknown key\(s\) 'cores'; Device takes"),
    ("cluster-negative", _cluster("negative.yaml"), ClusterSpecError,
     r"negative\.yaml: cluster\.intra_node: Link\.bandwidth_bytes_per_s must be > 0, got -3\.0; give the one-direction"),
    ("cluster-negative-unit", _cluster("negative_unit.yaml"), ClusterSpecError,
     r"Link\.bandwidth_bytes_per_s cannot be negative, got '-300GB/s'"),
    ("cluster-nan", _cluster("nan.yaml"), ClusterSpecError,
     r"nan\.yaml: .*memory_bandwidth_bytes_per_s must be a finite number, got nan"),
    ("cluster-overhead", _cluster("overhead.yaml"), ClusterSpecError,
     r"Device\.kernel_overhead_s must be a plain number, got 'abc'"),
    ("cluster-yaml", _cluster("bad_yaml.yaml"), ClusterSpecError, r"bad_yaml\.yaml is not valid yaml: .* at line 2, column 1$"),
    ("cluster-json", _cluster("bad.json"), ClusterSpecError, r"bad\.json is not valid json: Expecting property name"),
    ("cluster-nodes", _cluster("nodes0.yaml"), ClusterSpecError, r"nodes0\.yaml: Cluster\.nodes must be > 0, got 0"),
    ("cluster-link-kind", _cluster("link_kind.yaml"), ClusterSpecError,
     r"Link\.kind: unknown value 'carrier-pigeon'; choose one of nvlink"),
    ("cluster-missing", lambda ctx: Cluster.load(ctx.dir / "nope.yaml"), ClusterSpecError,
     r"cannot read cluster file \S*nope\.yaml: No such file"),
    ("cluster-with-nodes", lambda ctx: Cluster.load(DGX, nodes=0), ClusterSpecError, r"Cluster\.nodes must be > 0, got 0"),
    ("plan-training", lambda ctx: partitioner.plan(GPT, DGX, training={"global_batch": 8}), ConfigError,
     r"plan: training is dict, not a Training; pass training=Training\(global_batch=8, \.\.\.\)"),
    ("plan-optimizer", lambda ctx: partitioner.plan(GPT, DGX, training=Training(global_batch=8, optimizer="lamb")),
     ConfigError, r"Training\.optimizer: unknown optimizer 'lamb'; choose one of sgd, sgd_momentum, adam, adamw"),
    ("plan-bare-module", lambda ctx: partitioner.plan(torch.nn.Linear(2, 2), DGX, training=T8), ConfigError, BARE),
    ("analyze-bare-module", lambda ctx: partitioner.analyze(torch.nn.Linear(2, 2)), ConfigError, BARE),
    # the groups of auto_parallelize (and plan), refused when made, before any rank joins
    ("training-batch", _auto({"global_batch": 0}), ConfigError,
     r"Training\.global_batch must be >= 1 samples, got 0; give the samples per optimizer step"),
    ("training-batch-float", _auto({"global_batch": 2.5}), ConfigError, r"global_batch must be an integer >= 1"),
    ("training-clip", _auto({"clip_grad_norm": 0}), ConfigError,
     r"Training\.clip_grad_norm must be > 0, got 0; give a global norm"),
    ("training-nonfinite", _auto({"nonfinite": "ignore"}), ConfigError,
     r"Training\.nonfinite='ignore'; choose 'stop' \(a NaN/inf gradient stops the run\) or 'skip'"),
    ("training-dtype", _auto({"dtype": "fp8"}), ConfigError,
     r"Training\.dtype 'fp8' is not a training dtype; choose one of fp32, bf16, fp16"),
    ("training-optimizer-name", _auto({"optimizer": "lamb"}), ConfigError,
     r"Training\.optimizer: unknown optimizer 'lamb'; choose one of sgd, sgd_momentum, adam, adamw"),
    ("training-optimizer-dict", _auto({"optimizer": {"learning_rate": 1e-3}}), ConfigError,
     r"Training\.optimizer: AdamW does not take \{'learning_rate': 0\.001\}"),
    ("training-optimizer-type", _auto({"optimizer": 3}), ConfigError,
     r"Training\.optimizer: got int; pass None \(AdamW\), a name"),
    ("training-optimizer-raises", _auto({"optimizer": _raises}), ConfigError,
     r"Training\.optimizer: the factory raised ValueError: no such optimizer here; pass f\(param_groups\)"),
    ("training-scheduler", _auto({"lr_scheduler": 0.1}), ConfigError,
     r"Training\.lr_scheduler is float, not a factory; pass f\(optimizer\) -> LRScheduler"),
    ("job-timeout", lambda ctx: Job(timeout_s=-1), ConfigError, r"Job\.timeout_s must be > 0 seconds, got -1"),
    ("job-timeout-zero", lambda ctx: Job(timeout_s=0), ConfigError, r"Job\.timeout_s must be > 0 seconds, got 0"),
    ("job-dump-dir", lambda ctx: Job(dump_dir=3), ConfigError, r"Job\.dump_dir is int; give a directory path"),
    ("job-onnx", lambda ctx: Job(onnx="yes"), ConfigError, r"Job\.onnx is str; give True"),
    ("job-track-memory", lambda ctx: Job(track_memory=-1), ConfigError,
     r"Job\.track_memory must be True, False or a number of steps >= 0, got -1"),
    ("auto-training", lambda ctx: auto_parallelize(GPT, training={"global_batch": 4}), ConfigError,
     r"auto_parallelize: training is dict, not a Training; pass training=Training\(global_batch=8"),
    ("auto-job", _auto(job={"timeout_s": 5}), ConfigError, r"auto_parallelize: job is dict, not a Job; pass job=Job\("),
    ("auto-fix", _auto(fix="tp=0"), ConfigError, r"auto_parallelize: fix tp=0: tp must be an integer >= 1"),
    ("auto-fix-dict", _auto(fix={"schedule": "zigzag"}), ConfigError, r"schedule 'zigzag' is not one of gpipe"),
    ("auto-fix-and-plan", lambda ctx: auto_parallelize(GPT, training=Training(global_batch=8), fix="dp=2",
                                                       plan=ctx.search(None)), ConfigError,
     r"auto_parallelize: fix and plan both given; a plan fixes every knob already"),
    ("auto-plan-batch", lambda ctx: auto_parallelize(GPT, training=Training(global_batch=4), plan=ctx.search(None)),
     ConfigError, r"auto_parallelize: the plan is for global batch 8, not 4; pass Training\(global_batch=8\)"),
    ("auto-plan-type", _auto(plan="plan.json"), ConfigError,
     r"auto_parallelize: plan is str, not a Plan; pass Plan\.from_json\(open\('plan\.json'\)\.read\(\)\)"),
    ("auto-bare-module", lambda ctx: auto_parallelize(torch.nn.Linear(2, 2), training=T8), ConfigError, BARE),
]


@pytest.mark.parametrize("case, call, error, message", API, ids=[
    (row.values[0] if hasattr(row, "values") else row[0]) for row in API])
def test_api_refuses_bad_input(case, call, error, message, profile, cluster_dir):
    with pytest.raises(error) as info:
        call(Ctx(profile, cluster_dir))
    assert isinstance(info.value, PartitionerError)
    assert re.search(message, str(info.value)), f"{case}: {info.value}"
    assert "\n" not in str(info.value), "one line, for the command line's error: prefix"


def test_good_input_still_passes(profile):
    # The rules refuse only what is wrong: the defaults and edge values still build and plan.
    for text in ("gpt", "llama", "bert", "mlp:layers=0", "resnet:blocks=1,widths=8", "gpt:dropout=0", GPT):
        build_model(text, device="meta")
    assert parse_fix("tp=2,pp=1,schedule=1f1b,zero_stage=0,sequence_parallel=false") == {
        "tp": 2, "pp": 1, "schedule": "1f1b", "zero_stage": 0, "sequence_parallel": False}
    assert check_fix({"tp": "2", "checkpointing": "full"}) == {"tp": 2, "checkpointing": "full"}
    chosen = search(profile, Cluster.load(DGX), global_batch=8, fix={"dp": 2, "tp": 2, "pp": 2})
    assert (chosen.dp, chosen.tp, chosen.pp) == (2, 2, 2)


# ---------------------------------------------------------------------------------------------
# CLI table: (id, argv after `python -m partitioner`, exit code, regex of the error line)
# ``{dir}`` is the cluster-file directory; train rows run as a one-rank torchrun job would.
# ---------------------------------------------------------------------------------------------

PLAN = ["plan", "--model", GPT, "--cluster", DGX, "--global-batch", "8"]
TRAIN = ["train", "--model", GPT, "--global-batch", "8", "--steps", "1"]

CLI = [
    ("plan-fix-tp-zero", PLAN + ["--fix", "tp=0"], 2, r"--fix tp=0: tp must be an integer >= 1"),
    ("plan-fix-pp-blocks", PLAN + ["--fix", "pp=8"], 2, r"pp=8 needs at least 8 blocks, the model has 2"),
    ("plan-fix-choice", PLAN + ["--fix", "checkpointing=sometimes"], 2,
     r"checkpointing 'sometimes' is not one of none, selective, full"),
    ("plan-fix-twice", PLAN + ["--fix", "tp=2,tp=4"], 2, r"tp is given twice"),
    ("plan-fix-product", PLAN + ["--fix", "dp=2,tp=2,pp=1"], 2, r"dp\*tp\*pp = 2\*2\*1 = 4 but the cluster has 8 devices"),
    ("plan-fix-gpipe", PLAN + ["--fix", "schedule=gpipe,virtual_pp=2"], 2, r"gpipe does not take virtual_pp > 1"),
    ("plan-spec-word", ["plan", "--model", "gpt:layers=two", "--cluster", DGX, "--global-batch", "8"], 2,
     r"gpt: layers must be an integer >= 1, got 'two'"),
    ("plan-spec-heads", ["plan", "--model", "gpt:heads=0", "--cluster", DGX, "--global-batch", "8"], 2,
     r"heads must be an integer >= 1, got 0"),
    ("plan-cluster-binary", ["plan", "--model", GPT, "--cluster", "{dir}/binary.yaml", "--global-batch", "8"], 2,
     r"binary\.yaml is not UTF-8 text"),
    ("plan-cluster-list", ["plan", "--model", GPT, "--cluster", "{dir}/list.yaml", "--global-batch", "8"], 2,
     r"list\.yaml: cluster: expected a mapping of Cluster fields"),
    ("plan-global-batch", ["plan", "--model", GPT, "--cluster", DGX, "--global-batch", "0"], 2,
     r"--global-batch must be >= 1 samples, got 0"),
    ("plan-seq", PLAN + ["--seq", "100"], 2, r"--seq 100 is longer than the 8 positions .*use --seq <= 8"),
    ("plan-nodes", PLAN + ["--nodes", "0"], 2, r"--nodes must be >= 1 nodes, got 0"),
    ("plan-optimizer", PLAN + ["--optimizer", "lamb"], 2, r"--optimizer: unknown optimizer 'lamb'; choose one of sgd"),
    ("analyze-heads", ["analyze", "--model", "gpt:hidden=64,heads=3"], 2,
     r"hidden=64 must be divisible by heads=3 .*pick heads among 1, 2, 4, 8"),
    ("analyze-dropout", ["analyze", "--model", "gpt:dropout=1.5"], 2, r"dropout must be a number in \[0, 1\)"),
    ("analyze-batch", ["analyze", "--model", GPT, "--batch", "0"], 2, r"--batch must be >= 1 samples, got 0"),
    ("models-extra", ["models", "--zoo"], 2, r"unrecognized arguments: --zoo"),
    ("train-timeout", TRAIN + ["--timeout", "-1"], 2, r"--timeout must be > 0 seconds, got -1\.0"),
    ("train-steps", TRAIN + ["--steps", "0"], 2, r"--steps must be >= 1 steps, got 0"),
    ("train-lr", TRAIN + ["--lr", "0"], 2, r"--lr must be > 0, got 0\.0; give a learning rate"),
    ("train-optimizer", TRAIN + ["--optimizer", "lamb"], 2,
     r"--optimizer: unknown optimizer 'lamb'; choose one of sgd, sgd_momentum, adam, adamw"),
    ("train-fix-and-plan", TRAIN + ["--fix", "dp=1", "--plan", "{dir}/plan.json"], 2,
     r"train: --fix and --plan both given; a plan fixes every knob already"),
    ("train-plan-missing", TRAIN + ["--plan", "{dir}/nope.json"], 2,
     r"cannot read plan \S*nope\.json: No such file or directory; give the plan\.json a plan wrote"),
    ("train-keep", TRAIN + ["--keep", "0"], 2, r"--keep must be >= 1 checkpoints, got 0"),
    ("train-save-every", TRAIN + ["--save-every", "0", "--save-dir", "{dir}/ckpt"], 2,
     r"--save-every must be >= 1 steps, got 0"),
    ("train-clip", TRAIN + ["--clip-grad-norm", "-1"], 2, r"--clip-grad-norm must be > 0"),
    ("train-batch-split", ["train", "--model", GPT, "--global-batch", "7", "--fix", "dp=2"], 2,
     r"--global-batch 7 is not divisible by dp=2 = 2 \(pinned by --fix\); use a multiple of 2"),
    ("train-fix-schedule", TRAIN + ["--fix", "schedule=foo"], 2, r"schedule 'foo' is not one of gpipe, 1f1b, interleaved"),
    ("train-spec", ["train", "--model", "gpt:vocab=0", "--global-batch", "8", "--steps", "1"], 2,
     r"gpt: vocab must be an integer >= 1, got 0"),
]


SOLO = {"plan-cluster-binary", "models-extra", "train-spec"}
"""Rows run alone as ``python -m partitioner ...`` (the exit path of the real entry point, and
train's one-rank job); the others run in batches, each batch one interpreter calling
``partitioner.cli.main.main`` per row with its own stdout/stderr, to spare a torch import per row."""
BATCH = 12

_DRIVER = """
import contextlib, io, json, sys, traceback
from partitioner.cli.main import main
results = []
for argv in json.loads(sys.argv[1]):
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's refusals
            code = exc.code
        except BaseException:  # what the entry point would print: the test then sees the traceback
            traceback.print_exc()
            code = 1
    results.append({"code": code, "stderr": err.getvalue(), "stdout": out.getvalue()})
print(json.dumps(results))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # As torchrun starts a one-rank job; plan/analyze/models ignore it.
    return {**os.environ, "PYTHONWARNINGS": "ignore", "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}


def _argv(argv: list[str], cluster_dir: Path) -> list[str]:
    return [a.replace("{dir}", str(cluster_dir)) for a in argv]


def _run_solo(argv: list[str]) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "partitioner", *argv], cwd=REPO, env=_env(), capture_output=True,
                          check=False, text=True, timeout=300)
    return [{"code": done.returncode, "stderr": done.stderr, "stdout": done.stdout}]


def _run_batch(argvs: list[list[str]]) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps(argvs)], cwd=REPO, env=_env(),
                          capture_output=True, check=False, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def cli_results(cluster_dir) -> dict[str, dict]:
    solo = [(case, _argv(argv, cluster_dir)) for case, argv, _, _ in CLI if case in SOLO]
    rest = [(case, _argv(argv, cluster_dir)) for case, argv, _, _ in CLI if case not in SOLO]
    batches = [rest[i:i + BATCH] for i in range(0, len(rest), BATCH)]
    with ThreadPoolExecutor(max_workers=4) as pool:  # interpreter start-up dominates: several at once
        jobs = [([case], pool.submit(_run_solo, argv)) for case, argv in solo]
        jobs += [([case for case, _ in b], pool.submit(_run_batch, [argv for _, argv in b])) for b in batches]
        results = {}
        for cases, job in jobs:
            results.update(zip(cases, job.result()))
    return results


@pytest.mark.parametrize("case, argv, code, message", CLI, ids=[row[0] for row in CLI])
def test_cli_refuses_bad_input(case, argv, code, message, cli_results):
    done = cli_results[case]
    stderr = done["stderr"]
    assert done["code"] == code, f"{case}: exit {done['code']}\n{stderr[-2000:]}"
    assert "Traceback" not in stderr and "Traceback" not in done["stdout"]
    assert re.search(message, stderr), f"{case}: {stderr[-2000:]}"
    if case != "models-extra":  # argparse's own refusals print its usage first
        errors = [line for line in stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("error: "), stderr


def test_table_size():
    # The issue asks for at least 60 bad inputs across the CLI and the API.
    assert len(API) + len(CLI) >= 60 and len(CLI) >= 20


def test_a_batch_whose_cp_shard_sequence_parallelism_cannot_cut_is_refused_before_any_collective():
    """cp=2 with tp=4 and sequence parallelism: a sequence of 12 tokens is a multiple of 2 * cp
    (the load-balanced layout) but gives each cp rank 6, which sp cannot cut over 4 tp ranks. The
    runtime refuses it while it shards the batch (no collective has run), naming the lengths that
    work; 16 tokens pass and are cut to each rank's 8."""
    import types

    import torch

    from passes.ir.config import ParallelConfig
    from passes.ir.cp_ops import ContextParallelPlan
    from runtime.exec.parallel_model import ParallelModel

    plan = ContextParallelPlan(mode="ring", degree=2, group="tp.cp", seq_dim="seq", seq_len=16,
                               sharded_inputs=(("tokens", 1),), attention=1, positions=1, losses=1)
    config = ParallelConfig(tp=4, cp=2, sequence_parallel=True, micro_batch_size=1, num_micro_batches=1)
    rank = types.SimpleNamespace(cp_plan=plan, config=config, tp=4, mesh=types.SimpleNamespace(cp_index=1))
    with pytest.raises(ConfigError, match=r"'seq' length 12 gives each of cp=2 ranks 6 tokens.*multiple of 8"):
        ParallelModel._cp_shard(rank, {"tokens": torch.arange(12)[None]}, {"seq": 12, "batch": 1})
    rows = {"tokens": torch.arange(16)[None]}
    assert ParallelModel._cp_shard(rank, rows, {"seq": 16, "batch": 1}) == {"seq": 8, "batch": 1}
    assert rows["tokens"].shape == (1, 8)


def test_a_mesh_that_cannot_run_the_plan_is_refused_before_any_lowering(monkeypatch):
    """A cp=2 plan on a mesh built from dp, pp and tp alone (its data axis 2 ranks short of
    dp * cp), or on a rank outside the mesh: refused by the build, naming Mesh.for_config,
    before any lowering starts (nothing lowered, no collective issued)."""
    import types

    import partitioner.compile.build as build
    from passes.ir.config import ParallelConfig

    lowered = []
    monkeypatch.setattr(build, "lower", lambda *a, **k: lowered.append(a))
    config = ParallelConfig(dp=2, cp=2, micro_batch_size=1, num_micro_batches=1)
    short = types.SimpleNamespace(dp=2, pp=1, tp=1, cp=1, active=True, rank=0, first=0)
    with pytest.raises(ConfigError, match=r"data axis of 2.*dp\*cp=4 \(cp=2\).*Mesh.for_config"):
        build.lower_plan(None, config, cluster=None, mesh=short)
    outside = types.SimpleNamespace(dp=4, pp=1, tp=1, cp=2, active=False, rank=5, first=0, dp_shard=4)
    with pytest.raises(ConfigError, match="rank 5 is outside"):
        build.lower_plan(None, config, cluster=None, mesh=outside)
    assert lowered == []

#!/usr/bin/env bash
# GPU/NCCL checks for one CUDA GPU with NCCL. Run from the repository root:
#   PYTHONPATH=. bash scripts/device_check.sh
# It uses the python3 found on PATH (override with PYTHON=...), so the CUDA build of torch
# installed there rather than the pinned CPU build, with this repository on PYTHONPATH. Results
# go to $OUT (default /tmp/device_out), six files:
#   env.txt       the GPU (nvidia-smi -L), the torch version and whether CUDA is available
#   calibrate.txt the in-job microbenchmarks on the GPU (scripts/gpu_calibrate.py): matmul efficiency
#                 against the datasheet peak, the device-memory copy, the NCCL collectives' calls
#   detect.txt    detect_cluster() on this machine (the GPU table's match, the links), then a
#                 first run as a user makes it: torchrun, one NCCL rank, no --cluster, an empty
#                 calibration cache; the plan (predicted) and the measured steps
#   parity.txt    NCCL/CUDA: one-rank ParallelModel trains like plain AdamW on the GPU, with and
#                 without checkpointing / activation offload (pinned host memory, side stream)
#   compile.txt   the same first run with its stage programs compiled (--fix compile=true): its
#                 measured steps beside the uncompiled run's in detect.txt
#   fidelity.txt  the one-GPU fidelity table: predicted vs measured peak memory and step time,
#                 4 plans, on the dgx-h200 preset, refit on 3 with the plain one held out
set -uo pipefail
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{ nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; } \
    > "$OUT/env.txt" 2>&1
timeout 120 $PY scripts/gpu_calibrate.py > "$OUT/calibrate.txt" 2>&1
echo "calibrate exit $?" >> "$OUT/calibrate.txt"
{ $PY -c "from partitioner.calibration.job_cluster import detect_cluster; from partitioner.calibration.detect import describe; print(describe(detect_cluster()))"
  PARTITIONER_CACHE_DIR=$(mktemp -d) timeout 240 $PY -m torch.distributed.run --nproc-per-node 1 -m partitioner train \
      --model gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=128 --global-batch 8 --steps 12 --dump-dir /tmp/device_train
  echo "train exit $?"
  $PY -c "import json; m = json.load(open('/tmp/device_train/measurements.json')); print('predicted step', m['predicted_step_time_s'], 's; measured', [s['step_time_s'] for s in m['steps'][0]][2:])"
} > "$OUT/detect.txt" 2>&1
{ PARTITIONER_CACHE_DIR=$(mktemp -d) timeout 240 $PY -m torch.distributed.run --nproc-per-node 1 -m partitioner train \
      --model gpt:layers=4,hidden=256,heads=8,vocab=1024,seq=128 --global-batch 8 --steps 12 --fix compile=true \
      --dump-dir /tmp/device_train_compiled
  echo "compiled train exit $?"
  $PY -c "import json; m = json.load(open('/tmp/device_train_compiled/measurements.json')); print('compiled: predicted step', m['predicted_step_time_s'], 's; measured', [s['step_time_s'] for s in m['steps'][0]][2:])"
} > "$OUT/compile.txt" 2>&1
timeout 240 $PY scripts/device_parity.py --steps 3 > "$OUT/parity.txt" 2>&1
echo "parity exit $?" >> "$OUT/parity.txt"
timeout 270 $PY bench/fidelity.py --world 1 --cluster dgx-h200 --models gpt-gpu --steps 10 \
    --out /tmp/device_fidelity > "$OUT/fidelity.txt" 2>&1
echo "fidelity exit $?" >> "$OUT/fidelity.txt"
cat "$OUT/env.txt" "$OUT/calibrate.txt" "$OUT/detect.txt" "$OUT/compile.txt" "$OUT/parity.txt"; grep -v Warning "$OUT/fidelity.txt" | tail -30

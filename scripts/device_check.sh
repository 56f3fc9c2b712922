#!/usr/bin/env bash
# The device checks, as ONE prepared run on a lent GPU machine (see the developers' guide):
#   run(command="bash scripts/device_check.sh", timeout_s=540)
# It uses the torch installed there (python3; not our pinned CPU build) with this repo on
# PYTHONPATH, and leaves at most 4 files under $OUT (the device tool brings back 8, 2 folders deep).
#   1. NCCL/CUDA: one-rank ParallelModel trains like plain AdamW on the GPU, with and without
#      checkpointing / activation offload (pinned host memory, side stream)  -> $OUT/parity.txt
#   2. issue 7's one-GPU table: predicted vs measured peak memory and step time, 4 plans, on the
#      dgx-h200 preset, refit on 3 and the plain one held out               -> $OUT/fidelity.txt
set -uo pipefail
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
{ nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"; } \
    > "$OUT/env.txt" 2>&1
timeout 240 $PY scripts/device_parity.py --steps 3 > "$OUT/parity.txt" 2>&1
echo "parity exit $?" >> "$OUT/parity.txt"
timeout 270 $PY bench/fidelity.py --world 1 --cluster dgx-h200 --models gpt-gpu --steps 10 \
    --out /tmp/device_fidelity > "$OUT/fidelity.txt" 2>&1
echo "fidelity exit $?" >> "$OUT/fidelity.txt"
cat "$OUT/env.txt" "$OUT/parity.txt"; grep -v Warning "$OUT/fidelity.txt" | tail -30

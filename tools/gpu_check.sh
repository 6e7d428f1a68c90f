#!/bin/bash
# The accelerator checks of #16 and #17 in one unattended call (~4.5 min on an H200): a
# GLM-4.7-Flash-shaped synthetic model (4 trunk layers, Q4_K), where a step's device time goes
# (tools/trace_decode.py), decode tok/s with the HBM roofline fraction, quantized vs dense,
# over 1 and 8 slots (tools/bench_gpu_roofline.py), and the step time against tokens held at a
# 32K context (tools/bench_context.py). JSON lines go to ${OUT:-/tmp/gpu_check}.
#   bash tools/gpu_check.sh          # PYTHON=python3.12 bash tools/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
MODEL=$OUT/flash4-q4k.gguf
$PY -m tools.make_synthetic --variant=glm-4.7-flash --layers=4 --type=Q4_K --out="$MODEL" \
  > "$OUT/make.json" || exit 1
$PY -m tools.trace_decode --source="$MODEL" --dtype=bfloat16 --top=8 > "$OUT/trace.json"
$PY -m tools.bench_gpu_roofline --source="$MODEL" --dtype=bfloat16 --slot_counts=1,8 \
  --decode_tokens=64 --rounds=2 > "$OUT/roofline.json"
$PY -m tools.bench_context --modes=steps --source="$MODEL" --dtype=bfloat16 --context=32768 \
  --held=128,1024,4096,16384,32000 --steps=10 --step_rounds=2 > "$OUT/context.json"
rm -f "$MODEL"
cat "$OUT/trace.json" "$OUT/roofline.json" "$OUT/context.json"

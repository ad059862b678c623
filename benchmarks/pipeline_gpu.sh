#!/usr/bin/env bash
# Pipeline parallelism on the GPUs in one device call: the NCCL tests (pipeline, ZeRO inside stages,
# step timing), then the suite's pipeline phases; every results file is copied under $OUT.
#   WORLDS=2        world sizes for the suite (default 2; 4 where 4 GPUs are lent)
#   ROUNDS=2        rounds of the ours-vs-torch pipeline phase
#   BIG=1           also the pipeline_trainer phase's big model (a GPT too large for one GPU under DDP)
#   PHASES=pipeline,pipeline_trainer   the suite's phases (default both)
#   VARIANTS=       the pipeline phase's --variants (default: P = world and P = world/2 x DP = 2, balanced
#                   by compute; "compute,time" runs both balances, about twice as long)
set -o pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd "$(dirname "$0")/.."
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
{ timeout 240 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py tests/test_gpu_pipeline_timing.py 2>&1 \
    | grep -v -i "warn" | tail -25; echo "tests: $(( $(date +%s) - start )) s"; } > "$OUT/gpu_tests.log"
cd benchmarks
timeout 300 python suite.py --phases "${PHASES:-pipeline,pipeline_trainer}" --worlds "${WORLDS:-2}" \
  --rounds "${ROUNDS:-2}" ${VARIANTS:+--variants "$VARIANTS"} --timeout 290 --out /tmp/s_pipe 2>&1 | grep -v -i "warn" > "$OUT/pipeline.log"
cp /tmp/s_pipe/results.json "$OUT/pipeline.json"; cp /tmp/s_pipe/results.md "$OUT/pipeline.md"
echo "pipeline phases done at $(( $(date +%s) - start )) s" >> "$OUT/pipeline.log"
if [ "${BIG:-1}" = 1 ]; then
  timeout 200 python suite.py --phases pipeline_trainer --variants big --worlds "${WORLDS:-2}" --timeout 190 \
    --out /tmp/s_big 2>&1 | grep -v -i "warn" > "$OUT/big.log"
  cp /tmp/s_big/results.json "$OUT/big.json"; cp /tmp/s_big/results.md "$OUT/big.md"
  echo "big done at $(( $(date +%s) - start )) s" >> "$OUT/big.log"
fi

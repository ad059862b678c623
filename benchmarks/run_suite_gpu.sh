#!/usr/bin/env bash
# The benchmark suite in one device call: NCCL correctness tests, then benchmarks/suite.py on the GPUs
# present (torchrun per world size), results under ${OUT:-benchmarks/out}/suite: results.json (card,
# torch, CUDA, NCCL, driver, world sizes, every phase's raw figures), results.md, PNG plots, suite.log.
#   PHASES=training,models        a subset (default: every phase; see `python benchmarks/suite.py --help`)
#   MAX_GPUS=2                    the largest world (default: every GPU)
#   SUITE_ARGS="--models gpt2-124m:16:1024 --rounds 2"   anything else suite.py takes
set -o pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT/suite"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/suite/gpus.txt"
python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py 2>&1 | tail -3 | tee "$OUT/suite/gpu_tests.log"
args=(--out "$OUT/suite")
[ -n "${PHASES:-}" ] && args+=(--phases "$PHASES")
[ -n "${MAX_GPUS:-}" ] && args+=(--max-gpus "$MAX_GPUS")
# shellcheck disable=SC2086
python benchmarks/suite.py "${args[@]}" ${SUITE_ARGS:-} 2>&1 | grep -v -i "warn\|\*\*\*\*\*" | tee "$OUT/suite/suite.log" | tail -80

#!/usr/bin/env bash
# The benchmark suite in one device call: GPU tests, then benchmarks/suite.py on every GPU present.
# Results go to ${OUT:-benchmarks/out}/suite (results.json, results.md; plots need matplotlib, which the
# GPU image lacks: copy results.json back and run `python benchmarks/suite.py --report DIR` there).
#   SUITE_ARGS="--models gpt2-124m:16:1024"   to shorten it
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT/suite"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
# shellcheck disable=SC2086
python benchmarks/suite.py --out "$OUT/suite" ${SUITE_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/suite.log" | tail -60

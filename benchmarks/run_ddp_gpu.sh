#!/usr/bin/env bash
# The whole DDP GPU benchmark in one call: NCCL parity test, then 1- and 2-GPU runs at both sizes.
# Results (JSON per run, merged results, table, logs) go to ${OUT:-benchmarks/out}.
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py 2>&1 | tail -5 | tee "$OUT/gpu_tests.log"
for model in ${MODELS:-gpt2-124m gpt-1.3b}; do
  torchrun --standalone --nproc_per_node=1 benchmarks/ddp_gpu.py --model "$model" --rounds 1 \
    --out "$OUT/$model-1gpu.json" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tail -20
  torchrun --standalone --nproc_per_node=2 benchmarks/ddp_gpu.py --model "$model" --nosync \
    --out "$OUT/$model-2gpu.json" ${BENCH_ARGS:-} 2>&1 | grep -v Warning | tail -20
done
python benchmarks/ddp_gpu.py --summarize "$OUT"/*gpu.json --results "$OUT/ddp_results.json" | tee "$OUT/ddp_table.md"

#!/usr/bin/env bash
# The whole DDP GPU benchmark in one call: NCCL parity test, then 1- and 2-GPU runs per configuration.
# Results (JSON per run, merged results, table, logs) go to ${OUT:-benchmarks/out}.
#   CONFIGS="model:micro_batch ..."   (default: gpt2-124m:16 gpt-1.3b:8 gpt-1.3b:16)
#   IMPLS=torch,torch_gav,ours,...    (see ddp_gpu.py --help)
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
for config in ${CONFIGS:-gpt2-124m:16 gpt-1.3b:8 gpt-1.3b:16}; do
  model=${config%%:*}; micro=${config##*:}
  torchrun --standalone --nproc_per_node=1 benchmarks/ddp_gpu.py --model "$model" --micro-batch "$micro" \
    --rounds 2 --out "$OUT/$model-b$micro-1gpu.json" 2>&1 | grep -v Warning | tail -5
  torchrun --standalone --nproc_per_node=2 benchmarks/ddp_gpu.py --model "$model" --micro-batch "$micro" --nosync \
    --impls "${IMPLS:-torch,torch_gav,ours,torch_hp,ours_hp}" --out "$OUT/$model-b$micro-2gpu.json" 2>&1 \
    | grep -v Warning | tail -12
done
python benchmarks/ddp_gpu.py --summarize "$OUT"/*gpu.json --results "$OUT/ddp_results.json" | tee "$OUT/ddp_table.md"

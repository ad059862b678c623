#!/usr/bin/env bash
# Third-party models on every GPU count present, in one device call: the NCCL tests, Top-K selection
# time on one GPU, then benchmarks/profile_models.py (ours vs torch DDP, trainer, monitor) at 2 and 4
# GPUs (as many as there are). Results under ${OUT:-benchmarks/out}.
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
n=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.log"
python benchmarks/topk_select.py --out "$OUT/topk_select.json" 2>&1 | tee "$OUT/topk_select.log"
for world in 2 4; do
  [ "$world" -le "$n" ] || continue
  torchrun --nproc_per_node="$world" benchmarks/profile_models.py ${MODELS_ARGS:-} --out "$OUT/models_w$world.json" 2>&1 \
    | grep -v -i "warn\|\*\*\*\*\|OMP_NUM_THREADS\|loss_type" | tee "$OUT/models_w$world.log"
done

#!/usr/bin/env bash
# Session 25 (2 GPUs lent, no 4-GPU kind): issue 14's "the trainer adds no measurable overhead" on the
# third-party models. Usage: benchmarks/device_s25.sh E|F; everything comes back as $OUT/s25_<mode>.tar.gz.
#   E: the NCCL tests; then the models phase at world 2 on BERT and ViT, 5 rounds of 30 steps, variants
#      trainer, ours, torch, trainer_monitor, trainer_read (the loss read every 10th step), with the first
#      two profiled (host time per op).
#   F: the models phase at world 2 on all four models, 5 rounds of 30 steps (after a fix).
#   G: BERT at world 2 only, 8 rounds of 20 steps: torch, ours (both profiled), ours_nobcast, ours_timed,
#      plain: where our DDP's time goes against torch's on the model where it is not settled.
#   H: the pipeline phase at P = 2 (GPT-1.3B, half blocks, eager and graphed, 2 rounds): the head costing
#      its loss (halves) against matmul FLOPs alone (halves_matmuls), the cut of sessions 21-24.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
R=/tmp/s25
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$R/gpus.txt"
suite() {  # name, seconds in all, seconds per world size, suite.py arguments
  local name=$1 limit=$2 per_world=$3; shift 3
  (cd benchmarks && timeout "$limit" python suite.py --out "$R/$name" --timeout "$per_world" "$@") \
    2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$R/$name.log"
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
}
case "$1" in
  E) timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log"
     suite M2 300 285 --worlds 2 --phases models --third-party bert,vit --rounds 5 --steps 30 \
       --variants trainer,ours,torch,trainer_monitor,trainer_read --models-profile 2 ;;
  F) suite M2 420 400 --worlds 2 --phases models --rounds 5 --steps 30 \
       --variants plain,torch,ours,trainer,trainer_monitor,trainer_read ;;
  G) suite M2 300 285 --worlds 2 --phases models --third-party bert --rounds 8 --steps 20 \
       --variants torch,ours,ours_nobcast,ours_timed,plain --models-profile 2 ;;
  H) suite P2 300 285 --worlds 2 --phases pipeline --variants pp,halves,halves_matmuls,graphs --rounds 2 ;;
esac
tar -czf "$OUT/s25_$1.tar.gz" -C $R .

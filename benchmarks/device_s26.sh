#!/usr/bin/env bash
# Session 26: issue 14's suite in one session on one 4-GPU machine (4x H200), four calls in a row, merged with
#   python benchmarks/suite.py --merge A/A B/B M/M C/P --out DIR   (later parts replace earlier ones' worlds)
# into benchmarks/results/suite_2026-11-28_4xh200_s26.md. A and B are session 24's calls as written:
#   benchmarks/device_s24.sh A   (worlds 1, 2; its models phase at 2 ran out of its 330 s: partial)
#   benchmarks/device_s24.sh B   (world 4)
# then, with this script (everything comes back as $OUT/s26_<mode>.tar.gz):
#   C: the pipeline phase at P = 4 and P = 2 x DP = 2 with the head's loss in the compute balance (eager and
#      CUDA graphs, 2 rounds).
#   M: the models phase again at 2 and 4 GPUs, 5 rounds of 30 steps (the trainer's monitor left to the
#      monitor phase, which measures it paired).
#   N: (written for the next 4-GPU session, not run in session 26) what session 26 left to re-measure:
#      ZeRO-2/3 peak memory at 1.3B after the TrainableSet leak fix (worlds 1 and 4), the profiling phase
#      with the GPU clock sampled, the pipeline at P = 4 cut at half blocks with the loss term (eager and
#      graphed), the models phase at 2 GPUs.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
R=/tmp/s26
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt"
run() {  # name, seconds in all, seconds per world, suite.py arguments
  local name=$1 limit=$2 per_world=$3; shift 3
  (cd benchmarks && timeout "$limit" python suite.py --out "$R/$name" --timeout "$per_world" "$@") 2>&1 \
    | grep -v -i "warn\|\*\*\*\*\*" > "$R/$name.log"
  echo "exit $?" >> "$R/$name.log"
}
case "$1" in
  C) run P 330 320 --worlds 4 --phases pipeline --variants pp,pp_dp,graphs --rounds 2 ;;
  M) run M 500 245 --worlds 2,4 --phases models --variants plain,torch,ours,trainer --rounds 5 --steps 30 ;;
  N) run T 200 95 --worlds 1,4 --phases training,profiling --models gpt-1.3b:8:1024 \
       --impls torch_ddp,ours_ddp,zero2,zero3,torch_fsdp2
     run P 200 190 --worlds 4 --phases pipeline --variants pp,halves,graphs --rounds 2
     run M 180 170 --worlds 2 --phases models --variants plain,torch,ours,trainer --rounds 5 --steps 30 ;;
esac
tar -czf "$OUT/s26_$1.tar.gz" -C $R .

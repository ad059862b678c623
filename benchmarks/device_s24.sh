#!/usr/bin/env bash
# Session 24: issue 14's suite in one session on one 4-GPU machine (two calls, chained while it is warm,
# merged offline with `suite.py --merge`), then issue 15's pipeline phase with the half-block cut balanced by
# measured time. Usage: benchmarks/device_s24.sh A|B|C; everything comes back as $OUT/s24_<mode>.tar.gz.
#   A: the suite at worlds 1 and 2: training, topk, monitor, compile, collectives, models.
#   B: the suite at world 4: collectives, training, monitor, compile, precision, memory, profiling, models.
#   C: the pipeline phase at P = 4 and P = 2 x DP = 2: half blocks by FLOPs and by measured time, ours eager
#      and with CUDA graphs against torch's, 2 rounds; then the NCCL tests (our DDP / trainer / pipeline
#      against torch's).
#   D: (2 GPUs, while no 4-GPU machine is lent) the NCCL tests, the pipeline phase at P = 2 (half blocks by
#      FLOPs and by measured time, eager and graphed, 2 rounds), the models phase at world 2 (the trainer's
#      overhead with the replicas' count all-reduce a step).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
R=/tmp/s24
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$R/gpus.txt"
IMPLS=torch_ddp,torch_ddp_gav,ours_ddp,zero1,zero2,zero3,torch_fsdp2,ddp_bf16,torch_ddp_bf16,ddp_topk,ddp_powersgd
MODELS=plain,torch,ours,trainer,trainer_monitor
suite() {  # name, seconds in all, seconds per world size, suite.py arguments
  local name=$1 limit=$2 per_world=$3; shift 3
  (cd benchmarks && timeout "$limit" python suite.py --out "$R/$name" --timeout "$per_world" "$@") \
    2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$R/$name.log"
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
}
case "$1" in
  A) suite A 570 330 --worlds 1,2 --phases training,topk,monitor,compile,collectives,models --impls $IMPLS \
       --variants $MODELS ;;
  B) suite B 570 550 --worlds 4 --phases collectives,training,monitor,compile,precision,memory,profiling,models \
       --impls $IMPLS --variants $MODELS ;;
  C) suite P 420 400 --worlds 4 --phases pipeline --variants pp,pp_dp,halves,halves_time,graphs --rounds 2
     timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log" ;;
  D) timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log"
     suite P2 220 200 --worlds 2 --phases pipeline --variants pp,halves,halves_time,graphs --rounds 2
     suite M2 200 185 --worlds 2 --phases models --variants $MODELS ;;
esac
tar -czf "$OUT/s24_$1.tar.gz" -C $R .

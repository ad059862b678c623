#!/usr/bin/env bash
# Session 20: issue 14's suite run on one 4-GPU machine, in three chained device calls (a call may run
# 10 minutes), merged afterwards with `suite.py --merge`. Usage: benchmarks/device_s20.sh A|B|C; results
# under $OUT (results.json, results.md, plots, the log).
#   A: worlds 1, 2: training, topk, monitor, compile, collectives
#   B: worlds 2, 4: models (timm / Hugging Face); the NCCL test of the ring over lanes; the pipeline at 4
#   C: world 4: collectives, training, monitor, compile, precision, memory, profiling
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
IMPLS=torch_ddp,torch_ddp_gav,ours_ddp,zero1,zero2,zero3,torch_fsdp2,ddp_bf16,torch_ddp_bf16,ddp_topk,ddp_powersgd
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
suite() {  # name, seconds, suite.py arguments...
  local name=$1 limit=$2; shift 2
  (cd benchmarks && timeout "$limit" python suite.py --out "/tmp/s_$name" --timeout $(( limit - 15 )) "$@") \
    > "$OUT/$name.log" 2>&1
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$OUT/$name.log"
  for f in /tmp/s_$name/results.json /tmp/s_$name/results.md; do
    [ -f "$f" ] && cp "$f" "$OUT/${name}_$(basename "$f")"
  done
}
case "$1" in
  A) suite A1 260 --worlds 1 --phases training,topk,monitor,compile --impls $IMPLS
     suite A2 290 --worlds 2 --phases collectives,training,monitor,compile --impls $IMPLS ;;
  B) timeout 120 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py -k lanes > "$OUT/gpu_tests.log" 2>&1
     echo "tests exit $?" >> "$OUT/gpu_tests.log"
     suite B 330 --worlds 2,4 --phases models
     suite P 140 --worlds 4 --phases pipeline ;;
  C) suite C 560 --worlds 4 --phases collectives,training,monitor,compile,precision,memory,profiling --impls $IMPLS ;;
esac

#!/usr/bin/env bash
# Session 20: issue 14's suite run on one 4-GPU machine, in three chained device calls (a call may run
# 10 minutes), merged afterwards with `suite.py --merge`. Usage: benchmarks/device_s20.sh A|B|C; results
# under $OUT (results.json, results.md, plots, the log).
#   A: worlds 1, 2: training, topk, monitor, compile, collectives
#   B: worlds 2, 4: models (timm / Hugging Face); the NCCL test of the ring over lanes; the pipeline at 4
#   C: world 4: collectives, training, monitor, compile, precision, memory, profiling
# Lessons kept for the next run: the models phase's 6 variants x 4 models x 3 rounds took > 165 s a world
# (B lost world 4; it was rerun with 5 variants in 294 s for worlds 2 and 4: mode M); `--impls` no longer
# replaces the compile phase's variants (it did in A and C). Modes for what is still open:
#   M: worlds 2, 4: models with 5 variants, 4 rounds (BERT / ViT at 2 GPUs were noisy at 3)
#   P: world 4: the pipeline with whole-block and half-block cuts (issue 15's bubble)
#   T: world 4: training with NCCL's CTA policy set for the whole job (EFFICIENCY), against a run without
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
  M) suite M 540 --worlds 2,4 --phases models --variants plain,torch,ours,trainer,trainer_monitor --rounds 4 ;;
  P) suite P 300 --worlds 4 --phases pipeline --variants compute,halves ;;
  T) suite T0 200 --worlds 4 --phases training --models gpt-1.3b:8:1024 --impls torch_ddp,ours_ddp,zero2
     # NCCL_CTA_POLICY: 1 = NCCL_CTA_POLICY_EFFICIENCY (NCCL >= 2.27); NCCL reads it once per process
     (export NCCL_CTA_POLICY=1; suite T1 200 --worlds 4 --phases training --models gpt-1.3b:8:1024 \
        --impls torch_ddp,ours_ddp,zero2) ;;
esac

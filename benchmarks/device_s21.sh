#!/usr/bin/env bash
# Session 21: what issues 14 and 15 still owe, on one 4-GPU machine in two device calls. Usage:
# benchmarks/device_s21.sh X|Y; everything comes back as one archive, $OUT/s21_<mode>.tar.gz.
#   X: the pipeline's ZB-H1 against 1F1B at P = 4 under the profiler (per rank: compute beside NCCL
#      kernels and what it cost, `pipeline_profile.py`), with NCCL's default p2p channels and with at
#      most 4; the suite's pipeline phase with whole- and half-block cuts; the training phase at 1.3B
#      with and without NCCL's CTA policy (EFFICIENCY) for the 1 -> 4 scaling.
#   Y: the host's time by op per rank for our 1F1B, torch's and our ZB-H1 (rank 2's traces come back);
#      the models phase at 2 GPUs with 4 rounds (BERT / ViT), the compile phase at 4, the collectives at
#      2 and 4 with the ring's final lane rule.
#   Z: after W's batched matmul (ZB-H1's host time): the profile again, and the pipeline phase at P = 4
#      and P = 2 x DP = 2 cut at half blocks, 3 rounds.
#   F: after the header reuse: the NCCL pipeline tests, and the pipeline phase as in Z.
#   H: the trainer's pipeline (DDP per stage, bf16) with whole and half blocks, 1F1B and ZB-H1.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
R=/tmp/s21
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt"
suite() {  # name, seconds, suite.py arguments...
  local name=$1 limit=$2; shift 2
  (cd benchmarks && timeout "$limit" python suite.py --out "$R/$name" --timeout $(( limit - 15 )) "$@") \
    > "$R/$name.log" 2>&1
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
}
profile() {  # name, seconds, variants, variants traced, extra environment (VAR=value ...)
  local name=$1 limit=$2 variants=$3 traced=$4; shift 4
  env "$@" timeout "$limit" torchrun --nproc_per_node=4 benchmarks/pipeline_profile.py --out "$R/$name" \
    --variants "$variants" --profile "$traced" --rounds 3 --steps 4 > "$R/$name.log" 2>&1
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
  find "$R/$name" -name 'trace_*.json.gz' ! -name '*_r2.json.gz' -delete  # rank 2's traces come back
}
ZB=ours_1f1b,ours_zbh1,ours-halves_1f1b,ours-halves_zbh1
case "$1" in
  X) profile prof_default 100 $ZB ours_1f1b,ours_zbh1
     profile prof_p2p4 100 $ZB ours_1f1b,ours_zbh1 NCCL_MAX_P2P_NCHANNELS=4
     suite P 200 --worlds 4 --phases pipeline --variants pp,compute,halves
     suite T0 100 --worlds 4 --phases training --models gpt-1.3b:8:1024 --impls torch_ddp,ours_ddp,zero2
     # NCCL_CTA_POLICY: 1 = NCCL_CTA_POLICY_EFFICIENCY (NCCL >= 2.27); NCCL reads it once per process
     (export NCCL_CTA_POLICY=1; suite T1 100 --worlds 4 --phases training --models gpt-1.3b:8:1024 \
        --impls torch_ddp,ours_ddp,zero2) ;;
  Y) profile prof_host 60 ours_1f1b,torch_1f1b,ours_zbh1 ours_1f1b,torch_1f1b,ours_zbh1
     suite M 210 --worlds 2 --phases models --variants plain,torch,ours,trainer,trainer_monitor --rounds 4
     suite C 190 --worlds 4 --phases compile
     suite L 70 --worlds 2,4 --phases collectives ;;
  Z) profile prof_zb 90 $ZB,torch_1f1b ours_1f1b,ours_zbh1
     suite PZ 260 --worlds 4 --phases pipeline --variants pp,pp_dp,halves --rounds 3 ;;
  F) timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py -k pipeline \
       tests/test_gpu_pipeline_timing.py > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log"
     suite PF 230 --worlds 4 --phases pipeline --variants pp,pp_dp,halves --rounds 3 ;;
  H) profile prof_trainer 150 trainer_1f1b,trainer-halves_1f1b,trainer_zbh1,trainer-halves_zbh1,torch_1f1b none ;;
esac
tar -czf "$OUT/s21_$1.tar.gz" -C $R .

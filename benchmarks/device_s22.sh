#!/usr/bin/env bash
# Session 22: the pipeline engine's async_backward (issue 15), on one 4-GPU machine (A ran; the
# option was then removed, 30% slower: docs/pipeline.md; B was not run). Usage:
# benchmarks/device_s22.sh A|B; everything comes back as one archive, $OUT/s22_<mode>.tar.gz.
#   A: the NCCL pipeline tests (async_backward's bit-parity included); the profile script's step and
#      host-issue times for our 1F1B / GPipe with and without async_backward and torch's, half-block
#      cut, P = 4, 3 rounds, rank 1's trace of the async 1F1B.
#   B: the suite's pipeline phase at P = 4 and P = 2 x DP = 2 (half blocks) with the async variant, 3 rounds.
#   C: after the session's hardening (load agreement, trainable check, unused-parameter watch, FSDP units
#      for nn.Sequential blocks): every GPU test, and the models phase at 4 GPUs on timm ResNet-50 / ViT
#      with ZeRO-3 through the trainer (now one unit a block where it was one for the whole model).
#   D: the models phase at 4 GPUs, four models, 5 rounds: DDP against torch's again (C's 3 rounds had
#      ResNet-50 / ViT at 0.95x / 0.97x), and ZeRO-3 with block units against one unit for the model.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
R=/tmp/s22
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$R/gpus.txt"
suite() {  # name, seconds, suite.py arguments...
  local name=$1 limit=$2; shift 2
  (cd benchmarks && timeout "$limit" python suite.py --out "$R/$name" --timeout $(( limit - 15 )) "$@") \
    > "$R/$name.log" 2>&1
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
}
profile() {  # name, seconds, variants, variants traced
  local name=$1 limit=$2 variants=$3 traced=$4; shift 4
  timeout "$limit" torchrun --nproc_per_node=4 benchmarks/pipeline_profile.py --out "$R/$name" \
    --variants "$variants" --profile "$traced" --rounds 3 --steps 4 > "$R/$name.log" 2>&1
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
  find "$R/$name" -name 'trace_*.json.gz' ! -name '*_r1.json.gz' -delete  # rank 1's traces come back
}
case "$1" in
  A) timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py -k pipeline > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log"
     profile prof_async 200 ours-halves_1f1b,ours-halves-async_1f1b,torch-halves_1f1b,ours-halves_gpipe,ours-halves-async_gpipe,torch-halves_gpipe ours-halves-async_1f1b ;;
  B) suite PA 330 --worlds 4 --phases pipeline --variants pp,pp_dp,halves,async --rounds 3 ;;
  C) timeout 300 python -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log"
     suite M 200 --worlds 4 --phases models --third-party resnet50,vit --variants plain,torch,ours,trainer_zero3 --rounds 3 ;;
  D) suite M2 420 --worlds 4 --phases models --third-party resnet50,vit,bert,gpt2 \
       --variants plain,torch,ours,trainer,trainer_zero3,trainer_zero3_root --rounds 5 ;;
esac
tar -czf "$OUT/s22_$1.tar.gz" -C $R .

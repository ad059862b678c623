#!/usr/bin/env bash
# Session 27 (4x H200), what session 26 left to re-measure, in one call (results come back as
# $OUT/s27_<mode>.tar.gz):
#   N: T, the training and profiling phases at GPT-1.3B on worlds 1 and 4 (ZeRO-2/3 peak memory after the
#      TrainableSet leak fix; the profile with the GPU's SM clock and power); P, the pipeline phase at P = 4
#      with whole blocks and half blocks (both with the head's loss in the compute balance), eager and
#      CUDA graphs, 2 rounds, in one run so that the two cuts compare.
#   Q: the pipeline phase after the change of the cut (balance.schedule_cut with the compute model fitted to
#      N's per-stage times): P = 4 and P = 2 x DP = 2, whole and half blocks, eager and CUDA graphs, 2 rounds.
#   R: P = 4 at half blocks with the loss as it is (R0) and through torch.compile (R1, ``fused_loss``; the
#      head's loss then costs ~nothing in the cut), one after the other on one machine.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
R=/tmp/s27
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$R/gpus.txt"
run() {  # name, seconds in all, seconds per world, suite.py arguments
  local name=$1 limit=$2 per_world=$3; shift 3
  (cd benchmarks && timeout "$limit" python suite.py --out "$R/$name" --timeout "$per_world" "$@") 2>&1 \
    | grep -v -i "warn\|\*\*\*\*\*" > "$R/$name.log"
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
}
case "$1" in
  N) run P 250 240 --worlds 4 --phases pipeline --variants pp,compute,halves,graphs --rounds 2
     run T 290 140 --worlds 1,4 --phases training,profiling --models gpt-1.3b:8:1024 \
       --impls torch_ddp,ours_ddp,zero2,zero3,torch_fsdp2 ;;
  R) run R0 200 190 --worlds 4 --phases pipeline --variants pp,halves,graphs --rounds 2
     run R1 260 250 --worlds 4 --phases pipeline --variants pp,halves,graphs,fused_loss --rounds 2 ;;
  # R ran past the call's limit in R1 and nothing came back (the tar comes last; suite.py's timeout then
  # killed torchrun but not its workers: fixed, `suite._run_group`). S: R1 alone, its files straight to $OUT.
  S) R=$OUT; run R1 230 200 --worlds 4 --phases pipeline --variants pp,halves,graphs,fused_loss --rounds 1
     exit 0 ;;
  Q) run Q 400 390 --worlds 4 --phases pipeline --variants pp,pp_dp,compute,halves,graphs --rounds 2 ;;
esac
[ "$1" = T ] || tar -czf "$OUT/s27_$1.tar.gz" -C $R .
# T (written after S): the CUDA graphs' shared gradient accumulators: the GPU tests of the graphs, then the
# pipeline phase at P = 4 half blocks, graphed, 1 round (peak memory against S's and Q's).
if [ "$1" = T ]; then
  timeout -k 5 170 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py > "$OUT/gpu_tests.log" 2>&1
  echo "tests exit $?" >> "$OUT/gpu_tests.log"
  R=$OUT; run T 100 90 --worlds 4 --phases pipeline --variants pp,halves,graphs --rounds 1
fi

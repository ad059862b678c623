#!/usr/bin/env bash
# Session 23: CUDA graphs of the pipeline stages (issue 15; the engine's cuda_graphs), one 4-GPU call.
# Usage: benchmarks/device_s23.sh A; everything comes back as one archive, $OUT/s23_<mode>.tar.gz.
#   A: the graphs' NCCL test (graphed engine equal to the eager one, 2 GPUs), then the profile script's
#      step and host-issue times and engine timing (bubble) at P = 4, half blocks, 3 rounds: our 1F1B /
#      GPipe eager and graphed against torch's, interleaved.
#   B: the trainer's pipeline_cuda_graphs at P = 2 x DP = 2 with DDP (NCCL test against the eager trainer),
#      then the suite's pipeline phase at P = 4 and P = 2 x DP = 2, half blocks, every schedule, ours eager
#      and with CUDA graphs against torch's, 3 rounds.
#   C: after the review's fixes (mode in the spec, capture failures eager, BatchNorm warm-up undone): every
#      GPU test of the graphs (engine: 1F1B fp32 / bf16, GPipe, interleaved; BatchNorm; the trainer).
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
R=/tmp/s23
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$R/gpus.txt"
profile() {  # name, seconds, variants, variants traced
  local name=$1 limit=$2 variants=$3 traced=$4; shift 4
  timeout "$limit" torchrun --nproc_per_node=4 benchmarks/pipeline_profile.py --out "$R/$name" \
    --variants "$variants" --profile "$traced" --rounds 3 --steps 4 > "$R/$name.log" 2>&1
  echo "[$name] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/$name.log"
  find "$R/$name" -name 'trace_*.json.gz' ! -name '*_r1.json.gz' -delete  # rank 1's traces come back
}
case "$1" in
  A) timeout 150 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log"
     profile prof_graphs 330 ours-halves_1f1b,ours-halves-graphs_1f1b,torch-halves_1f1b,ours-halves_gpipe,ours-halves-graphs_gpipe,torch-halves_gpipe none ;;
  B) timeout 120 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py -k trainer > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log"
     (cd benchmarks && timeout 420 python suite.py --out "$R/P" --timeout 405 --worlds 4 --phases pipeline \
        --variants pp,pp_dp,halves,graphs --rounds 3) > "$R/P.log" 2>&1
     echo "[P] exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/P.log" ;;
  C) timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/test_pipeline_graphs.py > "$R/gpu_tests.log" 2>&1
     echo "tests exit $? at $(( $(date +%s) - start )) s" | tee -a "$R/gpu_tests.log" ;;
esac
tar -czf "$OUT/s23_$1.tar.gz" -C $R .

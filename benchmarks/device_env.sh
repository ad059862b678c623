# Sourced by benchmarks/device_s*.sh on the device machine (repository root, $OUT set): the environment,
# the machine in "$OUT/gpus.txt", `start` for elapsed seconds, and `gpu_tests NAME LIMIT ARGS...`, which
# runs pytest's GPU tests (ARGS: files, -k, ...) into "$OUT/NAME.log" with its exit status and time, and
# `suite NAME LIMIT PER_WORLD ARGS...`, which runs benchmarks/suite.py into "$OUT/NAME" (its log "$OUT/NAME.log").
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4 PYTHONPATH=$PWD
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$OUT/gpus.txt"

gpu_tests() {
  local name=$1 limit=$2
  shift 2
  timeout -k 5 "$limit" python -m pytest -q -p no:cacheprovider -m gpu "$@" > "$OUT/$name.log" 2>&1
  echo "tests exit $? at $(( $(date +%s) - start )) s" >> "$OUT/$name.log"
}

suite() {  # name, seconds in all, seconds per world, suite.py arguments
  local name=$1 limit=$2 per_world=$3
  shift 3
  (cd benchmarks && timeout -k 5 "$limit" python suite.py --out "$OUT/$name" --timeout "$per_world" "$@") 2>&1 \
    | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/$name.log"
  echo "exit $? at $(( $(date +%s) - start )) s" >> "$OUT/$name.log"
}

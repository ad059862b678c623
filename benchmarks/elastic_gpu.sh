#!/usr/bin/env bash
# Elastic training's GPU checks in one device call (issue 17): the NCCL tests of fast detection and of
# background checkpoints, then the suite's checkpoint phase (checkpoints every N steps, synchronous vs
# in the background, as % of step time); every log and results file is copied under $OUT.
#   WORLDS=1,4     world sizes of the checkpoint phase
#   EVERY=50       steps between checkpoints
#   ROUNDS=3       paired rounds
#   TESTS=...      the pytest selection run first (default: the NCCL tests of fast detection, background
#                  checkpoints and the two-agent harness on 4 GPUs, and the harness on CPU for its times on
#                  an idle host); TESTS=none skips them
set -o pipefail
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
cd "$(dirname "$0")/.."
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" >> "$OUT/gpus.txt"
TESTS=${TESTS:-tests/test_peer_watch.py tests/test_async_checkpoint.py tests/test_elastic_agents.py}
[ "$TESTS" = none ] || { timeout 420 python -m pytest -q -s -p no:cacheprovider --durations=10 \
    -m "gpu or not gpu" -k "nccl or leave_and_join or trains_as_one_process or side_stream" $TESTS 2>&1 \
    | grep -v -i "warn" | tail -40; echo "tests: $(( $(date +%s) - start )) s"; } > "$OUT/elastic_tests.log"
cd benchmarks
for strategy in ddp zero3; do
  worlds=${WORLDS:-1,4}
  [ "$strategy" = zero3 ] && worlds=4
  timeout 240 python suite.py --phases checkpoint --worlds "$worlds" --variants "every=${EVERY:-50},$strategy" \
    --rounds "${ROUNDS:-3}" --timeout 230 --out "/tmp/s_ckpt_$strategy" 2>&1 | grep -v -i "warn" > "$OUT/checkpoint_$strategy.log"
  cp "/tmp/s_ckpt_$strategy/results.json" "$OUT/checkpoint_$strategy.json"
  cp "/tmp/s_ckpt_$strategy/results.md" "$OUT/checkpoint_$strategy.md"
  echo "checkpoint $strategy done at $(( $(date +%s) - start )) s" >> "$OUT/checkpoint_$strategy.log"
done

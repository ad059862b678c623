#!/usr/bin/env bash
# Session 34: the 2-GPU kind (nvidia-h200-x2) was lent, not the 4-GPU one. Results go straight to $OUT.
#   A: every GPU test two GPUs can run, the new tests/test_gpu_peers.py among them (a raising rank named
#      by its peer on NCCL, uneven replicas under accumulation with ZeRO-3 / FSDP, the straggler probe).
#   B: the pipeline phase at P = 2 (half blocks; eager, graphed, torch's; every schedule; 2 rounds), as
#      session 28's H1: what session 33's per-(stage, microbatch) random streams cost the eager path.
. benchmarks/device_env.sh
case "$1" in
  A) gpu_tests gpu_tests_all 420 --continue-on-collection-errors --durations=20 -rs ;;
  B) (cd benchmarks && timeout -k 5 400 python suite.py --out "$OUT/B" --timeout 390 --worlds 2 --phases pipeline \
        --variants pp,halves,graphs --rounds 2) 2>&1 | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/B.log"
     echo "B exit $? at $(( $(date +%s) - start )) s" >> "$OUT/B.log" ;;
esac

#!/usr/bin/env bash
# Session 31: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT.
#   A: every GPU test one GPU can run, after the session's changes to the step (a raising rank's error
#      published, the micro-batch agreement), the mesh's host groups and checkpoint loading (the image lacks
#      pydantic: files needing it fail to collect; none of them holds a GPU test).
. benchmarks/device_env.sh
case "$1" in
  A) gpu_tests gpu_tests_all 420 --continue-on-collection-errors --durations=15 -rs ;;
esac

#!/usr/bin/env bash
# Session 32: only the 1-GPU machine (nvidia-h200) was lent. Results go straight to $OUT.
#   A: every GPU test one GPU can run, after the session's changes (summon_full_params and the module's
#      guard under FSDP, evaluate() with the first replica's buffers, the checkpoint directory's lock,
#      the stop on SIGHUP / a second Ctrl-C); tests/test_gpu_summon.py is new.
. benchmarks/device_env.sh
case "$1" in
  A) gpu_tests gpu_tests_all 420 --continue-on-collection-errors --durations=15 -rs ;;
esac

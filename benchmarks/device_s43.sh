#!/usr/bin/env bash
# Session 43: the 1- and 2-GPU kinds lent (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (2 GPUs): every GPU test two GPUs can run, among them the pipeline's on NCCL with the session's new
#      checks (every rank's batch rows agreed over the gloo header group at each step; ZB-H1's graph
#      inspection at each step's first captured I).
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) gpu_tests gpu_tests_all_A 480 --durations=15 -rs ;;
esac

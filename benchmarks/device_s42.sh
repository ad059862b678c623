#!/usr/bin/env bash
# Session 42: the 1- and 2-GPU kinds lent (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (2 GPUs): the group store's new prefix (a number rank 0 opens, confirmed to every rank) on NCCL under
#      two torchrun agents, one worker's failure restarting both (tests/test_elastic_agents.py), then every
#      GPU test two GPUs can run (init_distributed's change is under every torchrun-launched test).
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) gpu_tests gpu_tests_restart_A 200 -rs tests/test_elastic_agents.py -k one_nodes
     gpu_tests gpu_tests_all_A 420 --durations=15 -rs ;;
esac

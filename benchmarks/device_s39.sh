#!/usr/bin/env bash
# Session 39: the 1- and 2-GPU kinds lent (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (2 GPUs): every GPU test two GPUs can run, with tests/test_gpu_backward_paths.py (new): session 38's
#      last fixes on NCCL (two backward passes before a step, reentrant checkpointing with tensor and
#      dataclass outputs, a batch skipped after its backward raised), against one CPU process.
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) gpu_tests gpu_tests_all_A 480 --durations=15 -rs ;;
esac
# B (2 GPUs): the pipeline phase at P = 2 (half blocks; eager, graphed, torch's; every schedule; 2 rounds),
#    as session 34's B: a check that sessions 35-39's changes left the engine's speed and bubbles alone.
case "$1" in
  B) suite B 400 390 --worlds 2 --phases pipeline --variants pp,halves,graphs --rounds 2 ;;
esac
# C (2 GPUs): after this session's pipeline changes (a "done" message from every rank to the last before the
#    loss, the schedule's sends waited for after it, resync after a failed step) and the trainer's: every
#    GPU test two GPUs can run (tests/test_gpu_pipeline_retry.py new), then B's pipeline phase again.
case "$1" in
  C) gpu_tests gpu_tests_all_C 330 --durations=15 -rs
     suite C 200 190 --worlds 2 --phases pipeline --variants pp,halves,graphs --rounds 2 ;;
esac
# D (2 GPUs): C's tests ran past their limit: the NCCL retry after a failed pipeline step failed (a known-shape
#    receive posted for a message never sent: now paired with a filler by resync), then hung. That file
#    alone, then the other pipeline GPU tests.
case "$1" in
  D) gpu_tests gpu_tests_retry_D 150 tests/test_gpu_pipeline_retry.py -x
     gpu_tests gpu_tests_pipeline_D 200 tests/test_gpu_nccl.py tests/test_gpu_pipeline_timing.py tests/test_pipeline_graphs.py \
       tests/test_gpu_peers.py tests/test_gpu_backward_paths.py -k "pipeline or bubble or graph or backward" ;;
esac
# E (2 GPUs): D's retry test hung again: after the failed step rank 0's GPU stream waited for a known-shape
#    receive that never comes, under the next call (full_state_dict's collectives). The pipeline now pairs
#    its messages right at the abort, on every rank (`StageLink.settle_after_abort`). D's runs again.
case "$1" in
  E) gpu_tests gpu_tests_retry_E 150 tests/test_gpu_pipeline_retry.py -x
     gpu_tests gpu_tests_pipeline_E 200 tests/test_gpu_nccl.py tests/test_gpu_pipeline_timing.py tests/test_pipeline_graphs.py \
       tests/test_gpu_peers.py tests/test_gpu_backward_paths.py -k "pipeline or bubble or graph or backward" ;;
esac

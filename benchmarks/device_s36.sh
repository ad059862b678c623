#!/usr/bin/env bash
# Session 36: the 2-GPU kind (nvidia-h200-x2) lent, not the 4-GPU one. Results go straight to $OUT.
#   B (2 GPUs): every GPU test two GPUs can run (pydantic from the carried wheels, `carry: [".wheels"]`),
#      after this session's changes on GPU paths: FSDP's check that every rank ran the same units (an
#      int64 all-reduce and, on a mismatch, an all_gather_object on NCCL: test_gpu_fsdp_units.py), the
#      wait meters switched off around evaluations, DDP's bucket layout and FSDP's watch moved into
#      modules of their own, the monitor's writer-thread side moved into monitor/writer.py.
. benchmarks/device_env.sh
case "$1" in
  B) pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/pyd
     gpu_tests gpu_tests_all 540 --durations=15 -rs ;;
esac
# C (2 GPUs): B again with the session's last code (the later changes touch the trainer's constructor, fit's
#    batch fetch and its peers' watch, evaluate, DDP's logged figures, FSDP's check of gathered units).
case "$1" in
  C) pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/pyd
     gpu_tests gpu_tests_all_C 540 --durations=15 -rs ;;
esac
# D (2 GPUs): the peers' GPU tests with the one added after C (a rank whose data raises inside fit, on NCCL).
case "$1" in
  D) pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/pyd
     gpu_tests gpu_tests_peers_D 300 -rs tests/test_gpu_peers.py tests/test_gpu_fsdp_units.py ;;
esac

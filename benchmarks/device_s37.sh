#!/usr/bin/env bash
# Session 37: the 1- and 2-GPU kinds lent, not the 4-GPU one (issue 15 still waits for it). Results go to $OUT.
#   A (2 GPUs): a regression check of sessions 27-36's hardening on the hot paths (the replica count's small
#      all-reduce a step, FSDP's watched passes, the peer watch in fit, the trainer's checks): the models
#      phase (ResNet-50, BERT, ViT, GPT-2 against torch DDP, 5 rounds of 30 steps, as session 26's
#      models_2026-11-28_4xh200_s26_5x30.md) and the training phase at 1.3B (torch DDP, our DDP, ZeRO-2/3,
#      torch FSDP2), world 2, in one call.
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) suite M 260 250 --worlds 2 --phases models --variants plain,torch,ours,trainer --rounds 5 --steps 30
     suite T 260 250 --worlds 2 --phases training --models gpt-1.3b:8:1024 \
       --impls torch_ddp,ours_ddp,zero2,zero3,torch_fsdp2 ;;
esac
# B (2 GPUs): every GPU test two GPUs can run, after this session's changes on paths the GPU runs take: the
#    options agreed in the trainer's constructor and fit (all_gather_object on NCCL), the resume point
#    broadcast and meta.pt's read agreed (NCCL), summon_full_params' writeback into CUDA shards, the
#    loaders' per-sample seeding (pinned memory), the progress bar without log_dir.
case "$1" in
  B) gpu_tests gpu_tests_all_B 560 --durations=15 -rs ;;
esac
# C (2 GPUs): B again with the session's last code (the review's fixes: the resume point's picker, loader
#    workers' SIGTERM, the second Ctrl-C's flag, fit's data-kind option, the BatchNorm rule in dtrain).
case "$1" in
  C) gpu_tests gpu_tests_all_C 560 --durations=15 -rs ;;
esac
# D (1 GPU, run as a command line): the bar without log_dir reading a GPU loss without a device wait:
#    . benchmarks/device_env.sh; gpu_tests gpu_tests_s37_D 200 -rs tests/test_trial_s37.py tests/test_monitor.py
# E (2 GPUs): B again after the last change (a collective call says itself in the store while it lasts).
case "$1" in
  E) pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/pyd
     gpu_tests gpu_tests_all_E 560 --durations=15 -rs ;;
esac

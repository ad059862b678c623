#!/usr/bin/env bash
# Session 38: the 1- and 2-GPU kinds lent (issue 15 still waits for 4 GPUs), and under ten device minutes
# left. Results go to $OUT.
#   A (2 GPUs): every GPU test two GPUs can run, after this session's changes on paths the GPUs take: DDP's
#      hook on a forward's outputs (the backward's end queued from there, on the outermost pass) and its
#      first-step arrival order without duplicates, FSDP's root unit gathered again at a backward's start,
#      requires_grad_ locked on sharded modules, accuracy over the targets kept, the first-sample checksum
#      in fit's length all-gather (NCCL).
#   B (2 GPUs): the models phase for ResNet-50 and BERT, where DDP's new hook on a forward's outputs runs
#      every step (BERT's outputs a Hugging Face ModelOutput): torch DDP, ours, the trainer, 3 rounds of 30.
#   C (2 GPUs, the warm machine of B, run as a command line): B's BERT too noisy in 3 rounds (its torch DDP
#      rounds 42-51 ms): ResNet-50 and BERT, torch DDP and ours, 7 rounds of 30:
#      . benchmarks/device_env.sh; export PYTHONPATH=$PWD:/tmp/pyd; suite M 150 145 --worlds 2 \
#        --phases models --third-party bert,resnet50 --variants torch,ours --rounds 7 --steps 30
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  B) suite M 215 210 --worlds 2 --phases models --third-party resnet50,bert --variants torch,ours,trainer \
       --rounds 3 --steps 30 ;;
  A) gpu_tests gpu_tests_all_A 420 --durations=15 -rs ;;
esac

#!/usr/bin/env bash
# Session 41: the 1- and 2-GPU kinds lent (issue 15 still waits for 4 GPUs). Results go to $OUT.
#   A (2 GPUs): the failure agreement (session 40, never on a GPU), DDP's cleanup after a failed backward and
#      the peer watch from the first collective call on NCCL (tests/test_gpu_failure_agreement.py), then
#      every GPU test two GPUs can run.
#   A found: on NCCL an evaluation before the first step, failing on one rank, returned this rank's own sums on
#      the other (the watcher's abort ends a waiting collective without an error); DDP's test lacked its device.
#   B (2 GPUs): A's two failed tests again, then the models phase (timm ResNet-50 and ViT-B/16, Hugging Face BERT-base and GPT-2; torch DDP,
#      ours and the trainer, 5 rounds of 30 steps): a check of the step's path after sessions 39-41's
#      additions (the failure agreement's check before each step, the peer watch from the first call).
. benchmarks/device_env.sh
pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
case "$1" in
  A) gpu_tests gpu_tests_agreement_A 200 -rs tests/test_gpu_failure_agreement.py
     gpu_tests gpu_tests_all_A 400 --durations=15 -rs ;;
  B) gpu_tests gpu_tests_agreement_B 200 -rs tests/test_gpu_failure_agreement.py
     suite M 480 470 --worlds 2 --phases models --third-party resnet50,bert,vit,gpt2 \
       --variants torch,ours,trainer --rounds 5 --steps 30 ;;
esac

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
# D (2 GPUs): pydantic from carried wheels (.wheels: the image lacks it, so six test files never collected
#    on a GPU and dtrain never ran there), every GPU test two GPUs can run, then the README's dtrain jobs
#    on the two GPUs (NCCL, as a user with a GPU box runs them), each with its exit status.
case "$1" in
  D) pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/pyd
     gpu_tests gpu_tests_all 300 --durations=15 -rs
     job() {  # NAME COMMAND...: one README job, its output and exit status in $OUT/readme_NAME.log
       local name=$1; shift
       timeout -k 5 150 "$@" > "$OUT/readme_$name.log" 2>&1
       echo "exit $? at $(( $(date +%s) - start )) s" >> "$OUT/readme_$name.log"
       tail -n 1 "$OUT/readme_$name.log" | sed "s/^/$name: /" >> "$OUT/readme.txt"
     }
     job gpt_ddp torchrun --standalone --nproc_per_node=2 -m distributed_training examples/configs/gpt_cpu.yaml
     job gpt_zero3_resume python -m distributed_training examples/configs/gpt_cpu.yaml --set training.strategy=zero3 \
       --set training.max_steps=200
     job user_zero3 torchrun --standalone --nproc_per_node=2 -m distributed_training examples/configs/user_model.yaml \
       --set training.strategy=zero3 --set checkpoint.dir=checkpoints/user_model_zero3
     job gpt_pipeline torchrun --standalone --nproc_per_node=2 -m distributed_training examples/configs/gpt_pipeline_cpu.yaml
     job gpt_tensor torchrun --standalone --nproc_per_node=2 -m distributed_training examples/configs/gpt_tensor_cpu.yaml
     job digits_bf16 torchrun --standalone --nproc_per_node=2 -m distributed_training examples/configs/digits_zero3.yaml \
       --set training.precision=bf16
     job ps torchrun --standalone --nproc_per_node=2 -m distributed_training examples/configs/digits_zero3.yaml \
       --set training.strategy=parameter_server --set training.num_servers=1 --set optimizer.name=sgd \
       --set training.lr=0.05 ;;
esac
# E (2 GPUs): the final GPU tests (pydantic carried), then PowerSGD per weight matrix (session 33's form)
#    against dense DDP and torch DDP at GPT-1.3B on 2 GPUs, 2 interleaved rounds (the README's 4-GPU row
#    is the old whole-bucket form).
case "$1" in
  E) pip install -q --no-index --find-links .wheels --target /tmp/pyd pydantic > "$OUT/pip.log" 2>&1
     export PYTHONPATH=$PWD:/tmp/pyd
     gpu_tests gpu_tests_all 260 --durations=10 -rs
     (cd benchmarks && timeout -k 5 240 python suite.py --out "$OUT/E" --timeout 230 --worlds 2 --phases training \
        --models gpt-1.3b:8:1024 --impls torch_ddp,ours_ddp,ddp_powersgd --rounds 2) 2>&1 \
        | grep -v -i "warn\|\*\*\*\*\*" > "$OUT/E.log"
     echo "E exit $? at $(( $(date +%s) - start )) s" >> "$OUT/E.log" ;;
esac

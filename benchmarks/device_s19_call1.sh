#!/usr/bin/env bash
# Session 19, device call 1 (4 GPUs): tensor-parallel NCCL tests; the 7B at TP = 4 without SP with the
# row-parallel bias inside the matmul (ours) and after the all-reduce (bias_after) against torch's DTensor TP;
# the parameter server behind dtrain on NCCL under sync / ssp / async. Results under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
start=$(date +%s)
pip install -q --no-index --target /tmp/pyd .wheels/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/pyd
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpus.txt"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version())" >> "$OUT/gpus.txt"
timeout 150 python -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py -k "tensor" > "$OUT/gpu_tests_tensor.log" 2>&1
echo "tests: $(( $(date +%s) - start )) s" >> "$OUT/gpu_tests_tensor.log"
for c in sync ssp async; do
  extra=""; [ $c = ssp ] && extra="--set training.staleness=2"
  timeout 90 torchrun --standalone --nproc_per_node=4 -m distributed_training examples/configs/digits_zero3.yaml \
    --set training.strategy=parameter_server --set training.num_servers=1 --set training.consistency=$c $extra \
    --set optimizer.name=sgd --set training.lr=0.05 --set output=/tmp/ps_$c.pt > /tmp/ps_$c.log 2>&1
  echo "[$c] exit $? at $(( $(date +%s) - start )) s: $(grep -h 'dtrain: finished' /tmp/ps_$c.log | tail -1)" >> "$OUT/ps_trainer_nccl.log"
  tail -3 /tmp/ps_$c.log >> "$OUT/ps_trainer_nccl.log"
done
cd benchmarks
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python suite.py --phases tensor --worlds 4 --variants "big,bias_after,config=7B TP4 no SP" \
  --rounds 3 --timeout $(( left - 10 )) --out /tmp/s_tp > "$OUT/tensor.log" 2>&1
cp /tmp/s_tp/results.json "$OUT/tensor.json"; cp /tmp/s_tp/results.md "$OUT/tensor.md"
echo "done at $(( $(date +%s) - start )) s" >> "$OUT/tensor.log"

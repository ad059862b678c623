#!/usr/bin/env bash
# dtrain's parameter server on the digits, sync vs ssp (s = 2) vs async, 1 server + 3 workers on CPU
# processes (torchrun), the README's settings (SGD lr 0.05): the final validation accuracy of each.
# Usage: benchmarks/ps_dtrain_digits.sh EPOCHS [CODE_ROOT]   (CODE_ROOT: another checkout to run, e.g. a
# worktree of an older commit; default this one)
set -o pipefail
epochs=${1:-5}
root=$(cd "${2:-$(dirname "$0")/..}" && pwd)
echo "# $(cd "$root" && git log -1 --format='%h %ad' --date=short), $epochs epochs, $(date -u +%FT%TZ)"
for mode in "sync 0" "ssp 2" "async 0"; do
  set -- $mode
  out=$(cd /tmp && PYTHONPATH=$root OMP_NUM_THREADS=1 timeout 900 python -m torch.distributed.run --standalone \
    --nproc_per_node=4 -m distributed_training "$root/examples/configs/digits_zero3.yaml" \
    --set training.strategy=parameter_server --set training.num_servers=1 --set optimizer.name=sgd \
    --set training.lr=0.05 --set training.consistency=$1 --set training.staleness=$2 --set training.epochs=$epochs \
    --set logging.dir=null --set checkpoint.dir=null 2>&1 | grep "finished at" | tail -1)
  echo "$1: $out"
done

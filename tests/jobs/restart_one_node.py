"""A job for two torchrun agents (one worker each): rank 1 fails once; both agents restart their workers.

Agent 1 counts that as a restart (``TORCHELASTIC_RESTART_COUNT`` 1), agent 0 as a membership change (still
0). Every incarnation forms two groups in turn (a second trainer after the first's `shutdown()`) and
checks each with an all-reduce. Rank 0's first worker waits outside any collective meanwhile, so that
it does not fail too (which its agent would count as a restart). Prints ``RESTART rank=R count=C group=G
sum=S`` per group.
Run by `tests/test_elastic_agents.py::test_one_nodes_worker_fails_and_both_nodes_restart_on_the_shared_store`.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

from distributed_training import init_distributed

marker = sys.argv[1]
backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"  # nccl: each agent's one worker on its own GPU
first = not os.path.exists(marker)  # read before rank 1 of the first incarnation writes it (after group 1 met)
for group in (1, 2):
    ctx = init_distributed(backend=backend, timeout=30)
    total = torch.tensor([float(ctx.rank + 1)], device=ctx.device)
    dist.all_reduce(total)
    print(f"RESTART rank={ctx.rank} count={os.environ['TORCHELASTIC_RESTART_COUNT']} group={group} "
          f"sum={total.item():g}", flush=True)
    if ctx.rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)  # the first incarnation's rank 1 dies after its first group
    if first:  # rank 0 waits outside any collective: its agent ends it on seeing the other node waiting
        time.sleep(120)
    dist.barrier()
    ctx.shutdown()

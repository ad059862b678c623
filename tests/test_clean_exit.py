"""A job that succeeded exits cleanly: after `DistributedTrainer.close()` no gloo thread is left.

torch._dynamo, imported after the default process group exists (building any torch.optim optimizer does
it), keeps references to that group, so `destroy_process_group` could not free it and its gloo threads
lived on into the interpreter's exit, where one still busy aborts the process ("terminate called without
an active exception") after the job had succeeded: seen in CI on examples run under torchrun. The runtime
imports dynamo before it creates the group; this script checks, in fresh interpreters under torchrun (the
test harness's fork server has dynamo loaded already), that closing leaves no gloo thread.
"""

from __future__ import annotations

import sys

import pytest


SCRIPT = '''
import os, sys
import torch, torch.nn.functional as F
from torch import nn
from distributed_training import DistributedTrainer

def gloo_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if "gloo" in n]

torch.manual_seed(0)
trainer = DistributedTrainer(nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=sys.argv[1])
trainer.train_step((torch.randn(8, 4), torch.randint(0, 2, (8,))), F.cross_entropy)
trainer.close()
print(f"rank {os.environ['RANK']} gloo threads after close: {gloo_threads()}", flush=True)
'''


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_close_leaves_no_gloo_thread(tmp_path, strategy, warm_torchrun):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    result = warm_torchrun(script, [strategy], nproc=2, timeout=100)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} gloo threads after close: []" in out, out[-3000:]

"""Session 48, one GPU: DDP's ring pattern under the trainer with a log_dir on CUDA, so that the blocking
reducer's communication is timed with CUDA events (`CommTiming._add_blocking_comm`) and read back at log
steps; prints the run's performance figures. Run under torchrun (any number of GPUs)."""
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from distributed_training import CommunicationOptimizer, DistributedTrainer

out = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 10))
data = TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.05), strategy="ddp",
                             communication=CommunicationOptimizer(pattern="ring"), log_dir=os.path.join(out, "runs"),
                             log_every=5, progress=False)
history = trainer.fit(data, criterion=F.cross_entropy, batch_size=64, max_steps=40)
print("history", history, flush=True)
print("perf", {k: v for k, v in trainer.get_performance_metrics().items() if "comm" in k or "cluster" in k}, flush=True)
trainer.close()

"""Small models for the parity tests, each exercising one thing DDP must get right."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distributed_training.models import GPT, GPTConfig


class MLP(nn.Module):
    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class ConvBN(nn.Module):
    """A CNN whose BatchNorm running statistics are buffers DDP must broadcast."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.head(x.mean(dim=(2, 3)))


class Branchy(nn.Module):
    """`forward(x, use_b)`: branch b is used only when asked (locally unused on some ranks), and
    `never` is never used (globally unused)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch_a = nn.Linear(16, 4)
        self.branch_b = nn.Linear(16, 4)
        self.never = nn.Linear(16, 4)

    def forward(self, x, use_b: bool):
        h = torch.tanh(self.trunk(x))
        out = self.branch_a(h)
        if use_b:
            out = out + self.branch_b(h)
        return out


class Reordered(nn.Module):
    """Registration order differs from execution order, so gradient arrival order is not the
    reverse of registration order: the bucket rebuild has something to fix."""

    def __init__(self) -> None:
        super().__init__()
        self.last = nn.Linear(32, 4)
        self.middle = nn.Linear(32, 32)
        self.first = nn.Linear(8, 32)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def tiny_gpt(dropout: float = 0.0) -> GPT:
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=dropout))


class MixedDtypeFrozen(nn.Module):
    """A channels-last convolution, a frozen layer and a bf16 head: buckets per dtype, frozen
    parameters left alone, gradient strides that differ from the bucket views'."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.frozen = nn.Linear(64, 64)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(64, 2).to(torch.bfloat16)

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.head(self.frozen(h).bfloat16()).float()


def tiny_gpt_data():
    """54 sequences of 16 tokens for `tiny_gpt` (inputs and next-token targets)."""
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (54, 17), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def reference_step(model, optimizer, *inputs, loss_fn=None) -> torch.Tensor:
    """One step of the single-process reference: ``loss_fn(model(x), y)`` (or the model's own loss when
    `loss_fn` is None), backward, optimizer step, zero_grad; returns the loss."""
    loss = model(*inputs) if loss_fn is None else loss_fn(model(inputs[0]), inputs[1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def job_main(rank: int, world_size: int, name: str, argv: list[str]) -> None:
    """`run_distributed` target: ``tests/jobs/<name>.py``'s ``main(argv)`` on this rank, in the process group
    that already exists (a job's reference run without torchrun's fresh interpreters)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(f"_job_{name}", Path(__file__).with_name("jobs") / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(argv)

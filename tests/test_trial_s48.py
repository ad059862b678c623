"""Session 48's trial findings, each test failing on the code before its fix."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import _forked_torchrun
from distributed_training import DistributedTrainer

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ torchrun's agent killed (session 47's Left)
_LONG_JOB = """
import os, sys, time
import torch, torch.nn.functional as F
from distributed_training import DistributedTrainer

out = sys.argv[1]
torch.manual_seed(0)
trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
with open(os.path.join(out, f"pid_{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
for step in range(600):
    trainer.train_step((torch.randn(8, 4), torch.randn(8, 2)), F.mse_loss)
    time.sleep(0.1)
print("trained to the end", flush=True)
trainer.close()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_workers_whose_torchrun_agent_was_killed_end_rather_than_train_on_as_orphans(tmp_path):
    # SIGKILL to torchrun's agent (the OOM killer, a scheduler's hard kill of that one process) left its
    # workers training to the end: the store they beat into died with the agent, and the watch stopped
    # quietly, as at a normal teardown.
    script = tmp_path / "job.py"
    script.write_text(_LONG_JOB)
    job = _forked_torchrun.start(script, [str(tmp_path)], nproc=2, cwd=REPO,
                                 env={"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2:
            assert job.poll() is None and time.monotonic() < deadline, job.output()[-3000:]
            try:
                pids = [int((tmp_path / f"pid_{r}").read_text()) for r in range(2)]
            except (OSError, ValueError):
                time.sleep(0.1)
        time.sleep(1.0)  # a few steps in
        os.kill(job.pid, signal.SIGKILL)  # the agent alone, not its workers
        killed = time.monotonic()
        while any(_alive(pid) for pid in pids) and time.monotonic() - killed < 20:
            time.sleep(0.1)
        ended = time.monotonic() - killed
        out = job.output()
        assert not any(_alive(pid) for pid in pids), f"the orphans still train after {ended:.0f} s:\n{out[-3000:]}"
        assert ended < 10, ended
        assert "the torchrun agent that started this worker" in out and "orphaned worker" in out, out[-3000:]
        assert "trained to the end" not in out, out[-3000:]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        job.close()


# ------------------------------------------------------------------ a pipeline's first layer taking several inputs (trial A)
class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(4, 16)

    def forward(self, x, z):
        return torch.tanh(self.a(x) + self.b(z))


class _Keywords(torch.nn.Module):  # as a Hugging Face model's embedding takes its batch
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)

    def forward(self, input_ids, attention_mask):
        h = self.emb(input_ids) * attention_mask[..., None]
        return h.sum(1) / attention_mask.sum(1, keepdim=True)


def _several_inputs(rank, world, kind, schedule):
    import copy

    from distributed_training.pipeline.stages import Chain

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    first = _TwoInputs() if kind == "tuple" else _Keywords()
    model = Chain([("first", first), ("hidden", torch.nn.Linear(16, 16)), ("act", torch.nn.Tanh()),
                   ("head", torch.nn.Linear(16, 4))])
    reference = copy.deepcopy(model)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9), progress=False,
                                 pipeline_parallel_size=2, pipeline_schedule=schedule, microbatches=3,
                                 pipeline_split_points=["hidden"])
    off = []
    for step in range(3):
        rows = 12 - 3 * step
        if kind == "tuple":
            inputs = (torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g))
        else:
            mask = (torch.rand(rows, 6, generator=g) < 0.7).float()
            mask[:, 0] = 1
            inputs = {"input_ids": torch.randint(0, 20, (rows, 6), generator=g), "attention_mask": mask}
        targets = torch.randint(0, 4, (rows,), generator=g)
        trainer.train_step((inputs, targets), F.cross_entropy)
        out = reference(*inputs) if kind == "tuple" else reference(**inputs)  # as train_step calls a model
        F.cross_entropy(out, targets).backward()
        reference_opt.step()
        reference_opt.zero_grad()
        state = trainer.full_state_dict()
        if rank == 0:
            off.append(max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()))
    trainer.close()
    return off


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,schedule", [("tuple", "1f1b"), ("dict", "zbh1")])
def test_a_pipelines_first_layer_takes_a_tuple_or_dict_batch_as_a_model_does(kind, schedule):
    # train_step unpacks a tuple batch into a model's positional arguments and a dict into its keywords;
    # under a pipeline the first layer got the whole tuple or dict as one argument ("forward() missing 1
    # required positional argument").
    from distributed_training.testing import run_distributed

    off = run_distributed(_several_inputs, 2, args=(kind, schedule), timeout=100)[0]
    assert len(off) == 3 and max(off) < 1e-6, off


# ------------------------------------------------------------------ nan from a criterion the trainer cannot read (trial A)
def _ignoring_class_zero(rank, world, directory):
    from distributed_training import NonFiniteLossError

    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, 2, 0, 1] + [0] * 4 + [2, 1, 0, 2] + [1] * 4)  # the second batch: every target class 0
    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(4, 3), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                 checkpoint_dir=directory, checkpoint_every=1)
    try:
        trainer.fit(torch.utils.data.TensorDataset(x, y), criterion=lambda o, t: F.cross_entropy(o, t, ignore_index=0),
                    batch_size=4, epochs=1, shuffle=False)
        said = "no error"
    except NonFiniteLossError as err:
        said = str(err)
    trainer.close()
    return said


@pytest.mark.timeout(60)
def test_a_nan_loss_from_a_criterion_ignoring_another_class_says_how_to_pass_it(tmp_path):
    from distributed_training.testing import run_distributed

    [said] = run_distributed(_ignoring_class_zero, 1, args=(str(tmp_path / "ckpt"),), timeout=50)
    assert said.startswith("training step 2: not finite (loss nan)"), said
    assert "ignore_index other than -100" in said and "nn.CrossEntropyLoss(ignore_index=...)" in said, said


# ------------------------------------------------------------------ DDP options (trial B)
def _wrapped_twice(rank, world):
    from distributed_training import DDP

    torch.manual_seed(0)
    module = torch.nn.Linear(8, 4)
    first = DDP(module)
    first(torch.randn(2, 8)).sum().backward()
    try:
        DDP(module)
        said = "no error"
    except ValueError as err:
        said = str(err)
    first.remove_hooks()  # then wrapping it again is fine, and averages once
    module.zero_grad()
    second = DDP(module)
    x = torch.full((2, 8), float(rank + 1))
    second(x).sum().backward()
    return said, module.weight.grad[0, 0].item()


@pytest.mark.timeout(60)
def test_a_module_a_live_ddp_holds_is_refused_by_a_second_one():
    # The second wrapper's first backward blamed "a gradient hook ... registered after the model was
    # wrapped": the first wrapper's own hooks.
    from distributed_training.testing import run_distributed

    for said, grad in run_distributed(_wrapped_twice, 2, timeout=50):
        assert said.startswith("module is already wrapped by another DDP") and "remove_hooks()" in said, said
        assert grad == pytest.approx(2 * 1.5), grad  # the mean of the ranks' 2 * (rank + 1)


def test_error_feedback_off_is_refused_where_nothing_is_fed_back():
    # The config refused communication.error_feedback with bf16 or no compression; the API took it silently.
    from distributed_training import CommunicationOptimizer

    for compression in (None, "bf16", "fp16"):
        with pytest.raises(ValueError, match="error_feedback=False applies to compression 'topk' or 'powersgd'"):
            CommunicationOptimizer(compression, error_feedback=False)
    CommunicationOptimizer("topk", error_feedback=False)
    CommunicationOptimizer("powersgd", error_feedback=False)

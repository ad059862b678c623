"""examples/train_gpt.py runs end to end on CPU: under torchrun with two real processes, and as a plain script.

The example is started exactly as a user would start it, in fresh processes, so these tests also
cover what the in-process harness cannot: torchrun's rendezvous, the env:// process group, and a
world of one with no launcher at all. `run_torchrun` starts torchrun `--standalone` (its store on a
port the OS picks) and kills torchrun and its workers together on a timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/train_gpt.py"
# The smallest preset: the example's validation passes over its 2,092 windows (before and after training)
# are most of its time with the default "small" one, and what is checked here does not depend on the size.
PRESET = ["--preset", "tiny"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")

TRAIN_LOSS = re.compile(r"^train loss: ([\d.]+) \(step (\d+)\) -> ([\d.]+) \(step (\d+)\)$", re.M)
VAL_LOSS = re.compile(r"^val loss: ([\d.]+) before training -> ([\d.]+) after$", re.M)


def _env() -> dict[str, str]:
    """This environment without any launcher's variables, on CPU, one thread per process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # Two processes on a one-GPU machine would both want cuda:0's NCCL rank; this test is about CPU.
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    return env


def _check(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, (
        f"{' '.join(map(str, result.args))} exited with {result.returncode}\n--- stdout ---\n{result.stdout}\n"
        f"--- stderr ---\n{result.stderr}"
    )
    return result


def _losses(out: str) -> tuple[float, float, float, float]:
    """(first logged train loss, last logged train loss, val loss before, val loss after)."""
    train, val = TRAIN_LOSS.search(out), VAL_LOSS.search(out)
    assert train and val, f"loss summary lines missing from the output:\n{out}"
    return float(train[1]), float(train[3]), float(val[1]), float(val[2])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_two_processes(tmp_path, warm_torchrun):
    ckpt = tmp_path / "ckpt" / "gpt"  # a checkpoint directory that does not exist yet
    result = _check(warm_torchrun(SCRIPT, [*PRESET, "--steps", "5", "--grad-accum", "2", "--checkpoint", str(ckpt)], nproc=2,
                                 env=_env(), cwd=ROOT, timeout=150))
    out = result.stdout
    assert "world size 2 on cpu (gloo)" in out, out
    # Only rank 0 prints.
    assert out.count("train loss:") == 1 and len(re.findall(r"^step ", out, re.M)) == 5, out
    first, last, val_before, val_after = _losses(out)
    assert last < first, out
    assert val_after < val_before, out

    assert ckpt.is_dir(), f"no checkpoint at {ckpt}:\n{out}"
    assert sorted(p.name for p in ckpt.iterdir()) == ["meta.pt", "meta.pt.sha256", "rank0.pt", "rank1.pt"], "temporary files left behind?"
    meta = torch.load(ckpt / "meta.pt", map_location="cpu", weights_only=True)
    assert meta["step"] == 5 and meta["world_size"] == 2
    state = torch.load(ckpt / "rank0.pt", map_location="cpu", weights_only=True)
    assert "wte.weight" in state["params"] and not any(k.startswith("module.") for k in state["params"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_plain_python_world_of_one(warm_python):
    result = _check(warm_python([SCRIPT, *PRESET, "--steps", "3"], cwd=ROOT, env=_env(), timeout=150))
    out = result.stdout
    assert "world size 1 on cpu (gloo)" in out, out
    first, last, val_before, val_after = _losses(out)
    assert last < first, out
    assert val_after < val_before, out

"""Two torchrun agents on one host as two elastic "nodes" (``--nnodes=1:2``, 2 workers each): kill one
agent's whole process tree mid-run; the other restarts its workers, re-forms the job at world 2 and
resumes from the latest good checkpoint. Prints the time from the kill to the next completed step.

The rendezvous store is this process's own `TCPStore`, bound to port 0 (the OS picks a free port: no
port is chosen first and bound later), and both agents join it as clients (``is_host=false``), so
killing either agent leaves the rendezvous alive. Run: ``python tests/jobs/elastic_two_agents.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from distributed_training.testing import DistributedTestError, TorchrunJob, _torchrun_env

JOB = Path(__file__).resolve().parent / "elastic_job.py"
EVENT = re.compile(r"ELASTIC (failed error=\w+|start|ready)[^\n]*?time=([\d.]+)")
HELD = re.compile(r"ELASTIC held step=(\d+) seconds=([\d.]+)")
LINE = re.compile(r"ELASTIC step=(\d+) world=(\d+) attempt=(\d+) time=([\d.]+)")


def _agent(port: int, run_id: str, ckpt: str, steps: int, strategy: str, unshared: bool = False,
           records: str | None = None, step_seconds: float = 0.2, hold: str | None = None,
           devices: str = "", job_class: type[TorchrunJob] = TorchrunJob) -> TorchrunJob:
    conf = ("is_host=false,join_timeout=60,last_call_timeout=1,close_timeout=10,"
            "keep_alive_interval=1,keep_alive_max_attempt=3")
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run_id}", f"--rdzv-conf={conf}",
            "--max-restarts=3", "--monitor-interval=0.2", str(JOB), "--ckpt", ckpt, "--steps", str(steps),
            "--strategy", strategy, "--step-seconds", str(step_seconds), *(["--records", records] if records else []),
            *(["--hold", hold] if hold else [])]
    env = {"CUDA_VISIBLE_DEVICES": devices, **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if unshared else {})}
    return job_class(args, env=_torchrun_env(env), cwd=None)


def _steps(job: TorchrunJob) -> list[tuple[int, int, int, float]]:
    return [(int(s), int(w), int(a), float(t)) for s, w, a, t in LINE.findall(job.stdout())]


def _wait(predicate, jobs, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise DistributedTestError(f"{what} did not happen within {timeout:g}s\n" + "\n".join(
                f"--- agent {i} ---\n" + "\n".join(re.findall(r"ELASTIC [^\n]*|\S*torch/distributed/elastic/[^\n]*",
                                                             job.output())[-30:]) + "\n" + job.output()[-2000:]
                for i, job in enumerate(jobs)))
        time.sleep(0.1)


def run(steps: int = 60, kill_after: int = 10, strategy: str = "ddp", timeout: float = 240.0,
        grow: bool = False, records: str | None = None, step_seconds: float = 0.2,
        devices: tuple[str, str] = ("", ""), job_class: type[TorchrunJob] = TorchrunJob) -> dict:
    """Run the scenario (a job of `steps` global batches, one epoch); return ``{"recovery_s", "kill_step",
    "resumed_step", "final_step", "steps_lost", "after_kill_s"}`` (the survivor's worker events after the
    kill), and with `grow` (a third agent starts once the job runs at world 2) ``"grow_s"`` (from its start
    to the first step at world 4) and ``"grown_step"``; ``"killed_at"`` and ``"joined_at"`` (unix times).
    With `records` (a directory) every worker writes what it trained there after each step (see
    `elastic_job`; read them with `read_records`). `devices`: the GPUs (``CUDA_VISIBLE_DEVICES``) of the
    surviving agent and of the killed one (the joining agent takes the killed one's); empty: CPU and gloo,
    else each agent's 2 workers use its 2 GPUs and NCCL. `job_class`: how an agent (a torchrun launcher) is
    started: a `TorchrunJob` (a fresh interpreter), or one taking the same arguments (the tests' launcher
    forked from a warm interpreter, `tests/_forked_torchrun.py`); its workers are torchrun's own either way."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=timedelta(seconds=60))
    ckpt = tempfile.mkdtemp(prefix="dt-elastic-")
    run_id = uuid.uuid4().hex[:8]
    # While a new node is on its way, the job must not end its epoch at world 2 first (a slow machine):
    # it holds before its last steps while this file exists (a SIGTERM from its agent ends the hold).
    hold = ckpt.rstrip("/") + ".hold"
    agent = lambda devices: _agent(store.port, run_id, ckpt, steps, strategy, grow, records,  # noqa: E731
                                   step_seconds, hold if grow else None, devices, job_class)
    survivor = agent(devices[0])
    victim = agent(devices[1])
    jobs = [survivor, victim]  # and the joining agent
    try:
        _wait(lambda: any(w == 4 and s >= kill_after for s, w, _, _ in _steps(survivor)), jobs, timeout / 2,
              f"step {kill_after} at world 4")
        kill_step = max(s for s, *_ in _steps(survivor))
        killed_at = time.time()
        victim.kill()  # the agent, its workers and theirs: SIGKILL
        _wait(lambda: any(w == 2 and t > killed_at for _, w, _, t in _steps(survivor)), jobs, timeout / 2,
              "a step at world 2 after the kill")
        resumed = min((t, s) for s, w, _, t in _steps(survivor) if w == 2 and t > killed_at)
        events = [(name, float(t) - killed_at) for name, t in EVENT.findall(survivor.stdout()) if float(t) > killed_at]
        grown = None
        if grow:  # a node joins again: the survivor's agent sees it waiting and restarts its workers at world 4
            Path(hold).touch()
            joined_at = time.time()
            jobs.append(agent(devices[1]))  # on the killed node's GPUs
            _wait(lambda: any(w == 4 and t > joined_at for _, w, _, t in _steps(survivor)), jobs, timeout / 2,
                  "a step at world 4 after the new agent started")
            grown = min((t, s) for s, w, _, t in _steps(survivor) if w == 4 and t > joined_at)
            os.unlink(hold)
        out = survivor.wait(timeout)
        if out.returncode != 0:
            raise DistributedTestError(f"the surviving agent failed ({out.returncode}):\n{survivor.output()[-4000:]}")
        final = max(s for s, *_ in _steps(survivor))
        return {"recovery_s": resumed[0] - killed_at, "kill_step": kill_step, "resumed_step": resumed[1],
                "final_step": final, "steps_lost": kill_step - (resumed[1] - 1),
                "after_kill_s": {name: round(t, 2) for name, t in events},
                "killed_at": killed_at, "held": HELD.findall(survivor.stdout()),
                **({"grow_s": grown[0] - joined_at, "grown_step": grown[1], "joined_at": joined_at} if grown else {}),
                "log": survivor.output()}
    finally:
        for job in jobs:
            job.close()
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
        if os.path.exists(hold):
            os.unlink(hold)


def read_records(directory: str) -> list[dict]:
    """Every complete record the workers wrote (a worker killed mid-write leaves only a ``*.tmp``),
    oldest first."""
    import torch

    return sorted((torch.load(path, weights_only=False) for path in Path(directory).glob("*.pt")),
                  key=lambda r: r["time"])


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--grow", action="store_true", help="start a new agent once the job runs at world 2")
    p.add_argument("--records", default=None, help="a directory for the workers' per-step records")
    p.add_argument("--step-seconds", type=float, default=0.2)
    a = p.parse_args()
    result = run(a.steps, strategy=a.strategy, grow=a.grow, records=a.records, step_seconds=a.step_seconds)
    log = result.pop("log")
    if os.environ.get("ELASTIC_VERBOSE"):
        print(log)
    print(result)

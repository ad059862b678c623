"""Helpers shared by the benchmark suite's tests (`test_benchmarks.py`, `test_benchmarks_worlds.py`): run
`benchmarks/suite.py --smoke` in a subprocess, and the checks of the parameter server's recommender."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "benchmarks" / "suite.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}


def _suite(tmp_path, *args, timeout, warm_python=None, fork=True):
    """``suite.py --smoke --out TMP_PATH *args``; its orchestrator forked from `warm_python` (the conftest
    fixture: torch and the package imported once) when given, else a fresh interpreter. With `fork` (and
    `warm_python`) the world jobs' ranks are forked from the orchestrator (DT_SUITE_FORK_WORKERS=1,
    `suite._fork_group`: the same ranks, torchrun's variables, arguments and phases, without each rank and
    launcher importing torch afresh, ~3 s of CPU a process); without, they are the fresh python / torchrun
    processes a GPU run starts (one test keeps that path covered)."""
    argv = [str(SUITE), "--smoke", "--out", str(tmp_path), *args]
    if warm_python is not None:
        env = {**ENV, "DT_SUITE_FORK_WORKERS": "1"} if fork else ENV
        out = warm_python(argv, cwd=REPO, env=env, timeout=timeout)
    else:
        out = subprocess.run([sys.executable, *argv], cwd=REPO, env=ENV, capture_output=True, text=True,
                             timeout=timeout)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    return json.loads((tmp_path / "results.json").read_text())


def _check_ps_recommender(rec, world):
    """The ps phase's recommender at `world`: DDP and sync PS with 1 .. min(4, world - 1) servers, from the
    same weights on the same batches; the PS moves only touched rows (fewer bytes than DDP's gradient), every
    server count makes the same updates (the same loss at every step), every variant reaches the target."""
    variants = rec["variants"]
    assert list(variants) == ["ddp"] + [f"ps_s{s}" for s in range(1, min(4, world - 1) + 1)]
    assert all(rec["global_batch"] % v["workers"] == 0 for v in variants.values())
    ddp = variants["ddp"]
    assert ddp["workers"] == world and ddp["gradient_bytes_per_step"] == 4 * ddp["params"]
    assert rec["bayes_loss"] < rec["target_loss"] < rec["initial_loss"], rec
    for name, v in variants.items():
        assert v["finite"] and v["step_ms_median"] > 0 and v["reached"] and v["time_to_loss_s"] > 0, (name, v)
        assert v["final_loss_ema"] < rec["initial_loss"] - 0.02, (name, v["final_loss_ema"])  # it learns
        if name == "ddp":
            continue
        assert v["servers"] + v["workers"] == world and len(v["server_bytes_per_step"]) == v["servers"]
        assert 0 < v["bytes_per_step_per_worker"] < ddp["gradient_bytes_per_step"] and v["bytes_vs_ddp"] < 1, v
        assert v["push_bytes_per_step"] > 0 and v["pull_bytes_per_step"] > 0 and v["index_bytes_per_step"] > 0
        assert v["max_staleness"] == 0 and v["updates"] == [rec["steps"]] * v["servers"]  # sync: one update a step
        assert v["server_max_over_mean"] >= 1 and v["plan_max_over_mean"] >= 1
        assert v["max_loss_diff_vs_ps_s1"] < 1e-5, (name, v["max_loss_diff_vs_ps_s1"])
        assert v["max_loss_diff_vs_ddp"] < 0.05  # lazy vs dense Adam on the tables: close, not equal

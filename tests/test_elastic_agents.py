"""The two-node elastic harness (issue 17, items 1 and 6, first step): two torchrun agents on one host
(``--nnodes=1:2``, 2 workers each); one agent is killed with its workers mid-run, and the other
restarts its workers, re-forms the job at world 2 and finishes from the latest good checkpoint. The
scenario is `tests/jobs/elastic_two_agents.py` (also a script); it prints the time from the kill to the
next completed step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _scenario():
    spec = importlib.util.spec_from_file_location("elastic_two_agents", REPO / "tests" / "jobs" / "elastic_two_agents.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["zero3"])  # DDP's shrink is the first half of the growth test below
def test_killed_agent_leaves_the_other_to_finish_alone(strategy):
    result = _scenario().run(steps=40, kill_after=10, strategy=strategy, timeout=240)
    log = result.pop("log")
    print(f"{strategy}: {result}")
    assert "PeerFailureError" in log and "is dead" in log, log[-4000:]  # named, not a gloo error alone
    assert result["final_step"] == 40, log[-4000:]
    # Checkpoints every step: the resumed job redoes at most the step in flight and the one being saved.
    assert result["steps_lost"] <= 2, result
    assert result["recovery_s"] < 60, result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_new_agent_grows_the_job_back():
    # The workers' own store per round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): with torch 2.13's shared
    # store, a node that stays the rendezvous' rank 0 across rounds does not publish MASTER_ADDR again,
    # and a joining node waits for it forever (observed here; `RendezvousStoreInfo.build` is skipped).
    result = _scenario().run(steps=60, kill_after=10, strategy="ddp", timeout=240, grow=True)
    log = result.pop("log")
    print(f"shrink then grow: {result}")
    assert result["final_step"] == 60, log[-4000:]
    assert result["steps_lost"] <= 2 and result["recovery_s"] < 60, result
    assert result["grown_step"] > result["resumed_step"] and result["grow_s"] < 60, result

"""A parameter-server worker killed in the middle of the trainer's `fit` (issue 19, item 4).

1 server x 3 workers, `DistributedTrainer(strategy="parameter_server")` with the default peer watch
(`heartbeat_timeout=5`) and an evaluation every 2 steps. One worker SIGKILLs itself from its loss
function in step 6 (after 5 steps pushed):

* ssp (s = 2) and async: the surviving workers' and the server's `fit` return after every step; the
  server's stats show the drop (the victim at step 5); every surviving rank ends with the same model,
  the server's final values (compared bit for bit); `evaluate` after `fit` works on every rank; the
  workers left learn the drop (`strategy.dropped`). With worker 0 (the job's main rank) as the victim,
  worker 1 becomes the main rank (`full_state_dict` is its).
* sync: the server and the surviving workers raise `WorkerLostError` naming the victim within seconds.

And a SIGTERM to every rank under ssp stops the run cleanly: the workers stop at their step, the server
serves until they have left, every rank ends with the same model and exits with status 143.

The killed rank makes `run_distributed` fail (it ends without reporting), so each surviving rank writes
what it saw to a file (`write_record`), and the test checks that the killed rank is the only failure.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.nn.functional as F

from distributed_training.testing import DistributedTestError, run_distributed, write_record
from test_parameter_server_trainer import _Data, _model  # the same model and data as the fit tests
from test_ps_faults import survivors_records

KILL_AT = 5  # optimizer steps the victim has pushed when it dies
EPOCHS = 3
SAMPLES, BATCH, WORKERS = 48, 4, 3
STEPS = SAMPLES // (BATCH * WORKERS) * EPOCHS  # 12 per worker


def _state(trainer) -> list[list[float]]:
    return [v.detach().reshape(-1).tolist() for v in trainer.module.state_dict().values()]


def _killed_fit_job(rank, world, directory, consistency, staleness, victim, at_checkpoint=False):
    from distributed_training import DistributedTrainer
    from distributed_training.ps import WorkerLostError

    checkpoints = dict(checkpoint_dir=os.path.join(directory, "ck"), checkpoint_every=KILL_AT) if at_checkpoint else {}
    trainer = DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                 strategy="parameter_server", num_servers=1, consistency=consistency,
                                 staleness=staleness, **checkpoints)
    strategy = trainer.strategy
    worker = None if not strategy.trains else trainer.dp_rank
    if at_checkpoint and worker == victim:  # dies after pushing step 5, as the checkpoint starts
        def save_and_die(*args, **kwargs):
            with open(os.path.join(directory, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        strategy.save_checkpoint_files = save_and_die

    def criterion(outputs, targets):
        if worker == victim and trainer.step == KILL_AT and trainer.module.training:
            with open(os.path.join(directory, "killed_at"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        if worker is not None and worker != victim and trainer.step < KILL_AT + 2:
            time.sleep(0.02)  # the survivors are a little slower: the victim dies with steps of its own ahead
        return F.cross_entropy(outputs, targets)

    role = "worker" if strategy.trains else "server"
    try:
        history = trainer.fit(_Data(), epochs=EPOCHS, criterion=criterion, batch_size=BATCH, eval_dataset=_Data(16),
                              eval_every=2)
    except WorkerLostError as err:
        write_record(directory, rank, role=role, lost=err.worker, step=err.step, message=str(err), at=time.time(),
                     error=type(err).__name__)
        trainer.close(barrier=False)
        return
    stats = strategy.last_stats
    record = {
        "role": role, "steps": trainer.step, "epochs": len(history), "state": _state(trainer),
        "evaluated": trainer.evaluate(_Data(16), F.cross_entropy, batch_size=5)["loss"],
        "main": trainer.context.is_main, "full": bool(trainer.full_state_dict()),
        "dropped": [list(d) for d in stats.dropped] if stats is not None else strategy.dropped,
        "updates": stats.updates if stats is not None else None,
        "evaluations": len(trainer.evaluation.history),
    }
    write_record(directory, rank, **record)
    trainer.close()


def _run(tmp_path, consistency, staleness, victim, at_checkpoint=False):
    world = 1 + WORKERS
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_killed_fit_job, world, args=(str(tmp_path), consistency, staleness, victim, at_checkpoint),
                        timeout=90, collective_timeout=60)
    return survivors_records(info.value, world, 1 + victim, tmp_path)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("consistency,staleness,victim", [("async", 0, 1), ("ssp", 2, 1), ("ssp", 2, 0)])
def test_a_worker_killed_in_fit_is_dropped_and_the_others_finish(tmp_path, consistency, staleness, victim):
    records, _ = _run(tmp_path, consistency, staleness, victim)
    server, workers = records[0], {r - 1: rec for r, rec in records.items() if r}
    assert server["role"] == "server" and sorted(workers) == [w for w in range(WORKERS) if w != victim]
    assert server["dropped"] == [[victim, KILL_AT]]  # the victim, with its 5 steps pushed
    assert server["updates"] == STEPS * (WORKERS - 1) + KILL_AT  # one update per gradient applied
    for w, r in workers.items():
        assert r["steps"] == STEPS and r["epochs"] == EPOCHS, r  # every step of the survivors
        assert r["dropped"] == [victim]  # they learn it at the end of fit
        assert r["evaluations"] == STEPS // 2  # every 2 steps, each worker on the whole set, alone
    for r in records.values():  # the same final model on every surviving rank, the server included
        assert r["state"] == server["state"]
        assert r["evaluated"] == server["evaluated"]  # evaluate after fit: the same model, the whole set
    first = min(workers)  # the job's main rank: worker 0, or the lowest worker left
    assert [w for w, r in workers.items() if r["main"]] == [first]
    assert [w for w, r in workers.items() if r["full"]] == [first]
    assert not server["main"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("at_checkpoint", [False, True])
def test_sync_a_worker_killed_in_fit_is_an_error_naming_it(tmp_path, at_checkpoint):
    # At a checkpoint step the workers' all-gather of their file digests met the dead worker first: the
    # survivors said PeerFailureError after the heartbeat timeout (the server: WorkerLostError).
    records, killed_at = _run(tmp_path, "sync", 0, 1, at_checkpoint)
    assert len(records) == WORKERS
    for rank, r in records.items():
        assert r["error"] == "WorkerLostError" and r["lost"] == 1, r
        assert "worker 1 (rank 2)" in r["message"], r["message"]
        elapsed = r["at"] - killed_at
        print(f"rank {rank} ({r['role']}): WorkerLostError {elapsed:.2f}s after the SIGKILL")
        assert elapsed < 10, elapsed  # the peer watch's verdict is not awaited; the collective timeout is 60 s


# ------------------------------------------------------------------ SIGTERM
def _sigterm_job(rank, world, directory, server_only=False):
    """ssp: SIGTERM to every rank, each worker at a step of its own (as torchrun would send it).
    `server_only`: sync with checkpoints, SIGTERM to the server alone at worker 0's step 3 (a preempted
    server pod)."""
    from distributed_training import DistributedTrainer

    if rank == 0:
        with open(os.path.join(directory, "server.pid"), "w") as f:
            f.write(str(os.getpid()))
    options = (dict(consistency="sync", checkpoint_dir=os.path.join(directory, "ck")) if server_only
               else dict(consistency="ssp", staleness=2))
    trainer = DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="parameter_server",
                                 num_servers=1, **options)
    stop_at = 3 + (trainer.dp_rank if trainer.strategy.trains and not server_only else 0)

    def on_step(step, metrics):
        if step == stop_at:
            if trainer.dp_rank == 0:
                with open(os.path.join(directory, "server.pid")) as f:
                    os.kill(int(f.read()), signal.SIGTERM)
            if not server_only:
                os.kill(os.getpid(), signal.SIGTERM)

    code = None
    try:
        trainer.fit(_Data(), epochs=EPOCHS, criterion=F.cross_entropy, batch_size=BATCH, log_every=1, on_step=on_step)
    except SystemExit as err:
        code = err.code
    result = {"code": code, "steps": trainer.step, "state": _state(trainer)}
    trainer.close()
    return result


@pytest.mark.timeout(120)
def test_sigterm_stops_an_ssp_fit_cleanly(tmp_path):
    results = run_distributed(_sigterm_job, 1 + WORKERS, (str(tmp_path),), timeout=90)
    assert [r["code"] for r in results] == [143] * (1 + WORKERS), results  # every rank, the server included
    # each worker at the step it got the signal, or earlier: when the server's replies said it got one
    assert all(1 <= r["steps"] <= 3 + w for w, r in enumerate(results[1:])), [r["steps"] for r in results]
    for r in results:
        assert r["state"] == results[0]["state"]


@pytest.mark.timeout(120)
def test_sigterm_to_a_sync_server_stops_the_workers_with_a_checkpoint(tmp_path):
    """The workers never heard of it: they trained to the end (step 12) while the signalled server waited, so
    a preempted server pod outlived its grace period. Now its replies tell them; they stop together, save."""
    results = run_distributed(_sigterm_job, 1 + WORKERS, (str(tmp_path), True), timeout=90)
    steps = {r["steps"] for r in results[1:]}
    assert [r["code"] for r in results] == [143] * (1 + WORKERS), results
    assert len(steps) == 1 and 3 <= min(steps) < STEPS, results  # every worker at one step, before the end
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith("step_"))
    assert saved and int(saved[-1].split("_")[1]) == min(steps), saved
    for r in results:
        assert r["state"] == results[0]["state"]

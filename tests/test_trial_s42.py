"""Session 42: hardening from the session's trials and the ROADMAP's open points."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from distributed_training.testing import run_distributed


def _chain():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def resumed_fit_worker(rank, world, directory, fits):
    """Each of `fits` (keyword arguments of `fit`, with ``derived``: what a job derived its epochs from)
    trains a new trainer on `directory`'s checkpoints; returns what rank 0 logged."""
    import logging

    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    g = torch.Generator().manual_seed(2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g))
    said = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("distributed_training").addHandler(Keep())
    for fit in fits:
        fit = dict(fit)
        trainer = DistributedTrainer(_chain(), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                     checkpoint_dir=directory, checkpoint_every=1)
        if "derived" in fit:
            trainer._fit_derived["epochs"] = fit.pop("derived")  # as dtrain does
        trainer.fit(data, criterion=F.mse_loss, **fit)
        trainer.close()
    return said


def _changes(said: list[str]) -> list[str]:
    return [m for m in said if "the configuration changed since checkpoint" in m]


def test_a_resume_at_another_world_size_says_its_global_batch_changed(tmp_path):
    # fit(batch_size=...) is per replica: resumed at another world size, the global batch changed without a word
    # (session 41's "Left"). With global_batch_size it is kept (and fit says how it is cut), not said here.
    ckpt = str(tmp_path / "ckpt")
    run_distributed(resumed_fit_worker, 2, args=(ckpt, [dict(batch_size=4, max_steps=2)]), timeout=90)
    said = run_distributed(resumed_fit_worker, 1, args=(ckpt, [dict(batch_size=4, max_steps=3)]), timeout=90)[0]
    changed = _changes(said)
    assert len(changed) == 1 and ("data-parallel replicas: 2 -> 1, so the global batch changed (2 x 4 = 8 samples "
                                  "-> 1 x 4 = 4)") in changed[0] and "max_steps: 2 -> 3" in changed[0], said
    # and with another batch size too, the new global batch is the new size's (session 47: it said 2 x 4 = 8)
    said = run_distributed(resumed_fit_worker, 2, args=(ckpt, [dict(batch_size=8, max_steps=4)]), timeout=90)[0]
    changed = _changes(said)
    assert len(changed) == 1 and "(1 x 4 = 4 samples -> 2 x 8 = 16)" in changed[0], said

    kept = str(tmp_path / "kept")
    run_distributed(resumed_fit_worker, 2, args=(kept, [dict(global_batch_size=8, max_steps=2)]), timeout=90)
    said = run_distributed(resumed_fit_worker, 1, args=(kept, [dict(global_batch_size=8, max_steps=3)]), timeout=90)[0]
    assert not any("data-parallel replicas" in m for m in said) and _changes(said), said


def test_a_limit_a_job_derived_is_said_as_derived_when_it_changes_on_resume(tmp_path):
    # dtrain derives its epochs from training.max_steps; a resume whose epochs were not derived said
    # "epochs: 3 -> 1", a 3 the user never wrote.
    fits = [dict(batch_size=8, epochs=3, max_steps=2, derived="derived from training.max_steps"),
            dict(batch_size=8, epochs=1, max_steps=3)]
    said = run_distributed(resumed_fit_worker, 1, args=(str(tmp_path / "ckpt"), fits), timeout=90)[0]
    changed = _changes(said)
    assert len(changed) == 1 and "epochs: 3 (derived from training.max_steps) -> 1" in changed[0], said


KILLED_SERVER = '''
import os, signal, sys, threading, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
from distributed_training.ps import ParameterServer

rank, world, init, consistency, flag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
torch.manual_seed(0)
model = nn.Linear(8, 1)
ps = ParameterServer(model, "sgd", lr=0.1, num_servers=2, consistency=consistency)
if ps.role == "server":
    if rank == 0:  # dies once a worker has reached step 5
        def die():
            while not os.path.exists(flag):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    ps.serve()
else:
    for step in range(10000):
        if step == 5:
            open(flag, "a").close()
        ps.pull()
        x = torch.randn(16, 8)
        F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        ps.step()
        model.zero_grad()
        time.sleep(0.005)
    ps.close()
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("consistency", ["sync", "async"])
def test_a_killed_server_is_named_by_every_worker_which_exits_as_a_script_that_raised(tmp_path, consistency):
    # A server killed mid-run: the workers raised gloo's own text ("Read error ... Connection reset by peer"),
    # naming no server, with their receives from the other server left blocked in gloo (a trial saw such
    # workers abort at the interpreter's exit, and once hang). Each is a fresh interpreter: an abort shows at
    # a real exit only.
    script = tmp_path / "job.py"
    script.write_text(KILLED_SERVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), "4", init, consistency, str(tmp_path / "flag")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env) for rank in range(4)]
    try:
        outs = [p.communicate(timeout=120)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == -9, outs[0][-2000:]
    for rank in (2, 3):
        out = outs[rank]
        assert "terminate called" not in out and procs[rank].returncode == 1, f"rank {rank}:\n{out[-3000:]}"
        said = [line for line in out.splitlines() if "ServerLostError: parameter server:" in line]
        assert said and "server 0 (rank 0) is lost at step" in said[-1] and "GLHF" not in said[-1], out[-3000:]
    assert "terminate called" not in outs[1] and procs[1].returncode is not None, outs[1][-3000:]


def later_stage_worker(rank, world, reshape):
    import torch.nn.functional as F

    from _tp_models import HFGPT2
    from distributed_training.tensor import apply_plan

    torch.manual_seed(0)
    full = HFGPT2(vocab=64)
    t = full.transformer
    plan = {"transformer.h.*.attn.c_attn": ("colwise", 3), "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise",
            "transformer.drop": "sequence_split", "transformer.h.*.ln_*": "sequence", "transformer.ln_f": "sequence",
            "transformer.wte": "vocab", "lm_head": "vocab"}
    apply_plan(full, plan, sequence_parallel=True)  # the whole model, as before a pipeline cuts it
    for block in t.h:
        block.attn.num_heads //= world
        block.attn.split_size //= world
        block.attn.embed_dim //= world

    def last_stage(x: torch.Tensor) -> torch.Tensor:  # a pipeline's last stage of HFGPT2: no 'drop' runs here
        for block in t.h:
            x = block(x)
        x = t.ln_f(x)
        return full.lm_head(x.view(-1, 8, x.size(-1)) if reshape else x)  # GPT2Model's view after ln_f

    part = torch.randn(4, 8 // world, 32, generator=torch.Generator().manual_seed(1 + rank))  # what it receives
    try:
        F.mse_loss(last_stage(part), torch.zeros(()))
        return "passed"
    except RuntimeError as err:
        return str(err)


def test_sequence_parallelism_refuses_a_reshape_on_a_pipelines_later_stage():
    # The check of a column-parallel layer's input against the whole sequence's length had that length only
    # where the region began (the 'sequence_split' module): a pipeline's later stage, which receives its part,
    # reshaped unchecked (session 41's "Left"). The stage's input gives the length there.
    for said in run_distributed(later_stage_worker, 2, args=(True,), timeout=90):
        assert "the whole sequence (8) along dimension 1, where this rank's part of it was expected" in said, said
    assert run_distributed(later_stage_worker, 2, args=(False,), timeout=90) == ["passed", "passed"]


def deepcopy_worker(rank, world, strategy):
    import copy

    import torch.nn.functional as F
    from torch import nn

    from distributed_training import DistributedTrainer

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    def build():
        torch.manual_seed(0)
        return nn.Sequential(Block(), Block(), Block(), nn.Linear(8, 2))  # a unit per block under ZeRO-3

    trainer = DistributedTrainer(build(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy, progress=False)
    said = []
    for what in ("module", "model"):
        try:
            copy.deepcopy(getattr(trainer, what))
            said.append(f"{what}: copied")
        except RuntimeError as err:
            said.append(f"{what}: {err}")
    g = torch.Generator().manual_seed(rank)
    trainer.train_step((torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)), F.mse_loss)
    with trainer.summon_full_params():
        ema = copy.deepcopy(trainer.module)  # every rank
    full = trainer.full_state_dict()
    x = torch.randn(3, 8, generator=g)
    if rank == 0:  # the copy alone, on one rank: its own parameters, none of the wrapper's hooks (a gather)
        reference = build()
        reference.load_state_dict(full)
        said.append(float((ema(x) - reference(x)).abs().max()))
        ema(x).sum().backward()
        said.append(all(p.grad is not None for p in ema.parameters()) and not ema._forward_pre_hooks)
    trainer.train_step((torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)), F.mse_loss)
    trainer.close()
    return said


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_deepcopy_of_a_sharded_model_is_refused_by_name_and_works_inside_summon_full_params(strategy):
    # copy.deepcopy (an EMA copy) of a model under ZeRO-2/3 raised torch's "Only Tensors created explicitly by
    # the user (graph leaves) support the deepcopy protocol" (session 39's "Left"); a copy made inside
    # summon_full_params() kept the wrapper's hooks, which gathered the original's units from the copy's forward.
    said = run_distributed(deepcopy_worker, 2, args=(strategy,), timeout=120)
    for rank_said in said:
        for line in rank_said[:2]:
            assert "holds parameters sharded by FSDP (ZeRO-2/3)" in line and "summon_full_params()" in line, line
    assert said[0][2] == 0.0 and said[0][3] is True, said[0]


def test_a_preemption_during_the_final_outputs_waits_for_them(tmp_path):
    # dtrain's final evaluation and outputs ran after fit, outside its signal handling: a SIGTERM there ended the
    # process at once (status 143, no word), the model file was never written, and the restart called the run
    # complete (a trial; the restart now writes them: tests/test_cli.py's complete-run test).
    import signal
    import time

    from distributed_training.stopping import finishing

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL), signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with finishing("the final evaluation and the outputs") as held:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGHUP)  # ignored (nohup): stays ignored
            time.sleep(0.2)  # the handler has run by now (the main thread, between bytecodes)
            (tmp_path / "model.pt").write_text("written")
        assert held == [signal.SIGTERM] and (tmp_path / "model.pt").read_text() == "written"
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before[0])
        signal.signal(signal.SIGHUP, before[1])


def torchrun_second_press_worker(rank, world, record, torchrun):
    import signal

    import torch.nn.functional as F

    from _failures import record_outcome
    from distributed_training import DistributedTrainer
    from test_trial_s41 import _PeerStalls  # SIGINT, then SIGTERM: torchrun's answer to a second press

    signal.signal(signal.SIGINT, signal.default_int_handler)
    trainer = DistributedTrainer(_chain(), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    if torchrun:  # (after the group is formed: torchrun's variable, which the signal handling reads)
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
    record_outcome(record, rank, lambda: trainer.fit(_PeerStalls(signal.SIGTERM), epochs=1, batch_size=4,
                                                     shuffle=False, criterion=F.mse_loss))
    trainer.close(barrier=False)


@pytest.mark.parametrize("torchrun", [True, False], ids=["torchrun", "elsewhere"])
def test_under_torchrun_a_second_ctrl_c_ends_a_stuck_worker_at_once(tmp_path, torchrun):
    # Under torchrun a Ctrl-C reaches torchrun, which forwards SIGINT to its workers; a second press makes it
    # send SIGTERM and SIGKILL 30 s later. The SIGTERM was taken as a preemption (stop at the step boundary and
    # save): a worker stuck in a long step stayed until the SIGKILL (a trial: 33 s after the second press). A
    # SIGTERM after a first Ctrl-C is a second press there now: the stuck rank ends at once (130). Elsewhere a
    # SIGTERM after a SIGINT is a scheduler's escalation (LSF), which stops at the step boundary as before.
    from _failures import failure_report

    report = failure_report(torchrun_second_press_worker, 2, args=(str(tmp_path / "said"), torchrun), timeout=90)
    if torchrun:
        assert "--- rank 0 failed ---\nprocess exited with code 130" in report, report
        assert not (tmp_path / "said.0").exists()  # (it never got out of the collective on its own)
    else:
        assert "exited with code 130" not in report and (tmp_path / "said.0").exists(), report


def tensor_summon_worker(rank, world, strategy):
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    model = GPT(cfg)
    reference = GPT(cfg)
    reference.load_state_dict(model.state_dict())
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy,
                                 tensor_parallel_size=2, progress=False)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with trainer.summon_full_params():  # every rank: each holds its slices, the forward is tensor-parallel
        loss = float(trainer.module(idx, idx))  # (GPT returns the mean loss given targets)
    with torch.no_grad():
        want = float(reference(idx, idx))
    trainer.close()
    return loss, want


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_summon_full_params_under_tensor_parallelism(strategy):
    # The README's block for a forward of one's own, "under any strategy", raised TypeError under tensor
    # parallelism (its strategy did not take `writeback`; a trial).
    for loss, want in run_distributed(tensor_summon_worker, 2, args=(strategy,), timeout=120):
        assert abs(loss - want) < 1e-5, (loss, want)


def missing_checkpoint_worker(rank, world, path):
    from distributed_training import DistributedTrainer

    trainer = DistributedTrainer(_chain(), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    try:
        trainer.load_checkpoint(path)
        return "loaded"
    except FileNotFoundError as err:
        return str(err)
    finally:
        trainer.close()


def test_a_missing_checkpoint_names_the_rank_once(tmp_path):
    # "failed on ranks 0, 1 (...); rank 0: rank 0: '.../meta.pt' does not exist" (a trial).
    for said in run_distributed(missing_checkpoint_worker, 2, args=(str(tmp_path / "nothing"),), timeout=90):
        assert "failed on ranks 0, 1" in said and "rank 0: rank 0" not in said and "meta.pt' does not exist" in said, said


def test_a_preset_of_another_dataset_names_what_was_written():
    # "model.preset 'classifier' goes with data.dataset 'digits', ..." for preset 'tiny' with 'digits': the
    # rule, but not the value given, which read as if 'classifier' had been written (a trial).
    from distributed_training.config import ConfigError, JobConfig

    with pytest.raises((ConfigError, ValueError)) as caught:
        JobConfig.model_validate({"model": {"preset": "tiny"}, "data": {"dataset": "digits"}})
    said = str(caught.value)
    assert "model.preset 'tiny' does not go with data.dataset 'digits'" in said and "'repo_text'" in said, said


def slow_server_worker(rank, world):
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from distributed_training.ps import ServerLostError
    from distributed_training.ps.protocol import process_group, recv_reply
    from distributed_training.ps.worker import Worker

    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 0:  # the server: alive, answering nothing for longer than the group's timeout
        time.sleep(5)
        return "server"
    pg = process_group(group)
    works, _, _ = recv_reply(pg, 0, 0)
    me = SimpleNamespace(plan=SimpleNamespace(num_servers=1), step=3, index=0, pg=pg, _closed=False)
    try:
        Worker._wait(me, [(0, w) for w in works], "pull")
        return "answered"
    except ServerLostError as err:
        return f"ServerLostError: {err}"
    except RuntimeError as err:
        return f"RuntimeError: {err}"


def test_a_slow_server_is_a_timeout_not_a_lost_server():
    # The review: every failed wait was taken for a lost server, gloo's timeout too (a server waiting for the
    # slowest worker under ssp, or for every worker at FINAL / DONE), which then said "its connection closed".
    said = run_distributed(slow_server_worker, 2, timeout=90)[1]
    assert said.startswith("RuntimeError: ") and "ServerLostError" not in said and "imed out" in said, said

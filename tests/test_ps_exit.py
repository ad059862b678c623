"""A script of one's own (the core API, plain processes) whose server raises `WorkerLostError` exits cleanly.

Under ``sync`` worker 1 SIGKILLs itself at step 5. The server raises `WorkerLostError`, uncaught, and its
process must end as any Python script that raised: exit status 1 with the error's message, not an abort
at the interpreter's exit ("terminate called without an active exception", SIGABRT). That abort came from
the server's thread reading a surviving worker, left blocked in a gloo receive when the interpreter
finalized. The survivors now send a LEAVE before they raise, and the server waits for its threads; a
survivor that says nothing (here: one whose LEAVE is switched off, and that lingers after its error)
has the server close its connections after `LEAVE_GRACE` seconds (shortened to 1 s in that case: the test is
about the grace running out, not its length; the mute survivor stays alive until every server has exited, so
that its connection cannot close by itself before, and a server left waiting for it is a hang, not a pass).

Each rank that exits by itself is a fresh interpreter (`subprocess`, ``file://`` rendezvous), not a forked
test child: the abort only shows at a real interpreter exit. The victim, which SIGKILLs itself and never
reaches an exit, is forked from the warm_python server (no torch import to pay for it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

SCRIPT = '''
import os, signal, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from torch import nn
from distributed_training.ps import ParameterServer

rank, world, init, num_servers, mute = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
release = sys.argv[6]  # made by the test once every server has exited
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
if mute == "1":  # a survivor that never sends LEAVE, as if hung after its error
    import distributed_training.ps.server as server
    from distributed_training.ps.worker import Worker
    Worker._leave = lambda self: None
    server.LEAVE_GRACE = 1.0  # (5 s by default) the grace runs out all the same: nothing comes
torch.manual_seed(0)
model = nn.Linear(8, 1)
ps = ParameterServer(model, "sgd", lr=0.1, num_servers=num_servers, consistency="sync")
if ps.role == "server":
    ps.serve()
else:
    try:
        for step in range(30):
            if ps.worker_index == 1 and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            ps.pull()
            x = torch.randn(16, 8)
            F.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
            ps.step()
            model.zero_grad()
        ps.close()
    except Exception:
        if mute == "1":  # alive until the servers have exited: its connection does not close by itself
            deadline = time.monotonic() + 60
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.05)
        raise
dist.destroy_process_group()
'''


def _launch(tmp_path, num_servers: int, mute: bool, warm_python) -> list[tuple[int, str]]:
    """Run the script on ``num_servers + 2`` processes; their (exit status, output). Every rank that exits by
    itself is a fresh interpreter; the victim (the last rank), which SIGKILLs itself and so never reaches an
    interpreter's exit, is forked from the warm_python server (torch imported) and waited for in a thread."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    world = num_servers + 2
    victim = world - 1
    init = f"file://{tmp_path / 'rendezvous'}"
    release = tmp_path / "servers_exited"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("RANK", None)
    argv = lambda rank: [str(script), str(rank), str(world), init, str(num_servers), "1" if mute else "0",  # noqa: E731
                         str(release)]
    victim_run: dict = {}

    def run_victim():
        try:
            victim_run["done"] = warm_python(argv(victim), env=env, timeout=90)
        except subprocess.TimeoutExpired as err:
            victim_run["hung"] = err

    thread = threading.Thread(target=run_victim, name="victim", daemon=True)
    thread.start()
    procs = []
    for rank in range(victim):
        out = open(tmp_path / f"rank{rank}.log", "wb")
        procs.append((subprocess.Popen([sys.executable, *argv(rank)], stdout=out, stderr=subprocess.STDOUT, env=env),
                      out))
    results = []
    try:
        for rank, (proc, out) in enumerate(procs):
            try:
                code = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                code = "hung"
            out.close()
            results.append((code, (tmp_path / f"rank{rank}.log").read_text(errors="replace")))
            if rank == num_servers - 1:  # the servers (the first ranks) are done: a lingering worker may go
                release.touch()
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        thread.join(120)
    done = victim_run.get("done")
    results.append((done.returncode, done.stdout + done.stderr) if done is not None else ("hung", str(victim_run)))
    return results


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGKILL, file:// rendezvous")
@pytest.mark.timeout(150)
@pytest.mark.parametrize("num_servers,mute", [(1, False), (2, False), (1, True)], ids=["1-server", "2-servers", "mute"])
def test_a_server_that_raises_worker_lost_exits_normally(tmp_path, num_servers, mute, warm_python):
    results = _launch(tmp_path, num_servers, mute, warm_python)
    victim = num_servers + 1
    assert results[victim][0] == -9, results[victim]
    for rank, (code, out) in enumerate(results):
        if rank == victim:
            continue
        assert "terminate called" not in out, f"rank {rank}:\n{out[-3000:]}"
        assert code == 1, f"rank {rank} exited with {code}:\n{out[-3000:]}"  # as a script that raised, not -6
        message = [line for line in out.splitlines() if "WorkerLostError: parameter server:" in line]
        assert message, f"rank {rank}:\n{out[-3000:]}"
        assert f"worker 1 (rank {victim}) is lost at step 5" in message[-1], message[-1]
        assert "GLHF" not in message[-1] and "pair.cc" not in message[-1], message[-1]  # our words only
        if rank < num_servers and mute:
            assert "sent nothing more" in out, out[-3000:]

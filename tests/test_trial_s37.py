"""Defects found in session 37 (trials and the ROADMAP's open points), each tested where it can fail on CPU."""

from __future__ import annotations

import os
import pty
import re
import time

import pytest
import torch

from distributed_training.testing import run_distributed


def bar_without_log_dir_worker(rank, world, progress):
    """fit with no log_dir: what each rank wrote on stderr (the bar's plain lines where it is no terminal)."""
    import io
    import sys

    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    stderr, sys.stderr = sys.stderr, io.StringIO()
    try:
        trainer = DistributedTrainer(torch.nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.05), log_every=5,
                                     progress=progress)
        trainer.fit(TensorDataset(torch.randn(80, 4), torch.randn(80, 1)), epochs=1, criterion=F.mse_loss,
                    batch_size=4)
        trainer.close()
        return sys.stderr.getvalue()
    finally:
        sys.stderr = stderr


def test_the_progress_bar_shows_without_a_log_dir_on_the_main_rank_only():
    said = run_distributed(bar_without_log_dir_worker, 2, args=(True,), timeout=90)
    lines = [line for line in said[0].splitlines() if line.startswith("step ")]
    # 80 rows, 2 ranks, batches of 4: 10 steps; a line at the start, at steps 5 and 10.
    assert [line.split(" ")[1] for line in lines] == ["0/10", "5/10", "10/10"], said[0]
    assert "loss " in lines[1] and "steps/s" in lines[1], lines
    assert "step " not in said[1], said[1]
    quiet = run_distributed(bar_without_log_dir_worker, 2, args=(False,), timeout=90)
    assert not any(line.startswith("step ") for text in quiet for line in text.splitlines()), quiet


def test_the_bar_draws_on_a_terminal_that_reports_no_size():
    """A pseudo-terminal nobody sized says 0 columns and 0 lines: tqdm drew nothing at all there."""
    from distributed_training.monitor.progress import ProgressBar

    master, slave = pty.openpty()
    try:
        if os.get_terminal_size(slave).columns:
            pytest.skip("this system's pseudo-terminals come sized")
        with os.fdopen(slave, "w", closefd=False) as stream:
            bar = ProgressBar(stream)
            bar.draw(3, 10, 2.0, 1.5)
            bar.finish()
        drawn = _read_all(master).decode(errors="replace")
    finally:
        os.close(master)
        os.close(slave)
    assert "step 3/10" in drawn and "loss 1.5" in drawn, repr(drawn)


def _read_all(fd: int) -> bytes:
    """Everything written so far to a pseudo-terminal: one read may return only the first of several writes."""
    import select

    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def criterion_as_epochs_worker(rank, world):
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    trainer = DistributedTrainer(torch.nn.Linear(2, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    try:
        trainer.fit(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), torch.nn.MSELoss())
    except ValueError as err:
        return str(err)
    finally:
        trainer.close()


def test_a_criterion_given_where_fit_takes_epochs_says_how_to_pass_it():
    said = run_distributed(criterion_as_epochs_worker, 1, timeout=60)
    assert "pass criterion= by name" in said[0], said


def options_on_one_rank_worker(rank, world, where, tmp):
    """A trainer (or fit) option given on rank 0 only: every rank raises, naming it (it hung before)."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    extra = {"log_dir": f"{tmp}/runs"} if where == "log_dir" and rank == 0 else {}
    extra.update({"gradient_clip_val": 1.0} if where == "clip" and rank == 0 else {})
    fit_extra = ({"eval_dataset": TensorDataset(torch.randn(8, 4), torch.randn(8, 1))}
                 if where == "eval_dataset" and rank == 0 else {})
    try:
        trainer = DistributedTrainer(torch.nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero3",
                                     progress=False, log_every=2, **extra)
    except ValueError as err:
        return str(err)
    try:
        trainer.fit(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), 1, F.mse_loss, batch_size=4, **fit_extra)
    except ValueError as err:
        return str(err)
    finally:
        trainer.close()
    return None


@pytest.mark.parametrize("where,name", [("log_dir", "DistributedTrainer: log_dir"),
                                        ("clip", "DistributedTrainer: gradient_clip_val"),
                                        ("eval_dataset", "fit: eval_dataset")])
def test_an_option_given_on_one_rank_only_is_refused_on_every_rank_naming_it(tmp_path, where, name):
    said = run_distributed(options_on_one_rank_worker, 2, args=(where, str(tmp_path)), timeout=60)
    for text in said:
        assert text is not None and text.startswith(name + " differs across ranks: rank 0 has"), said


def on_step_fails_worker(rank, world, log_dir):
    """Rank 1's on_step raises after step 4 (an experiment tracker that is down), its process alive: the
    other rank, waiting in the next collective, names it and its error (it was told "dead" once the
    heartbeat stopped, or waited forever while the process lived)."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer
    from _failures import fit_outcome

    def on_step(step, metrics):
        if rank == 1 and step == 4:
            raise ConnectionError("experiment tracker unreachable")

    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(8, 4), lambda ps: torch.optim.SGD(ps, lr=0.01), progress=False,
                                 timeout=60, log_dir=log_dir, log_every=2)
    trainer._peer_exit_after = 30.0
    data = TensorDataset(torch.randn(160, 8), torch.randint(0, 4, (160,)))
    return fit_outcome(rank, trainer, lambda: trainer.fit(data, 1, F.cross_entropy, batch_size=4, log_every=2,
                                                         on_step=on_step), ConnectionError)


@pytest.mark.parametrize("logs", [False, True])
def test_an_error_raised_in_on_step_is_named_to_the_other_ranks(tmp_path, logs):
    (said0, seconds0), (said1, _) = run_distributed(on_step_fails_worker, 2,
                                                    args=(str(tmp_path / "logs") if logs else None,), timeout=90)
    assert said1 == "own: experiment tracker unreachable", said1
    assert said0.startswith("peer 1:") and "ConnectionError: experiment tracker unreachable" in said0, said0
    assert "during fit, after training step 4" in said0 and seconds0 < 20, (said0, seconds0)


def async_write_fails_worker(rank, world, tmp):
    """checkpoint_async with rank 1's disk full: rank 1 raises the write's error at a later step (a local
    check, outside the step's collectives); the other rank names it instead of waiting for a dead peer."""
    import errno

    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import distributed_training.trainer_checkpoints_async as background
    from distributed_training import DistributedTrainer
    from distributed_training.checkpoint_async import CheckpointWriteError
    from distributed_training.peer_watch import PeerFailureError

    if rank == 1:
        def full_disk(part, file):
            raise OSError(errno.ENOSPC, "No space left on device", file)
        background.atomic_save = full_disk
    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(8, 4), lambda ps: torch.optim.SGD(ps, lr=0.01), progress=False,
                                 timeout=60, checkpoint_dir=f"{tmp}/ckpt", checkpoint_every=2, checkpoint_async=True)
    trainer._peer_exit_after = 30.0
    try:
        trainer.fit(TensorDataset(torch.randn(400, 8), torch.randint(0, 4, (400,))), 1, F.cross_entropy,
                    batch_size=2, max_steps=60)
        said = "returned"
    except PeerFailureError as err:
        said = f"peer {err.rank}: {err}"
    except CheckpointWriteError as err:
        said = f"own: {err}"
    if rank == 1:
        import time
        time.sleep(4)
    trainer.close(barrier=False)
    return said


def test_a_background_checkpoint_write_that_fails_on_one_rank_is_named_to_the_others(tmp_path):
    said0, said1 = run_distributed(async_write_fails_worker, 2, args=(str(tmp_path),), timeout=90)
    assert said1.startswith("own: rank 1: writing checkpoint file") and "No space left" in said1, said1
    # Rank 0 is told by the peer watch, or (where its next checkpoint's agreement comes first) by that.
    assert (said0.startswith("peer 1:") or "rank 1 failed to write its file" in said0) and "No space left" in said0, \
        said0


def resume_with_a_read_error_worker(rank, world, directory, max_steps, flaky):
    """fit resuming from a shared checkpoint directory; with `flaky`, rank 1's first checksum read fails
    (EIO: a network file system's transient error)."""
    import errno

    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    import distributed_training.checkpoint as checkpoint
    from distributed_training import DistributedTrainer

    if flaky and rank == 1:
        real, calls = checkpoint.sha256_file, [0]

        def sha256_file(path, *args, **kwargs):
            calls[0] += 1
            if calls[0] == 1:
                raise OSError(errno.EIO, "Input/output error", path)
            return real(path, *args, **kwargs)
        checkpoint.sha256_file = sha256_file
    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(8, 4), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                                 checkpoint_dir=directory, checkpoint_every=2, keep_last=5)
    try:
        trainer.fit(TensorDataset(torch.randn(200, 8), torch.randint(0, 4, (200,))), 1, F.cross_entropy,
                    batch_size=2, max_steps=max_steps)
        said = f"step {trainer.step}"
    except OSError as err:
        said = f"{type(err).__name__}: {err}"
    trainer.close(barrier=False)
    return said


def test_a_read_error_on_one_rank_while_resuming_fails_every_rank_alike(tmp_path):
    """Each rank picked the newest checkpoint it could verify on its own: rank 1, after one failed read,
    loaded step 4 while rank 0 loaded step 6 (different weights, silently), and the job crashed later."""
    directory = str(tmp_path / "ckpt")
    assert run_distributed(resume_with_a_read_error_worker, 2, args=(directory, 6, False), timeout=60) == ["step 6"] * 2
    said = run_distributed(resume_with_a_read_error_worker, 2, args=(directory, 10, True), timeout=60)
    assert said[0] == said[1] and said[0].startswith("OSError: loading checkpoint"), said
    assert "failed on rank 1 (nothing was loaded on any rank)" in said[0] and "Input/output error" in said[0], said
    assert run_distributed(resume_with_a_read_error_worker, 2, args=(directory, 10, False), timeout=60) == ["step 10"] * 2


def layerwise_optimizer_worker(rank, world, strategy, tp, kind):
    import warnings

    from distributed_training import DistributedTrainer
    from distributed_training.logs import install_default_handler
    from distributed_training.optim import LAMB, excluded_names, param_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    if kind == "lamb":
        factory = lambda ps: LAMB(ps, lr=1e-2)  # noqa: E731
    elif kind == "adafactor":
        factory = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)  # noqa: E731
    else:  # weight-decay exclusions by name (the biases)
        names = {id(p): n for n, p in model.named_parameters()}
        exclude = excluded_names(model, ["bias"])
        factory = lambda ps: torch.optim.AdamW(param_groups(list(ps), names, exclude, 0.1), lr=1e-2)  # noqa: E731
    kw = dict(tensor_parallel_size=tp, tensor_parallel_plan={"0": "colwise", "2": "rowwise"}) if tp > 1 else {}
    install_default_handler(rank)  # (first: the trainer's own call would route warnings to logging, unrecorded)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            trainer = DistributedTrainer(model, factory, strategy=strategy, progress=False, **kw)
        except ValueError as err:
            return f"refused: {err}"
    trainer.close()
    return "warned: " + " | ".join(str(w.message) for w in said if "elementwise" in str(w.message))


@pytest.mark.parametrize("strategy,tp,kind,expect", [
    ("zero1", 1, "lamb", "refused: optimizer LAMB needs each layer's whole norm"),
    ("ddp", 2, "lamb", "refused: optimizer LAMB needs each layer's whole norm"),
    ("zero3", 1, "lamb", "warned: "),  # (exact: its shards say their layers)
    ("zero1", 1, "exclusions", "refused: param_groups: the strategy hands the optimizer tensors"),
    ("zero2", 1, "adafactor", "warned: optimizer Adafactor computes with each tensor's shape"),
])
def test_optimizers_that_need_whole_layers_are_refused_or_warned_where_they_see_slices(strategy, tp, kind, expect):
    said = run_distributed(layerwise_optimizer_worker, 2, args=(strategy, tp, kind), timeout=90)
    for text in said:
        assert text.startswith(expect) and (expect != "warned: " or text == expect), (text, expect)


def test_a_second_dtrain_run_writes_its_output_over_the_first(tmp_path, monkeypatch):
    """The output check probed for a temporary file *inside* an existing output file: every second run
    with `output:` set (the README's image example run twice) was refused as unwritable."""
    from distributed_training import cli

    said = []
    monkeypatch.setattr(cli, "_report_once", said.append)
    config = os.path.join(os.path.dirname(__file__), "..", "examples", "configs", "gpt_cpu.yaml")
    output = tmp_path / "model.pt"
    for run in range(2):
        # (the tiny preset and a 1% validation split: the run's final evaluation was ~90% of the test's time)
        args = ["--set", "training.max_steps=1", "--set", "model.preset=tiny", "--set", "data.val_fraction=0.01",
                "--set", f"checkpoint.dir={tmp_path / f'ck{run}'}",
                "--set", f"logging.dir={tmp_path / f'logs{run}'}", "--set", f"output={output}"]
        assert cli.main([config, *args]) == 0, said
        assert output.is_file() and torch.load(output, weights_only=True)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], os.listdir(tmp_path)  # no temporary left


SIGNALLED_JOB = r'''
import os, sys, time, torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from distributed_training import DistributedTrainer

class Slow(Dataset):
    def __len__(self):
        return 400
    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.full((4,), float(i % 7)), torch.tensor(i % 2)

def on_step(step, metrics):
    if step == 3:
        open(sys.argv[2], "w").close()

torch.manual_seed(0)
trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                             checkpoint_dir=sys.argv[1])
trainer.fit(Slow(), 1, F.cross_entropy, batch_size=4, num_workers=2, log_every=1, on_step=on_step)
'''


def test_sigterm_to_the_process_group_with_loader_workers_still_saves(tmp_path):
    """`kill -TERM -<pgid>` (Slurm's scancel, systemd, a closed terminal's group) reached the DataLoader's
    workers too: they died, and the save at the stop failed reading the next batch ("DataLoader worker is
    killed by signal: Terminated"), so the preemption checkpoint was lost."""
    import signal
    import subprocess
    import sys
    import time

    script, marker = tmp_path / "job.py", tmp_path / "step3"
    script.write_text(SIGNALLED_JOB)
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}
    job = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ck"), str(marker)], env=env,
                           start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), job.communicate(timeout=30)[0]
        os.killpg(job.pid, signal.SIGTERM)
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    saved = sorted(os.listdir(tmp_path / "ck")) if (tmp_path / "ck").is_dir() else []
    assert job.returncode == 128 + signal.SIGTERM and any(n.startswith("step_") for n in saved), (job.returncode, saved, out[-2000:])
    assert "on SIGTERM: checkpoint saved" in out, out[-2000:]


def bn_last_batch_worker(rank, world, drop_last):
    """A model whose BatchNorm sees one value a channel, 18 samples over 2 ranks in batches of 4: the 2 left
    at each epoch's end, split as they fall, give each replica 1, on which it fails: fit pads that step to 2
    a replica (session 46; before, the error said to pass drop_last=True). A batch of one sample still
    gets the error that says what to do."""
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    try:
        history = trainer.fit(TensorDataset(torch.randn(18, 4), torch.randint(0, 2, (18,))), 2, F.cross_entropy,
                              batch_size=4, drop_last=drop_last)
        try:
            trainer.train_step((torch.randn(1, 4), torch.randint(0, 2, (1,))), F.cross_entropy)
            said = "trained"
        except ValueError as err:
            said = str(err)
        return [h["steps"] for h in history], said
    finally:
        trainer.close()


def test_a_last_batch_of_one_sample_for_batch_norm_is_padded_and_a_batch_of_one_says_what_to_do():
    for steps, said in run_distributed(bn_last_batch_worker, 2, args=(False,), timeout=90):
        assert steps == [3, 3], steps
        assert "a (micro-)batch of one sample reached a BatchNorm layer" in said and "drop_last=True" in said, said
    assert [steps for steps, _ in run_distributed(bn_last_batch_worker, 2, args=(True,), timeout=90)] == [[2, 2]] * 2


def test_an_image_preset_on_your_data_and_your_model_on_an_image_folder_are_configs_not_key_errors(tmp_path,
                                                                                                    monkeypatch):
    """model.target with data.dataset image_folder failed validation with KeyError: 'small'; an image preset
    on data.target with KeyError: 'resnet18'. The first is checked as the user's model; the second needs the
    number of classes, said by name."""
    from distributed_training import cli

    said = []
    monkeypatch.setattr(cli, "_report_once", said.append)
    mine = tmp_path / "user_img.yaml"
    mine.write_text(f"model: {{target: mypkg.models:build}}\ndata: {{dataset: image_folder, root: {tmp_path}}}\n")
    assert cli.main([str(mine), "--print-config"]) == 0, said
    preset = tmp_path / "preset.yaml"
    preset.write_text("model: {preset: resnet18, image_size: 24}\ndata: {target: mypkg.data:Folder}\n")
    assert cli.main([str(preset), "--set", "checkpoint.dir=null"]) == 2, said
    assert "model.preset 'resnet18' on data.target needs model.num_classes" in said[-1], said


RESUMED_JOB = r'''
import sys, torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from distributed_training import DistributedTrainer

class NoisySamples(Dataset):  # a random augmentation drawn from torch's generator, as image transforms do
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((4,), float(i % 5)) + torch.rand(4), torch.tensor(i % 2)

directory, max_steps, workers, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                             checkpoint_dir=directory, checkpoint_every=3)
trainer.fit(NoisySamples(), 1, F.cross_entropy, batch_size=4, num_workers=workers, max_steps=max_steps)
torch.save(trainer.full_state_dict(), out)
trainer.close()
'''


def test_a_run_resumed_mid_epoch_with_loader_workers_is_bit_identical(tmp_path, warm_python):
    """Each worker's generator advanced over the samples it happened to read since the epoch began, so a
    resume (its workers restarted at another sample) drew other augmentations: 1.9 off in a trial."""
    script = tmp_path / "job.py"
    script.write_text(RESUMED_JOB)
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}

    def run(directory, steps, workers):
        out = tmp_path / f"{directory}_{steps}_{workers}.pt"
        # (each run forked from a warm interpreter: four fresh ones were ~12 s of imports on 2 loaded cores)
        done = warm_python([str(script), str(tmp_path / directory), str(steps), str(workers), str(out)], env=env,
                           timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(out, weights_only=True)

    unbroken = run("a", 6, 2)
    run("b", 3, 2)
    resumed = run("b", 6, 2)
    for name, value in unbroken.items():
        assert torch.equal(value, resumed[name]), (name, (value - resumed[name]).abs().max())
    fewer = run("c", 6, 1)
    assert all(torch.equal(v, fewer[k]) for k, v in unbroken.items())  # (and whatever the number of workers)


def compiled_model_worker(rank, world):
    import warnings

    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    graphs = []

    def my_backend(gm, example_inputs):  # the user's choice of backend (what it is given, run as traced)
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = DistributedTrainer(torch.compile(model, backend=my_backend), lambda ps: torch.optim.SGD(ps, lr=0.1),
                                     progress=False)
    trainer.fit(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), 1, F.cross_entropy, batch_size=4)
    state = trainer.full_state_dict()
    trainer.close()
    return sorted(state), len(graphs), [str(w.message) for w in said if "torch.compile'd" in str(w.message)]


def test_a_torch_compiled_model_keeps_its_own_keys():
    """torch.compile(model) given to the trainer put "_orig_mod." before every key of full_state_dict() and
    of checkpoints, which then did not load into the plain model. The module inside is compiled again, in
    place (session 50): with the user's own backend, mode and options, not the default (inductor)."""
    keys, graphs, said = run_distributed(compiled_model_worker, 1, timeout=180)[0]
    assert keys == ["0.bias", "0.weight", "2.bias", "2.weight"], keys
    assert graphs >= 1, "the user's backend compiled nothing: the trainer replaced it"
    assert len(said) == 1 and "its own options (backend 'my_backend')" in said[0], said


def test_small_things_a_new_user_met(tmp_path):
    """evaluation.metrics given as one name; the plot tool asked for a suffix it cannot write (it wrote PNG
    bytes into run.txt); the bar's slow rate read "1.39s/ steps"."""
    from distributed_training.config_evaluation import EvaluationConfig
    from distributed_training.monitor.progress import ProgressBar

    assert EvaluationConfig(metrics="accuracy").metrics == ["accuracy"]
    matplotlib = pytest.importorskip("matplotlib")
    del matplotlib
    from distributed_training.monitor import plot

    logs = tmp_path / "runs" / "rank_0"
    logs.mkdir(parents=True)
    (logs / "metrics.jsonl").write_text('{"step": 1, "time": 0, "rank": 0, "train/loss": 1.0}\n'
                                        '{"step": 2, "time": 1, "rank": 0, "train/loss": 0.5}\n')
    assert plot.main([str(tmp_path / "runs"), "-o", str(tmp_path / "run.txt")]) != 0
    assert not (tmp_path / "run.txt").exists()
    assert plot.main([str(tmp_path / "runs"), "-o", str(tmp_path / "run.png")]) == 0
    master, slave = pty.openpty()  # a slow run's bar, drawn: a second and a half a step
    try:
        with os.fdopen(slave, "w", closefd=False) as stream:
            bar = ProgressBar(stream)
            bar.draw(1, 10, None, 2.0)
            time.sleep(1.5)
            bar.draw(2, 10, None, 1.5)
            bar.finish()
        drawn = _read_all(master).decode(errors="replace")
    finally:
        os.close(master)
        os.close(slave)
    last = [line for line in drawn.replace("\n", "\r").split("\r") if line.strip()][-1]
    assert re.search(r"step 2/10 .* 0\.[5-7]\d steps/s", last) and "s/ steps" not in drawn, repr(drawn)


INTERRUPTED_SAVE = r'''
import os, signal, sys, time, torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset
import distributed_training.trainer_checkpoints as checkpoints
from distributed_training import DistributedTrainer

real = checkpoints.save_file
signal.signal(signal.SIGINT, signal.default_int_handler)  # (a job a shell put in the background ignores it)

def slow_save(part, path):  # Ctrl-C pressed twice while the file is written (a large model's save)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1.2)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    return real(part, path)

checkpoints.save_file = slow_save
torch.manual_seed(0)
trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False,
                             checkpoint_dir=sys.argv[1], checkpoint_every=2)
try:
    trainer.fit(TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,))), 1, F.cross_entropy, batch_size=4)
except KeyboardInterrupt as err:
    print("interrupted:", err)
    sys.exit(130)
'''


def test_a_second_ctrl_c_during_a_checkpoint_write_waits_for_it(tmp_path):
    """The second press raised inside torch.save: "unexpected pos ...", exit status 1, and an empty
    step directory, while the README says a write in progress always finishes first."""
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(INTERRUPTED_SAVE)
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "ck")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 130 and "after the checkpoint write" in done.stdout, (done.returncode, done.stdout,
                                                                                   done.stderr[-2000:])
    assert os.path.isfile(tmp_path / "ck" / "step_000000002" / "meta.pt"), os.listdir(tmp_path / "ck")


def summon_edit_worker(rank, world, strategy, writeback):
    torch.manual_seed(0)
    from distributed_training import DistributedTrainer

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy, progress=False)
    with trainer.summon_full_params(writeback=writeback):
        with torch.no_grad():
            trainer.module[2].bias.fill_(7.0)
    state = trainer.full_state_dict()
    trainer.close()
    return state["2.bias"].tolist() if rank == 0 else None


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_weights_written_inside_summon_full_params_stay_under_every_strategy(strategy):
    """They stayed under DDP and ZeRO-1 and were dropped silently under ZeRO-2/3 (torch's FSDP writes them
    back by default); writeback=False drops them under the sharded strategies."""
    assert run_distributed(summon_edit_worker, 2, args=(strategy, True), timeout=90)[0] == [7.0, 7.0]
    if strategy in ("zero2", "zero3"):
        assert run_distributed(summon_edit_worker, 2, args=(strategy, False), timeout=90)[0] != [7.0, 7.0]


def ps_latest_worker(rank, world, directory):
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    def trainer():
        torch.manual_seed(0)
        return DistributedTrainer(torch.nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.01),
                                  strategy="parameter_server", num_servers=1, heartbeat_timeout=None,
                                  checkpoint_dir=directory, checkpoint_every=1, progress=False)
    first = trainer()
    first.fit(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), 1, F.mse_loss, batch_size=4, max_steps=2)
    first.close()
    again = trainer()
    found = again.latest_checkpoint()
    again.close()
    return None if found is None else int(found[1]["step"])


def test_a_parameter_servers_servers_find_the_checkpoint_too(tmp_path):
    """The first rank of each role's group picks the checkpoint: the servers have no main rank among them,
    and got None where the workers found step 2 (a script's "already done?" check then split the roles)."""
    assert run_distributed(ps_latest_worker, 2, args=(str(tmp_path),), timeout=90) == [2, 2]


def test_a_failed_checkpoint_write_does_not_leave_a_second_ctrl_c_behind():
    from distributed_training import stopping

    with pytest.raises(OSError):
        with stopping.checkpoint_writing():
            stopping._writes["interrupted"] = True  # (what a second Ctrl-C during the write sets)
            raise OSError("No space left on device")
    with stopping.checkpoint_writing():  # a later write completes without a KeyboardInterrupt
        pass
    with pytest.raises(KeyboardInterrupt):
        with stopping.checkpoint_writing():
            stopping._writes["interrupted"] = True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bar_without_a_log_dir_reads_a_gpu_loss_without_waiting():
    """A loss on the GPU is copied to the host without a wait and shown once there (at the latest at the
    next log step): the bar must not add a device synchronisation to fit's steps."""
    import io

    from distributed_training.monitor.null import ProgressOnly

    stream = io.StringIO()
    bar = ProgressOnly(log_every=2, stream=stream)
    bar.start(6, step=0)
    for step in range(1, 7):
        loss = torch.full((), 1.5 + step, device="cuda")
        bar.record_step(step, {"loss": loss}, samples=0, step_time=0.01)
    torch.cuda.synchronize()
    bar.end_progress()
    lines = [line for line in stream.getvalue().splitlines() if line.startswith("step ")]
    assert any("loss 5.5" in line or "loss 3.5" in line for line in lines), lines  # (the 4th's or the 2nd's)


def save_on_rank0_only_worker(rank, world, directory):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer
    from distributed_training.hangs import CollectiveTimeoutError

    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    batch = (torch.randn(4, 4), torch.randint(0, 2, (4,)))
    for _ in range(2):
        trainer.train_step(batch, F.cross_entropy)
    try:
        if rank == 0:
            trainer.save_checkpoint(f"{directory}/mine")  # (the mistake: on rank 0 only)
        trainer.train_step(batch, F.cross_entropy)
        said = "returned"
    except CollectiveTimeoutError as err:
        said = str(err)
    import time
    time.sleep(8)  # (the other rank times out on its own before this one's connections close)
    trainer.close(barrier=False)
    return said


def test_a_save_on_rank_0_only_says_where_each_rank_is_when_it_times_out(tmp_path):
    """Rank 0 waited in save_checkpoint, the others in their next step, until the collective timeout:
    rank 0 got gloo's bare timeout, the others "rank 0 never reached step 3". Now both say where each is."""
    said0, said1 = run_distributed(save_on_rank0_only_worker, 2, args=(str(tmp_path),), timeout=90,
                                   collective_timeout=6)
    assert "during the checkpoint save to" in said0 and "rank 1 is in training step 3 or later" in said0, said0
    assert "Every rank must make this call" in said0, said0
    assert "rank 0 is in the checkpoint save to" in said1 and "made on some ranks only" in said1, said1

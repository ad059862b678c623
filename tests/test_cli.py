"""The `dtrain` command: YAML configs validated field by field, and the examples under torchrun."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from distributed_training.config import ConfigError, JobConfig, load_config

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _run(args, timeout=180, **kw):
    out = subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout, **kw)
    return out.returncode, out.stdout + out.stderr


def _run_warm(warm_python, args, timeout=180):
    """``python *args`` at the repository root, in a process forked from the warm_python fixture's server."""
    out = warm_python(args, cwd=REPO, env=ENV, timeout=timeout)
    return out.returncode, out.stdout + out.stderr


def _torchrun(warm_torchrun, target, args=(), timeout=180, **kw):
    """`target` under torchrun with 2 processes at the repository root: (exit status, stdout + stderr)."""
    out = warm_torchrun(target, args, nproc=2, env=ENV, cwd=REPO, timeout=timeout, **kw)
    return out.returncode, out.stdout + out.stderr


def _dtrain_on_two_ranks(warm_torchrun, tmp_path, config: dict):
    """Write `config` to a YAML file and run `dtrain` on it under torchrun with 2 processes."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return _torchrun(warm_torchrun, "distributed_training", [str(path)], module=True)


# Several dtrain jobs one after another in one torchrun launch (tests/jobs/dtrain_jobs.py says how).
DTRAIN_JOBS = (Path(__file__).parent / "jobs" / "dtrain_jobs.py").read_text()


def _dtrain_jobs(warm_python, tmp_path, jobs, timeout=300):
    """`jobs` (argument lists of dtrain) in one torchrun launch of 2 processes at the repository root, the
    launcher forked from the warm server as the warm_torchrun fixture does: (exit status, each job's stdout
    + stderr as rank 0 marked them, the whole stdout + stderr)."""
    import json

    from distributed_training.testing import _torchrun_env

    script = tmp_path / "dtrain_jobs.py"
    script.write_text(DTRAIN_JOBS)
    out = warm_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                       json.dumps([[str(a) for a in job] for job in jobs])], cwd=REPO, env=_torchrun_env(ENV),
                      timeout=timeout)
    marked = [re.split(r"^==== dtrain job \d+\n", text, flags=re.M)[1:] for text in (out.stdout, out.stderr)]
    parts = [a + b for a, b in zip(*marked)] if len(marked[0]) == len(marked[1]) else marked[1]
    return out.returncode, parts, out.stdout + out.stderr


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"training": {"batch_size": 0}}, "training.batch_size"),
        ({"training": {"batch_size": "big"}}, "training.batch_size"),
        ({"training": {"precision": "fp8"}}, "training.precision"),
        ({"training": {"memory_budget_gb": 0}}, "training.memory_budget_gb"),
        ({"training": {"strategy": "zero9"}}, "training.strategy"),
        ({"training": {"lr": -1}}, "training.lr"),
        ({"training": {"bogus": 1}}, "training.bogus"),
        ({"modle": {}}, "modle"),
        ({"model": {"preset": "gpt-7b"}}, "model.preset"),
        ({"data": {"val_fraction": 1.5}}, "data.val_fraction"),
        ({"checkpoint": {"every": 10}}, "checkpoint.every"),
        ({"communication": {"compression": "gzip"}}, "communication.compression"),
        ({"training": {"strategy": "zero3"}, "communication": {"compression": "topk"}}, "communication.compression"),
        ({"training": "fast"}, "training"),
    ],
)
def test_invalid_config_names_the_field(raw, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        load_config(raw)


def test_overrides_and_defaults(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"training": {"strategy": "zero3", "lr": 0.01}}))
    cfg = load_config(str(path), ["training.max_steps=7", "data.block_size=32"])
    assert isinstance(cfg, JobConfig)
    assert (cfg.training.strategy, cfg.training.lr, cfg.training.max_steps, cfg.data.block_size) == ("zero3", 0.01, 7, 32)
    assert cfg.training.batch_size == 16  # untouched fields keep their defaults
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config({}, ["no_equals_sign"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="is a directory: give one of its YAML files"):
        load_config(str(tmp_path))  # was an IsADirectoryError traceback
    # A config's batch_size dropped from the command line, to give the global one instead (was refused:
    # null was not a valid integer, and both together are refused).
    cfg = load_config(str(path), ["training.batch_size=null", "training.global_batch_size=64"])
    assert (cfg.training.batch_size, cfg.training.global_batch_size) == (16, 64)
    with pytest.raises(ConfigError, match="--set training.batch_size=null drops"):
        load_config({"training": {"batch_size": 8, "global_batch_size": 64}})
    # A field under a section that is null in the file (as --print-config writes an empty one) is set
    # there (was "unknown field target": the empty section went to the top level).
    cfg = load_config({"evaluation": {"every": 10, "target": None}, "model": {"target": "torch.nn:Linear", "kwargs": None}},
                      ["evaluation.target.val_loss=3.0", "model.kwargs.in_features=2"])
    assert cfg.evaluation.target == {"val_loss": 3.0} and cfg.model.kwargs == {"in_features": 2}
    # A whole section from the command line is merged into the file's (was: replaced, the file's other
    # fields back at their defaults, silently).
    cfg = load_config(str(path), ["training={strategy: ddp, max_steps: 3}"])
    assert (cfg.training.strategy, cfg.training.lr, cfg.training.max_steps) == ("ddp", 0.01, 3)


def test_help_and_print_config(warm_python):
    code, out = _run_warm(warm_python, ["-m", "distributed_training", "--help"], timeout=60)
    assert code == 0 and "training:" in out and "torchrun" in out and "--set" in out, out
    code, out = _run_warm(warm_python, ["-m", "distributed_training", "--print-config", "--set", "training.lr=0.5"],
                          timeout=60)
    assert code == 0, out
    assert yaml.safe_load(out)["training"]["lr"] == 0.5
    code, out = _run_warm(warm_python, ["-m", "distributed_training", "examples/configs/gpt_cpu.yaml",
                                        "--set", "training.batch_size=0"], timeout=60)
    assert code == 2 and "training.batch_size" in out, out


# Four jobs of dtrain under torchrun on 2 ranks (one that checkpoints and writes its model, and three of
# what dtrain chooses and says), one after another in one launch (`_dtrain_jobs`), each checked by its own
# test on its own output below. TMP: the launch's directory.
CHOICE_JOBS = {
    "completion": {
        "model": {"preset": "tiny"},
        "data": {"dataset": "repo_text", "block_size": 32, "val_fraction": 0.01},
        "training": {"strategy": "zero2", "epochs": 1, "max_steps": 4, "batch_size": 4, "seed": 0},
        "checkpoint": {"dir": "TMP/ckpt", "every": 2},
        "output": "TMP/final.pt",
    },
    # A budget of 5 MB: DDP still fits and the batch chosen is ~46 a rank (0.02 GB chose 279: bf16 on CPU
    # took ~9 s for the 3 steps at that size).
    "bf16": {
        "model": {"preset": "tiny"},
        "data": {"dataset": "repo_text", "block_size": 32, "val_fraction": 0.01},
        "training": {"strategy": "auto", "batch_size": "auto", "precision": "bf16", "activation_checkpointing": True,
                     "memory_budget_gb": 0.005, "epochs": 1, "max_steps": 3, "seed": 0},
    },
    "plain_lines": {
        "model": {"preset": "classifier"},
        "data": {"dataset": "digits", "val_fraction": 0.1},
        "training": {"epochs": 1, "max_steps": 6, "batch_size": 32},
        "logging": {"every": 2, "dir": "TMP/logs"},
    },
    # last: its counts of warnings and loss lines would also see a handler left over from the jobs before
    "fp16": {
        "model": {"preset": "classifier"},
        "data": {"dataset": "digits", "val_fraction": 0.1},
        "training": {"strategy": "zero3", "epochs": 1, "max_steps": 10, "batch_size": "auto", "precision": "fp16"},
        "logging": {"every": 1},
    },
}


@pytest.fixture(scope="module")
def choice_jobs(tmp_path_factory, warm_python):
    """CHOICE_JOBS run by dtrain under torchrun on 2 ranks in one launch: ({name: that job's output}, the
    launch's exit status, its whole output, the launch's directory)."""
    tmp = tmp_path_factory.mktemp("choice_jobs")
    argvs = []
    for name, config in CHOICE_JOBS.items():
        config = yaml.safe_load(yaml.safe_dump(config).replace("TMP/", f"{tmp}/"))
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        argvs.append([str(path)])
    code, said, out = _dtrain_jobs(warm_python, tmp, argvs, timeout=240)  # within the tests' 300 s
    return dict(zip(CHOICE_JOBS, said)), code, out, tmp


def _choice_job(choice_jobs, name):
    said, code, out, _ = choice_jobs
    assert name in said, out[-3000:]  # the jobs before it ended well
    assert code == 0, out[-3000:]
    return said[name], out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dtrain_trains_under_torchrun_and_marks_completion(choice_jobs):
    out, _ = _choice_job(choice_jobs, "completion")
    tmp = choice_jobs[3]
    assert "finished at step 4" in out, out[-2000:]
    assert (tmp / "ckpt" / "COMPLETED").is_file() and (tmp / "final.pt").is_file()
    assert {"step_000000002", "step_000000004"} <= set(os.listdir(tmp / "ckpt"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dtrain_auto_strategy_auto_batch_bf16_checkpointed_blocks(choice_jobs):
    out, _ = _choice_job(choice_jobs, "bf16")
    assert re.search(r"strategy auto -> ddp \(", out), out[-3000:]
    match = re.search(r"batch_size auto -> (\d+) per rank \(estimated", out)
    assert match and int(match.group(1)) >= 1, out[-3000:]
    assert "finished at step 3" in out, out[-2000:]


# The digits example run twice under torchrun on 2 ranks, one run after the other in one launch (as
# `python examples/train_digits.py ARGS` runs it: runpy, as __main__, with its argv); rank 0 marks on
# stdout (where the example prints) where each run's output starts.
DIGITS_RUNS = """
import json, os, runpy, sys
for i, argv in enumerate(json.loads(sys.argv[1])):
    if os.environ.get("RANK", "0") == "0":
        print(f"==== digits run {i}", flush=True)
    sys.argv = ["examples/train_digits.py", *argv]
    runpy.run_path("examples/train_digits.py", run_name="__main__")
"""


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory, warm_python):
    """The digits example's 2-epoch run, and its zero3 run of 20 steps checkpointing every 10, under
    torchrun on 2 ranks in one launch: (each run's stdout, the launch's exit status and whole output, the
    checkpoint directory)."""
    import json

    from distributed_training.testing import _torchrun_env

    tmp = tmp_path_factory.mktemp("digits")
    ckpt = str(tmp / "ckpt")
    script = tmp / "digits_runs.py"
    script.write_text(DIGITS_RUNS)
    runs = [["--epochs", "2"],
            ["--strategy", "zero3", "--max-steps", "20", "--checkpoint-dir", ckpt, "--checkpoint-every", "10"]]
    out = warm_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                       json.dumps(runs)], cwd=REPO, env=_torchrun_env(ENV), timeout=240)
    said = re.split(r"^==== digits run \d+\n", out.stdout, flags=re.M)[1:]
    return said, out.returncode, out.stdout + out.stderr, ckpt


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_learns(digits_runs):
    said, code, whole, _ = digits_runs
    assert said, whole[-3000:]
    out = said[0]
    match = re.search(r"accuracy ([\d.]+) -> ([\d.]+)", out)
    assert match, out[-2000:]
    before, after = map(float, match.groups())
    assert after > 0.85 and after > before + 0.5, (before, after)
    assert code == 0, whole[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_digits_example_resumes_a_zero3_run_under_ddp_on_one_process(digits_runs, warm_python):
    said, code, whole, ckpt = digits_runs
    assert code == 0 and len(said) == 2 and "20 steps" in said[1], whole[-3000:]
    code, out = _run_warm(warm_python, ["examples/train_digits.py", "--strategy", "ddp", "--max-steps", "30",
                                        "--checkpoint-dir", ckpt])
    assert code == 0, out[-3000:]
    assert "resumed from step 20" in out and "strategy: zero3 -> ddp" in out and "30 steps" in out, out[-3000:]
    assert "30 steps (resumed at step 20; 'before' is the model as built)" in out, out[-3000:]


# ------------------------------------------------------------------ config errors under torchrun
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_config_error_under_torchrun_is_said_once(tmp_path, warm_torchrun):
    path = tmp_path / "bad.yaml"
    path.write_text("training:\n  lr: fast\n")
    out = warm_torchrun("distributed_training", [str(path)], module=True, nproc=2, env=ENV, cwd=REPO, timeout=100)
    assert out.returncode != 0
    both = out.stdout + out.stderr
    assert both.count("invalid config") == 1 and both.count("training.lr") == 1, both
    # torchrun's summary names it as the root cause, rather than pointing to a traceback that does not exist.
    root = out.stderr[out.stderr.index("Root Cause"):]
    assert "traceback : dtrain: invalid config: training.lr" in root, out.stderr


# ------------------------------------------------------------------ what dtrain chooses, and says
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_batch_max_steps_fp16_and_strategy_name_are_sensible_and_said(choice_jobs):
    out, whole = _choice_job(choice_jobs, "fp16")
    # The strategy is called what the user called it.
    assert re.search(r"strategy zero3, world size 2", out), out[-3000:]
    # On CPU the memory estimate allows the whole shard (810 samples per rank): capped so an epoch has 4+ steps.
    match = re.search(r"batch_size auto -> (\d+) per rank \(.*capped at \d+ by 4 steps per epoch over this "
                      r"rank's (\d+) samples", out)
    assert match, out[-3000:]
    batch, share = map(int, match.groups())
    assert share == 809 and batch == share // 4, out[-3000:]
    # max_steps is what the user asked for: epochs are extended to reach it, and that is said.
    assert re.search(r"training.max_steps=10 needs 2 epochs of 5 steps .* training for 2 epochs", out), out[-3000:]
    assert "finished at step 10" in out and out.count("| loss") == 10, out[-3000:]
    # fp16 on a CPU: one warning, from rank 0, naming the slowdown and the alternatives (counted over the
    # whole launch too: the other jobs are not fp16, and a rank 1's line may land in any job's part).
    warnings = [line for line in out.splitlines() if "mixed_precision='fp16' on CPU" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[rank 0] WARNING") and "bf16" in warnings[0], out[-3000:]
    assert whole.count("mixed_precision='fp16' on CPU") == 1, whole[-3000:]


# ------------------------------------------------------------------ logging
LOGGING_SCRIPT = """
import logging, sys, torch
mode = sys.argv[1]
if mode == "user":
    logging.basicConfig(level=logging.INFO, format="USER %(name)s: %(message)s", stream=sys.stdout)
elif mode == "quiet":
    logging.getLogger("distributed_training").setLevel(logging.WARNING)
sys.path.insert(0, "tests")
from _models import tiny_gpt
from distributed_training import DistributedTrainer
trainer = DistributedTrainer(tiny_gpt(), lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="auto", memory_budget_bytes=1e9)
logging.getLogger("distributed_training.user_code").warning("a warning on rank %d", trainer.context.rank)
tokens = torch.randint(0, 64, (32, 16))
trainer.fit(torch.utils.data.TensorDataset(tokens, tokens), epochs=1, max_steps=1000, batch_size=8)
trainer.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_messages_go_through_logging_rank_zero_by_default(tmp_path, warm_torchrun, warm_python):
    script = tmp_path / "script.py"
    script.write_text(LOGGING_SCRIPT)
    # Default: INFO from rank 0 only, warnings from every rank with the rank in front; on stderr.
    out = warm_torchrun(script, ["default"], nproc=2, env=ENV, cwd=REPO, timeout=200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("strategy auto -> ddp (") == 1, out.stderr
    # fit() says when its epochs end training before max_steps (2 ranks x 2 steps of 8 = 32 samples per epoch).
    assert out.stderr.count("epochs=1 of 2 steps end training at step 2, before max_steps=1000") == 1, out.stderr
    assert "[rank 0] WARNING: a warning on rank 0" in out.stderr and "[rank 1] WARNING: a warning on rank 1" in out.stderr
    assert out.stdout == ""
    # An application that configured logging gets the messages through its own handlers, once each.
    # (Forked from the warm server, which imported the package: its import configures no logging.)
    user = warm_python([script, "user"], cwd=REPO, env=ENV, timeout=120)
    assert user.returncode == 0, user.stderr[-3000:]
    assert user.stdout.count("USER distributed_training: strategy auto -> ddp (") == 1, user.stdout
    assert "strategy auto" not in user.stderr and "[rank" not in user.stderr, user.stderr
    # ... and one that silenced the package's INFO messages does not see them.
    quiet = warm_python([script, "quiet"], cwd=REPO, env=ENV, timeout=120)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert "strategy auto" not in quiet.stdout + quiet.stderr and "a warning on rank 0" in quiet.stderr


def test_library_code_never_prints():
    import ast

    allowed = {("monitor/plot.py", "main")}  # a command's own output: the file it wrote
    found = []
    for path in sorted((REPO / "distributed_training").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
            name = getattr(func, "name", "<module>")
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                    where = (str(path.relative_to(REPO / "distributed_training")), name)
                    if where not in allowed and name != "<module>":
                        found.append(f"{where[0]}:{node.lineno} in {name}")
    assert not found, found


# ------------------------------------------------------------------ progress bar in a real terminal
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux (apt-get install tmux)")
def test_progress_bar_and_step_lines_share_a_terminal(tmp_path):
    """Run dtrain in a tmux pane and read the screen: log lines above, the bar alone on its line."""
    socket = f"dtrain-test-{os.getpid()}"
    done = tmp_path / "done"
    command = (f"cd {REPO} && OMP_NUM_THREADS=1 PYTHONPATH={os.environ.get('PYTHONPATH', '')} {sys.executable} "
               f"-m distributed_training examples/configs/gpt_cpu.yaml --set model.preset=tiny "
               f"--set training.max_steps=30 --set logging.every=3 --set data.val_fraction=0.01 --set checkpoint.dir={tmp_path}/ckpt "
               f"--set logging.dir={tmp_path}/runs; echo EXIT=$? > {done}; sleep 300")
    tmux = ["tmux", "-L", socket]
    subprocess.run(tmux + ["new-session", "-d", "-s", "t", "-x", "150", "-y", "60", command], check=True, env=ENV)
    screens = []
    try:
        deadline = time.monotonic() + 240
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.5)
            screens.append(subprocess.run(tmux + ["capture-pane", "-p", "-t", "t"], capture_output=True,
                                          text=True).stdout)
        assert done.exists(), screens[-1]
        time.sleep(0.5)
        screens.append(subprocess.run(tmux + ["capture-pane", "-p", "-t", "t"], capture_output=True, text=True).stdout)
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True)
    assert done.read_text().strip() == "EXIT=0", screens[-1]
    bar = re.compile(r"^step \d+/\d+ \|.*\| +\d+% \|.*steps/s")
    line_kinds = [re.compile(r"^dtrain: "), re.compile(r"^step +\d+ \| loss \d+\.\d+$"), bar, re.compile(r"^EXIT=0$")]
    for screen in screens:
        lines = [line.rstrip() for line in screen.splitlines() if line.strip()]
        for line in lines:
            assert any(kind.match(line) for kind in line_kinds), f"garbled line {line!r} in:\n{screen}"
        assert sum(1 for line in lines if bar.match(line)) <= 1, screen
    final = [line.rstrip() for line in screens[-1].splitlines() if line.strip()]
    assert sum(1 for line in final if re.match(r"^step +\d+ \| loss", line)) == 10, screens[-1]
    assert any(bar.match(line) and line.startswith("step 30/30") for line in final), screens[-1]


SECOND_TRAINER = """
import os, sys
import torch
from torch import nn
from distributed_training import DistributedTrainer
for i in range(2):
    trainer = DistributedTrainer(nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    trainer.train_step((torch.randn(8, 4), torch.randint(0, 2, (8,))), nn.functional.cross_entropy)
    trainer.close()
open(os.path.join(sys.argv[1], "closed_" + os.environ["RANK"]), "w").close()  # both trainers done
"""


@pytest.mark.slow
def test_a_second_trainer_after_close_under_torchrun_does_not_hang(tmp_path, warm_torchrun):
    """close() destroys the process group; a second trainer in the same script makes a new one through
    torchrun's store, whose keys from the first group must not make it wait forever."""
    script = tmp_path / "two_trainers.py"
    script.write_text(SECOND_TRAINER)
    code, out = _torchrun(warm_torchrun, script, [str(tmp_path)], timeout=120)  # a hang fails, its workers killed with it
    assert code == 0, out
    assert sorted(p.name for p in tmp_path.glob("closed_*")) == ["closed_0", "closed_1"], out


PACKAGE_WARNINGS = """
import logging, os, sys, tempfile, warnings
from distributed_training.checkpoint import CheckpointManager
from distributed_training.logs import install_default_handler

install_default_handler(rank=1)
d = tempfile.mkdtemp()
os.makedirs(os.path.join(d, "step_000000005"))
with open(os.path.join(d, "step_000000005", "meta.pt"), "wb") as f:
    f.write(b"garbage")
CheckpointManager(d).latest_good()           # the package warns: a skipped checkpoint
warnings.warn("the application's own warning")
logging.getLogger("distributed_training").setLevel(logging.ERROR)
CheckpointManager(d + "/").latest_good()     # silenced with the rest of the package's messages
"""


@pytest.mark.slow
def test_the_packages_warnings_go_through_its_logger(tmp_path, warm_python):
    script = tmp_path / "warns.py"
    script.write_text(PACKAGE_WARNINGS)
    code, out = _run_warm(warm_python, [script], timeout=60)
    assert code == 0, out
    assert out.count("[rank 1] WARNING: skipping checkpoint") == 1, out
    assert "UserWarning: skipping" not in out, out
    assert "UserWarning: the application's own warning" in out, out


# ------------------------------------------------------------------ tensor and pipeline parallelism
TENSOR_EXAMPLE = "examples/configs/gpt_tensor_cpu.yaml"
PIPELINE_EXAMPLE = "examples/configs/gpt_pipeline_cpu.yaml"


def _example_job(example, tmp_path, name, *sets):
    """An example config for 4 steps, each step's loss logged (JSONL) and the final model written; 1% of
    the text held out for validation, not the example's 10% (the one-process run's validation was most of it)."""
    return [example, "--set", "training.max_steps=4", "--set", "data.val_fraction=0.01", "--set", "logging.every=1",
            "--set", "logging.progress=false", "--set", f"logging.dir={tmp_path / name}",
            "--set", f"output={tmp_path / name}.pt", *[a for s in sets for a in ("--set", s)]]


def _losses(log_dir, rank=0):
    import json

    lines = (log_dir / f"rank_{rank}" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["train/loss"] for line in lines]


def _matches_one_process(tmp_path, name, want, ref):
    """Both ranks' fp32 losses within 1e-4 of the one-process run's at every step, and the final model
    (gathered to the plain model's keys) alike."""
    for rank in (0, 1):
        got = _losses(tmp_path / name, rank)
        assert len(got) == 4 and all(abs(g - w) <= 1e-4 for g, w in zip(got, want)), (name, rank, got, want)
    got = torch.load(tmp_path / f"{name}.pt")
    assert list(got) == list(ref)  # the model's own keys, gathered from the stages / tensor shards
    worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert worst <= 5e-4, (name, worst)  # AdamW, 4 steps: measured 2e-5


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_dtrain_tensor_and_pipeline_examples_match_one_process(tmp_path, monkeypatch, warm_python):
    """The tensor example's 2 tensor-parallel ranks with sequence parallelism, and the pipeline example's 2
    stages (1F1B, 4 microbatches) under ddp and under zero3 (FSDP's units in each stage), each on 2
    processes under torchrun (the three jobs one after another in one launch), against one reference: the
    same config (the two examples differ only in their parallelism) with tensor_parallel_size and
    pipeline_parallel_size 1, one process (dtrain's main in this one), on the same batches."""
    from distributed_training import cli

    monkeypatch.chdir(REPO)

    def without_parallelism(example):  # pipeline_* and microbatches are unused at pipeline_parallel_size 1
        raw = yaml.safe_load((REPO / example).read_text())
        raw["training"] = {k: v for k, v in raw["training"].items()
                           if not k.startswith(("tensor_parallel", "sequence_parallel", "pipeline_", "microbatches"))}
        del raw["logging"]  # set by the job below
        return raw

    assert without_parallelism(TENSOR_EXAMPLE) == without_parallelism(PIPELINE_EXAMPLE)
    assert cli.main(_example_job(TENSOR_EXAMPLE, tmp_path, "ref", "training.tensor_parallel_size=1",
                                 "training.sequence_parallel=false")) == 0
    want = _losses(tmp_path / "ref")
    assert len(want) == 4 and want[-1] < want[0] - 0.5, want  # it trains
    ref = torch.load(tmp_path / "ref.pt")

    strategies = ("ddp", "zero3")
    code, said, out = _dtrain_jobs(warm_python, tmp_path, [_example_job(TENSOR_EXAMPLE, tmp_path, "tp")] + [
        _example_job(PIPELINE_EXAMPLE, tmp_path, strategy, f"training.strategy={strategy}") for strategy in strategies])
    assert code == 0, out[-3000:]
    assert len(said) == 3, out[-3000:]
    assert "tensor-parallel over 2 ranks with sequence parallelism x 1 data-parallel" in said[0], said[0][-3000:]
    assert "finished at step 4" in said[0], said[0][-3000:]
    _matches_one_process(tmp_path, "tp", want, ref)

    for strategy, job in zip(strategies, said[1:]):
        assert "pipeline of 2 stages (1f1b, 4 microbatches) x 1 data-parallel, world size 2" in job, job[-3000:]
        assert f"strategy {strategy}," in job and "finished at step 4" in job, job[-3000:]
        _matches_one_process(tmp_path, strategy, want, ref)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dtrain_pipeline_larger_than_the_world_is_said_once(tmp_path, warm_torchrun):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "training": {"pipeline_parallel_size": 4}}))
    out = warm_torchrun("distributed_training", [str(path)], module=True, nproc=2, env=ENV, cwd=REPO, timeout=100)
    assert out.returncode != 0
    both = out.stdout + out.stderr
    assert both.count("invalid config: training.pipeline_parallel_size=4 does not divide the world size 2") == 1, both
    assert "step" not in out.stdout, both


def _tiny(n_layer=2, **training):
    return {"model": {"preset": "tiny", "n_layer": n_layer}, "training": training}


@pytest.mark.parametrize(
    "raw, world, field",
    [
        (_tiny(pipeline_parallel_size=2), 3, "training.pipeline_parallel_size"),
        (_tiny(1, pipeline_parallel_size=4), 4, "training.pipeline_parallel_size"),  # embed, block.0, head
        (_tiny(pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b", microbatches=2, pipeline_chunks=3), 2,
         "training.pipeline_parallel_size"),  # 6 stages of 4 layers
        (_tiny(pipeline_parallel_size=2, pipeline_split_points=["block.7"]), 2, "training.pipeline_split_points"),
        (_tiny(pipeline_parallel_size=2, pipeline_split_points=["embed"]), 2, "training.pipeline_split_points"),
    ],
)
def test_pipeline_checks_that_need_the_model_or_the_world_name_the_field(monkeypatch, raw, world, field):
    from distributed_training.dtrain_checks import check_pipeline_fits
    from distributed_training.dtrain_job import _build

    cfg = load_config(raw)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}\b"):
        check_pipeline_fits(cfg, _build(cfg)[0])


@pytest.mark.parametrize("raw, world", [
    (_tiny(pipeline_parallel_size=4), 4),  # as many stages as layers
    (_tiny(pipeline_parallel_size=2, pipeline_split_points=["block.1"]), 2),
    (_tiny(pipeline_parallel_size=2), 4),  # 2 stages x 2 data-parallel replicas
    (_tiny(1, pipeline_parallel_size=4, pipeline_half_blocks=True), 4),  # embed, block.0.a, block.0.m, head
    (_tiny(pipeline_parallel_size=2, pipeline_split_points=["block.1.m"], pipeline_half_blocks=True), 2),
])
def test_pipeline_checks_pass_what_fits(monkeypatch, raw, world):
    from distributed_training.dtrain_checks import check_pipeline_fits
    from distributed_training.dtrain_job import _build

    cfg = load_config(raw)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    check_pipeline_fits(cfg, _build(cfg)[0])


def test_what_the_trainer_refuses_with_a_pipeline_is_said_as_config_fields(monkeypatch):
    """The trainer's "not supported yet" with a pipeline (before any rendezvous) becomes an invalid config
    naming the config's field (which `main` reports once, exit status 2)."""
    import distributed_training.cli as cli
    import distributed_training.trainer as trainer_module

    def refuse(*args, **kwargs):
        raise NotImplementedError(f"checkpoint_dir with pipeline_parallel_size={kwargs['pipeline_parallel_size']} "
                                  "is not supported yet")

    monkeypatch.setattr(trainer_module, "DistributedTrainer", refuse)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config({"model": {"preset": "tiny"}, "training": {"pipeline_parallel_size": 2},
                       "checkpoint": {"dir": "unused"}})
    with pytest.raises(ConfigError, match=r"^checkpoint\.dir with training\.pipeline_parallel_size=2 is not"):
        cli.run_job(cfg)


def test_an_epochs_short_last_step_is_padded_only_where_the_schedule_cannot_run_it_split():
    """A short last batch runs in fewer microbatches (left out until session 30, when it had fewer samples
    than microbatches); only interleaved needs a sample per pipeline rank: fit pads that step to it (dtrain
    left it out until session 46), which max_steps' epochs count as a step."""
    from distributed_training.data import ShardedSampler
    from distributed_training.dtrain_epochs import epochs_for
    from distributed_training.pipeline.options import PipelineOptions
    from distributed_training.pipeline.training import PipelineStrategy
    from distributed_training.strategies import DDPStrategy

    def smallest(schedule):
        return PipelineStrategy(DDPStrategy(), PipelineOptions(size=4, schedule=schedule, microbatches=8)).smallest_batch()

    def last(n, schedule):  # the smallest replica's rows in the short step, and whether it was padded
        shards = [list(ShardedSampler(list(range(n)), 2, r, batch_size=16, min_rows=smallest(schedule)))
                  for r in range(2)]
        return min(len(shard) % 16 for shard in shards), sum(map(len, shards)) > n

    for schedule in ("1f1b", "gpipe", "zbh1"):
        assert last(34, schedule) == (1, False)  # 2 left: one a replica, split as it falls
    assert last(38, "interleaved_1f1b") == (4, True)   # 6 left: 3 a replica, fewer than 4 ranks: padded to 4
    assert last(40, "interleaved_1f1b") == (4, False)  # 8 left: 4 a replica, one a rank
    assert last(64, "interleaved_1f1b") == (0, False)  # no short step
    assert epochs_for(1, 3, list(range(38)), 16, 2) == 2  # 2 steps an epoch, the short one too


def test_pipeline_balance_time_times_one_microbatch_of_the_jobs_inputs(monkeypatch):
    """training.pipeline_balance 'time': dtrain hands the trainer one microbatch of its inputs
    (batch_size / microbatches rows: data.block_size token ids for a GPT, 64 pixels for the classifier)."""
    import distributed_training.cli as cli
    import distributed_training.dtrain_job as dtrain_job
    import distributed_training.trainer as trainer_module

    class Seen(Exception):
        pass

    seen = {}

    def capture(*args, **kwargs):
        seen.update(kwargs)
        raise Seen

    monkeypatch.setattr(trainer_module, "DistributedTrainer", capture)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config({"model": {"preset": "tiny"}, "data": {"block_size": 32},
                       "training": {"pipeline_parallel_size": 2, "pipeline_balance": "time", "batch_size": 8,
                                    "microbatches": 4}})
    import torch

    with pytest.raises(Seen):
        cli.run_job(cfg)
    sample = seen["pipeline_sample_input"]
    assert seen["pipeline_balance"] == "time" and sample.shape == (2, 32) and sample.dtype == torch.long
    cfg = load_config({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
                       "training": {"pipeline_parallel_size": 2, "pipeline_balance": "time", "batch_size": 8}})
    assert dtrain_job._sample_input(cfg, dtrain_job._build(cfg)[0]).shape == (4, 64)
    cfg = load_config({"model": {"preset": "tiny"}, "training": {"pipeline_parallel_size": 2}})
    assert dtrain_job._sample_input(cfg, dtrain_job._build(cfg)[0]) is None  # balanced by parameters: no sample
    # balanced by compute: the GPT's compute model takes the job's sequence length and microbatch from it
    cfg = load_config({"model": {"preset": "tiny"}, "data": {"block_size": 16},
                       "training": {"pipeline_parallel_size": 2, "pipeline_balance": "compute", "batch_size": 8,
                                    "microbatches": 2}})
    sample = dtrain_job._sample_input(cfg, dtrain_job._build(cfg)[0])
    assert sample.shape == (4, 16) and sample.dtype == torch.long


# ------------------------------------------------------------------ a run that is already complete
@pytest.mark.timeout(180)
def test_a_complete_run_run_again_says_so_and_trains_nothing(tmp_path, monkeypatch, caplog):
    from distributed_training import cli

    monkeypatch.chdir(tmp_path)
    config = {"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
              "training": {"max_steps": 2, "batch_size": 16}, "logging": {"progress": False},
              "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1}, "output": str(tmp_path / "final.pt")}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main([str(path)]) == 0
    marker = tmp_path / "ckpt" / "COMPLETED"
    assert marker.read_text() == "step 2\n"
    marker.unlink()  # as if the job had been stopped during its final evaluation and outputs (a trial: the
    (tmp_path / "final.pt").unlink()  # model file was then never written, and the restart called the run complete)
    before = sorted(os.listdir(tmp_path / "ckpt"))
    caplog.set_level(logging.INFO, logger="distributed_training")
    assert cli.main([str(path)]) == 0
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("dtrain: the run reached its end at step 2 (training.max_steps=2, checkpoint ")
               and "they follow now" in m for m in said), said
    # Nothing trained or saved but the final evaluation and outputs: the model file and the marker.
    assert not any(re.search(r"\| loss|the run is already complete", m) for m in said), said
    assert any("finished at step 2, validation loss" in m for m in said), said
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(before + ["COMPLETED"])
    assert (tmp_path / "final.pt").is_file() and marker.read_text() == "step 2\n"
    # Now complete: run again, it says so and does nothing.
    caplog.clear()
    (tmp_path / "final.pt").unlink()
    assert cli.main([str(path)]) == 0
    said = [r.getMessage() for r in caplog.records]
    complete = [m for m in said if "already complete" in m]
    assert len(complete) == 1 and complete[0].startswith("dtrain: the run is already complete at step 2 "
                                                         "(training.max_steps=2, checkpoint "), said
    assert "raise training.max_steps or training.epochs" in complete[0] and "checkpoint.resume: false" in complete[0]
    assert not any(re.search(r"resumed from|\| loss|finished at step|validation loss", m) for m in said), said
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(before + ["COMPLETED"])
    assert not (tmp_path / "final.pt").exists()
    # Raising max_steps trains on from there.
    caplog.clear()
    assert cli.main([str(path), "--set", "training.max_steps=3"]) == 0
    said = [r.getMessage() for r in caplog.records]
    assert any("resumed from step 2" in m for m in said) and any("finished at step 3" in m for m in said), said
    assert not any("already complete" in m for m in said), said


def test_a_tensor_parallel_size_that_does_not_divide_the_world_is_a_config_error(monkeypatch):
    """Said before any rendezvous as an invalid config naming the field (it was a traceback per rank)."""
    import distributed_training.cli as cli

    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = load_config({"model": {"preset": "tiny"}, "training": {"tensor_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"^training\.tensor_parallel_size=2 does not divide the world size 3"):
        cli.run_job(cfg)


@pytest.mark.parametrize("raw, field", [
    ({"training": {"strategy": "ddp"}, "communication": {"hierarchical": True, "ranks_per_node": 3}},
     r"^communication\.ranks_per_node=3 does not divide the world size 2"),
    pytest.param({"model": {"preset": "tiny"},
                  "training": {"strategy": "ddp", "pipeline_parallel_size": 2, "pipeline_cuda_graphs": True}},
                 r"^training\.pipeline_cuda_graphs needs CUDA devices",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    # (each was a ValueError traceback from every rank once the model was built)
    ({"model": {"preset": "tiny"}, "training": {"batch_size": None, "global_batch_size": 5}},
     r"^training\.global_batch_size: global_batch_size=5 cannot be split evenly over 2 data-parallel replicas"),
    ({"model": {"target": "examples.user_model:SmallConvNet"},
      "data": {"target": "examples.user_model:Digits", "kwargs": {"split": "train"}, "val_kwargs": {"split": "val"},
               "collate": "examples.user_model:collate"},
      "training": {"tensor_parallel_size": 2}},
     r"^training\.tensor_parallel_size=2 needs training\.tensor_parallel_plan for a SmallConvNet"),
])
def test_what_the_world_or_machine_cannot_run_is_a_config_error(monkeypatch, raw, field):
    """Said before any rendezvous as one line naming the field (each was a traceback per rank)."""
    import distributed_training.cli as cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=field):
        cli.run_job(load_config(raw))


@pytest.mark.parametrize("field, said", [
    ("evaluation.target={val_accuracy: 0.5}", "invalid config: evaluation.target names 'val_accuracy'"),
    # (was silently ignored: no best checkpoint kept while keep_last pruned the others)
    ("evaluation.best_metric=val_accuracy", "invalid config: evaluation.best_metric='val_accuracy' is none of the "
                                            "values the evaluation gives (val_loss, val_samples)"),
])
def test_an_evaluation_value_the_data_does_not_give_is_a_config_error(tmp_path, field, said):
    """With metrics read from the data (evaluation.metrics not given), a target or a best checkpoint's metric
    naming another metric is known only at the start of fit: still an invalid config naming the field, exit
    2 (it was a traceback, or nothing)."""
    import logging

    from distributed_training.cli import main
    from distributed_training.logs import get_logger

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        code = main([str(REPO / "examples/configs/user_model.yaml"), "--set", "evaluation.metrics=null", "--set",
                     "evaluation.target=null", "--set", "evaluation.best_metric=null", "--set", field, "--set",
                     "training.max_steps=12", "--set", f"checkpoint.dir={tmp_path}", "--set", "checkpoint.every=null"])
    finally:
        get_logger().removeHandler(handler)
    assert code == 2
    assert any(said in m for m in seen), seen


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_tensor_parallel_plan_that_does_not_fit_the_model_is_a_config_error(tmp_path, warm_torchrun):
    """Found when the plan is applied to the built model (on every rank): still one invalid-config line
    naming the field, exit 2, not a traceback per rank."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"model": {"preset": "tiny"}, "training": {
        "tensor_parallel_size": 2, "tensor_parallel_plan": {"nothing.*": "colwise"}}}))
    out = warm_torchrun("distributed_training", [str(path)], module=True, nproc=2, env=ENV, cwd=REPO, timeout=100)
    both = out.stdout + out.stderr
    assert out.returncode != 0
    assert both.count("invalid config: training.tensor_parallel_plan: pattern 'nothing.*' matches no module") == 1, both
    assert "ValueError" not in both, both  # (torchrun prints its own traceback for a worker that exits non-zero)


def test_the_start_line_counts_the_models_parameters_under_zero3_too(tmp_path):
    """Counted before the strategy moves them into its shards (a refactor once counted after: 0)."""
    import logging

    from distributed_training.cli import main
    from distributed_training.dtrain_job import _build
    from distributed_training.logs import get_logger

    raw = {"model": {"preset": "tiny"}, "training": {"strategy": "zero3", "max_steps": 1},
           "data": {"val_fraction": 0.01},  # the final validation of 10% of the text was 90% of the test
           "logging": {"progress": False}}
    expected = sum(p.numel() for p in _build(load_config(raw))[0].parameters())
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger, level = get_logger(), get_logger().level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert main([str(path)]) == 0
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any(f"with {expected:,} parameters, strategy zero3" in m for m in seen), seen[:3]


@pytest.mark.timeout(180)
def test_epochs_derived_from_max_steps_are_said_as_derived_on_resume(tmp_path, monkeypatch, caplog):
    """Raising training.max_steps past an epoch makes dtrain train more epochs than training.epochs; the
    resume listed that as "epochs: 1 -> 2", a change the user never made."""
    from distributed_training import cli

    monkeypatch.chdir(tmp_path)
    config = {"model": {"preset": "classifier"}, "data": {"dataset": "digits", "val_fraction": 0.9},
              "training": {"max_steps": 2, "batch_size": 64}, "logging": {"progress": False},
              "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main([str(path)]) == 0
    caplog.set_level(logging.INFO, logger="distributed_training")
    assert cli.main([str(path), "--set", "training.max_steps=5"]) == 0  # 3 steps an epoch: 2 epochs
    changed = [r.getMessage() for r in caplog.records if "configuration changed" in r.getMessage()]
    assert len(changed) == 1 and "max_steps: 2 -> 5" in changed[0], changed
    assert "epochs: 1 -> 2 (derived from training.max_steps)" in changed[0], changed


@pytest.mark.timeout(120)
@pytest.mark.parametrize("section, field, value, said", [
    ("checkpoint", "dir", "a_file", "is a file"),
    ("checkpoint", "dir", "a_file/ckpt", "is a file"),
    ("logging", "dir", "a_file", "is a file"),
    ("output", None, "a_dir", "is a directory"),
    ("output", None, "a_file/model.pt", "is a file"),
])
def test_a_path_the_job_cannot_write_is_a_config_error_before_training(tmp_path, monkeypatch, section, field,
                                                                         value, said):
    """checkpoint.dir naming a file failed at the first save, and an output naming a directory after the
    whole run (its model never written), each with a traceback per rank: now one line naming the field,
    before anything trains."""
    from distributed_training import cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "a_dir").mkdir()
    config = {"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
              "training": {"max_steps": 1}, "logging": {"progress": False}}
    if field is None:
        config[section] = value
    else:
        config[section] = {field: value}
    name = section if field is None else f"{section}.{field}"
    with pytest.raises(ConfigError, match=rf"^{re.escape(name)}: '{re.escape(value)}' .*{said}"):
        cli.run_job(load_config(config))


@pytest.mark.parametrize("communication, cap", [
    ({}, 25.0), ({"compression": "topk"}, 100.0), ({"compression": "bf16"}, 25.0),
    ({"compression": "topk", "bucket_cap_mb": 40}, 40.0), ({"bucket_cap_mb": 40}, 40.0),
])
def test_dtrain_buckets_default_as_ddps_do(communication, cap):
    """communication.bucket_cap_mb defaulted to 25 and was always passed, so dtrain's Top-K ran in 25 MiB
    buckets where DDP (and the README) default to Top-K's 100 (its selection 2.4x slower per step)."""
    from distributed_training.dtrain_job import _job_strategy
    from distributed_training.strategies.ddp_buckets import resolve_bucket_cap_mb

    for strategy in ("ddp", "zero1"):
        built, _ = _job_strategy(load_config({"training": {"strategy": strategy}, "communication": communication}), 2)
        assert resolve_bucket_cap_mb(built.ddp_kwargs["bucket_cap_mb"], built.ddp_kwargs["communication"]) == cap


@pytest.mark.timeout(300)
def test_a_log_step_is_one_line_when_the_progress_is_plain_lines(choice_jobs):
    """Output to a file or pipe: the progress is a plain line per log step with its loss, and dtrain's own
    ``step N | loss`` line said every step a second time."""
    out, _ = _choice_job(choice_jobs, "plain_lines")
    progress = [line for line in out.splitlines() if re.match(r"^step \d+/6 \(\d+%\)", line)]
    assert len(progress) >= 3 and all("| loss " in line for line in progress[1:]), out[-3000:]
    assert not re.search(r"^step +\d+ \| loss", out, re.M), out[-3000:]  # rank 0's lines: this job's part


def test_a_job_without_a_validation_set_says_so_and_classifier_metrics_need_class_targets(tmp_path):
    """Your own data without a validation set ended with "validation loss nan", and with evaluation.every
    evaluated 0 samples every time (best.json kept NaN); classifier metrics on a regression's float targets
    failed at the first evaluation, after training, with a traceback per rank."""
    import logging

    from distributed_training.cli import main
    from distributed_training.logs import get_logger

    (tmp_path / "regression.py").write_text(
        "import torch\n\nclass Points(torch.utils.data.Dataset):\n    def __len__(self):\n        return 16\n\n"
        "    def __getitem__(self, i):\n        g = torch.Generator().manual_seed(i)\n"
        "        return torch.randn(4, generator=g), torch.randn((), generator=g)\n\n"
        "def model():\n    return torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Flatten(0))\n")
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"target": "regression:model"}, "data": {"target": "regression:Points", "val_fraction": 0},
        "loss": {"target": "torch.nn:MSELoss"}, "training": {"max_steps": 2, "batch_size": 4},
        "logging": {"progress": False, "dir": None}, "checkpoint": {"dir": None}, "output": None}))
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    level = get_logger().level
    get_logger().addHandler(handler)
    get_logger().setLevel(logging.INFO)
    try:
        trained = main([str(config)])
        said_trained = list(seen)
        every = main([str(config), "--set", "evaluation.every=1"])
        said_every = seen[len(said_trained):]
        accuracy = main([str(config), "--set", "data.val_fraction=0.25", "--set", "evaluation.metrics=[accuracy]"])
        said_accuracy = seen[len(said_trained) + len(said_every):]
    finally:
        get_logger().removeHandler(handler)
        get_logger().setLevel(level)
    assert trained == 0 and any("dtrain: finished at step 2 (no validation set" in m for m in said_trained), seen
    assert not any("nan" in m for m in said_trained), said_trained
    assert every == 2 and any("invalid config: evaluation.every needs a validation set, and this job's is empty" in m
                              for m in said_every), said_every
    assert accuracy == 2 and any(
        "invalid config: evaluation.metrics: accuracy is for classifiers (integer classes: one per sample or per position), but the "
        "validation set's first target is a float32 tensor of shape ()" in m for m in said_accuracy), said_accuracy

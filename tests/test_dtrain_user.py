"""`dtrain` on the user's own model, data, collate function and loss, named by import path in the config
(`distributed_training.user_job`): trained under DDP and ZeRO-3, in one process and under torchrun on 2
ranks, the final parameters equal to a plain one-process loop over the same global batches; and every
failure to import or call the user's code said as the field, the path and the cause."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from distributed_training import cli, dtrain_epochs, dtrain_job
from distributed_training.config import ConfigError, load_config
from distributed_training.user_job import UserCodeError

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
PACKAGE = "userjob_pkg"  # a name no other test imports: the module is cached once imported

PARTS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self, d_in, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, width), nn.Linear(width, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def build(d_in, width):
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return Net(d_in, width)


class Regressor(nn.Module):
    """Returns its own loss: the batch is its input (x, y)."""

    def __init__(self, d_in):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, 8), nn.Linear(8, 1)

    def forward(self, x, y):
        return ((self.fc2(torch.tanh(self.fc1(x))).squeeze(-1) - y) ** 2).mean()


class Points:
    """Map-style, not a torch Dataset, with dict samples (a collate function makes the batches)."""

    def __init__(self, n, d_in, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d_in, generator=g)
        self.y = (self.x.sum(1) > 0).long() + (self.x[:, 0] > 1).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset of (x, y) pairs, y a float target."""

    def __init__(self, n, d_in, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d_in, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, d_in)

    def __iter__(self):
        return iter(zip(self.x, self.y))


def collate(samples, scale=1.0):
    return torch.stack([s["x"] for s in samples]) * scale, torch.stack([s["y"] for s in samples])


class SmoothedCE:
    def __init__(self, smoothing=0.0):
        self.smoothing = smoothing

    def __call__(self, outputs, targets):
        return F.cross_entropy(outputs, targets, label_smoothing=self.smoothing)


def number():
    return 7
'''

D_IN, WIDTH, N, BATCH, STEPS, LR, SEED = 6, 16, 48, 4, 8, 0.01, 3


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """A directory holding the user's package and (written by the tests) their YAML files: the
    config file's directory is what makes the package importable."""
    root = tmp_path_factory.mktemp("user")
    (root / PACKAGE).mkdir()
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "parts.py").write_text(PARTS)
    (root / PACKAGE / "broken.py").write_text("import not_installed_anywhere_xyz\n")
    yield root
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    while str(root) in sys.path:
        sys.path.remove(str(root))


def _config(kind: str, strategy: str, out: Path) -> dict:
    """A job on the user's parts: `map` (Points, a collate with kwargs, a loss class with kwargs, a
    validation set from the same factory) or `iterable` (Stream, the model's own loss)."""
    common = {"strategy": strategy, "max_steps": STEPS, "batch_size": BATCH, "lr": LR, "seed": SEED,
              "gradient_clip_val": None}
    if kind == "map":
        return {
            "model": {"target": f"{PACKAGE}.parts:build", "kwargs": {"d_in": D_IN, "width": WIDTH}},
            "data": {"target": f"{PACKAGE}.parts:Points", "kwargs": {"n": N, "d_in": D_IN},
                     "val_kwargs": {"n": 20, "d_in": D_IN, "seed": 1},
                     "collate": f"{PACKAGE}.parts:collate", "collate_kwargs": {"scale": 2.0}},
            "loss": {"target": f"{PACKAGE}.parts:SmoothedCE", "kwargs": {"smoothing": 0.1}},
            "training": common, "logging": {"progress": False}, "output": str(out),
        }
    return {
        "model": {"target": f"{PACKAGE}.parts.Regressor", "kwargs": {"d_in": D_IN}},
        "data": {"target": f"{PACKAGE}.parts:Stream", "kwargs": {"n": N, "d_in": D_IN}},
        "training": common, "logging": {"progress": False}, "output": str(out),
    }


def _reference(kind: str, world: int, root: Path) -> dict[str, torch.Tensor]:
    """One process over the whole global batch (world x BATCH samples a step) in the order dtrain's
    ranks read them: a map-style set in the epoch's permutation (seed + epoch), an iterable in order."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import importlib

    parts = importlib.import_module(f"{PACKAGE}.parts")
    torch.manual_seed(SEED)
    model = parts.build(D_IN, WIDTH) if kind == "map" else parts.Regressor(D_IN)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    if kind == "map":
        data, loss = parts.Points(N, D_IN), parts.SmoothedCE(0.1)
    else:
        data = parts.Stream(N, D_IN)
    glob, step, epoch = world * BATCH, 0, 0
    assert N % glob == 0  # every rank's batches are whole: the mean of the means is the global mean
    while step < STEPS:
        if kind == "map":
            order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + epoch)).tolist()
            samples = [data[i] for i in order]
        else:
            samples = list(data)
        for start in range(0, N, glob):
            if step == STEPS:
                break
            chunk = samples[start:start + glob]
            if kind == "map":
                x, y = parts.collate(chunk, scale=2.0)
                value = loss(model(x), y)
            else:
                value = model(torch.stack([s[0] for s in chunk]), torch.stack([s[1] for s in chunk]))
            opt.zero_grad()
            value.backward()
            opt.step()
            step += 1
        epoch += 1
    return model.state_dict()


def _assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst <= 1e-5, worst


def _write(root: Path, name: str, config: dict) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ------------------------------------------------------------------ training, against one process
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_user_parts_train_like_a_plain_loop_in_one_process(jobs, tmp_path, monkeypatch, kind, strategy):
    monkeypatch.chdir(tmp_path)  # the package is found through the config file's directory only
    out = tmp_path / "final.pt"
    path = _write(jobs, f"{kind}_{strategy}", _config(kind, strategy, out))
    assert cli.main([str(path)]) == 0
    got = torch.load(out)
    want = _reference(kind, 1, jobs)
    _assert_same(got, want)
    # It trained: the reference moved away from the initial weights.
    torch.manual_seed(SEED)
    assert any((v - w).abs().max() > 1e-3 for v, w in zip(want.values(), _initial(kind, jobs).values()))


def _initial(kind, root):
    import importlib

    parts = importlib.import_module(f"{PACKAGE}.parts")
    torch.manual_seed(SEED)
    return (parts.build(D_IN, WIDTH) if kind == "map" else parts.Regressor(D_IN)).state_dict()


TWO_RANK_JOBS = [("map", "zero3"), ("iterable", "ddp")]
# The dtrain jobs one after another in one torchrun launch (tests/jobs/dtrain_jobs.py; rank 0 marks where
# each job's output starts on stdout and on stderr: the tests read stderr).
DTRAIN_JOBS = (Path(__file__).parent / "jobs" / "dtrain_jobs.py").read_text()


@pytest.fixture(scope="module")
def two_rank_runs(jobs, tmp_path_factory, warm_python):
    """Every (kind, strategy) of TWO_RANK_JOBS trained by dtrain under torchrun on 2 ranks, in one launch
    started in a directory of its own (the package found through the config files' directory only):
    {(kind, strategy): (final model path, rank 0's stderr for that job)}, and the launch's result."""
    import json
    import re

    from distributed_training.testing import _torchrun_env

    work = tmp_path_factory.mktemp("two_ranks")
    paths, outs = [], {}
    for kind, strategy in TWO_RANK_JOBS:
        outs[kind, strategy] = work / f"final_{kind}_{strategy}.pt"
        paths.append([str(_write(jobs, f"two_{kind}_{strategy}", _config(kind, strategy, outs[kind, strategy])))])
    script = work / "dtrain_jobs.py"
    script.write_text(DTRAIN_JOBS)
    run = warm_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
                       json.dumps(paths)], cwd=work, env=_torchrun_env(ENV), timeout=240)
    said = re.split(r"^==== dtrain job \d+$", run.stderr, flags=re.M)[1:]
    return {job: (outs[job], said[k] if k < len(said) else "") for k, job in enumerate(TWO_RANK_JOBS)}, run


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, strategy", TWO_RANK_JOBS)
def test_user_parts_under_torchrun_on_two_ranks_train_like_one_process(jobs, two_rank_runs, kind, strategy):
    runs, run = two_rank_runs
    out, said = runs[kind, strategy]
    both = run.stdout + run.stderr
    assert said, both[-3000:]  # the job started (the one before it ended well)
    assert f"finished at step {STEPS}" in said, said[-3000:]
    assert run.returncode == 0, both[-3000:]
    _assert_same(torch.load(out), _reference(kind, 2, jobs))


def test_the_example_runs_as_written(monkeypatch, tmp_path):
    monkeypatch.chdir(REPO)
    out = tmp_path / "example.pt"
    ckpt = tmp_path / "ckpt"  # not the example's checkpoints/ in the repository
    assert cli.main(["examples/configs/user_model.yaml", "--set", "training.max_steps=21", "--set",
                     f"checkpoint.dir={ckpt}", "--set", f"output={out}"]) == 0
    assert "head.weight" in torch.load(out)
    assert (ckpt / "best.json").is_file() and (ckpt / "step_000000020").is_dir()


# ------------------------------------------------------------------ errors
def _job(**sections) -> dict:
    base = {"model": {"target": f"{PACKAGE}.parts:build", "kwargs": {"d_in": D_IN, "width": WIDTH}},
            "data": {"target": f"{PACKAGE}.parts:Points", "kwargs": {"n": N, "d_in": D_IN},
                     "collate": f"{PACKAGE}.parts:collate"},
            "loss": {"target": "torch.nn.functional:cross_entropy"}}
    for name, fields in sections.items():
        base[name] = {**base.get(name, {}), **fields}
    return base


@pytest.mark.parametrize("sections, message", [
    ({"model": {"target": "no_such_pkg_xyz.models:build"}},
     r"^model\.target: cannot import 'no_such_pkg_xyz\.models:build': no module named 'no_such_pkg_xyz'"),
    ({"model": {"target": f"{PACKAGE}.parts:biuld"}},
     rf"^model\.target: cannot import '{PACKAGE}\.parts:biuld': '{PACKAGE}\.parts' has no attribute 'biuld' "
     r"\(did you mean 'build'"),
    ({"model": {"target": f"{PACKAGE}.broken:build"}},
     rf"^model\.target: importing '{PACKAGE}\.broken' for .* raised ModuleNotFoundError: No module named "
     r"'not_installed_anywhere_xyz' \(at .*broken\.py:1\)"),
    ({"model": {"kwargs": {"d_in": D_IN, "width": 0}}},
     rf"^model\.target: {PACKAGE}\.parts:build\(\*\*model\.kwargs\) raised ValueError: width must be >= 1, got 0 "
     r"\(at .*parts\.py:\d+\)"),
    ({"model": {"kwargs": {"d_in": D_IN, "depth": 2}}},
     r"^model\.target: .*raised TypeError: build\(\) got an unexpected keyword argument 'depth'$"),
    ({"model": {"target": f"{PACKAGE}.parts:number", "kwargs": {}}},
     rf"^model\.target: {PACKAGE}\.parts:number returned a int, not a torch\.nn\.Module"),
    ({"data": {"target": f"{PACKAGE}.parts:number", "kwargs": {}}}, r"^data\.target: .* returned a int, not a dataset"),
    ({"data": {"collate": f"{PACKAGE}.parts:colate"}}, r"^data\.collate: .*has no attribute 'colate'"),
    ({"data": {"collate": None}},
     rf"^data\.target: the samples of {PACKAGE}\.parts:Points are dicts \(keys 'x', 'y'\), and loss\.target "
     r"torch\.nn\.functional:cross_entropy takes \(inputs, targets\) batches: give data\.collate"),
    ({"loss": {"target": f"{PACKAGE}.parts:collate", "kwargs": {"bogus": 1}}},
     r"^loss\.target: loss\.kwargs do not fit .*parts:collate"),
    ({"training": {"pipeline_parallel_size": 2}},
     r"^model\.target: training\.pipeline_parallel_size=2 cuts the model into stages, but chain\(\) cannot cut"),
])
def test_user_code_failures_name_the_field_the_path_and_the_cause(jobs, sections, message):
    if str(jobs) not in sys.path:
        sys.path.insert(0, str(jobs))
    with pytest.raises(UserCodeError, match=message):
        dtrain_job._build(load_config(_job(**sections)))


@pytest.mark.parametrize("raw, message", [
    ({"model": {"target": "build"}}, r"^model\.target: value error, an import path looks like 'package\.module:name'"),
    ({"model": {"target": "a.b:c", "preset": "tiny"}}, r"^model\.target builds your own model: model\.preset"),
    ({"model": {"target": "a.b:c", "dropout": 0.1, "channels_last": True}},  # (were silently ignored: a trial)
     r"^model\.target builds your own model: model\.dropout, model\.channels_last"),
    ({"model": {"kwargs": {"width": 3}}}, r"^model\.kwargs are the arguments of model\.target"),
    ({"data": {"val_kwargs": {"split": "val"}}}, r"^data\.val_kwargs go with data\.target"),
    ({"data": {"target": "a.b:c", "block_size": 8}}, r"^data\.target reads your own data: data\.block_size"),
    ({"data": {"target": "a.b:c", "val_kwargs": {}, "val_fraction": 0.2}}, r"^data\.val_fraction splits"),
    ({"loss": {"kwargs": {"x": 1}}}, r"^loss\.kwargs are the arguments of loss\.target"),
    ({"data": {"target": "a.b:c"}, "training": {"batch_size": "auto"}}, r"^training\.batch_size 'auto' with data"),
])
def test_config_rules_of_the_user_fields_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_config(raw)


def test_a_user_code_error_ends_dtrain_with_status_2_said_once(jobs, tmp_path, monkeypatch):
    said = []
    monkeypatch.setattr(cli, "_report_once", said.append)
    path = _write(tmp_path, "bad", {"model": {"target": "no_such_pkg_xyz:build"}})
    assert cli.main([str(path)]) == 2
    assert len(said) == 1 and said[0].startswith("dtrain: invalid config: model.target: cannot import"), said


FLAKY = '''
import torch


class Flaky(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 7:
            raise ValueError("bad record 7")
        return torch.randn(8), torch.tensor(i % 2)


def model():
    return torch.nn.Linear(8, 2)
'''


@pytest.mark.slow
def test_an_error_on_one_rank_is_said_and_ends_the_job_under_torchrun(tmp_path, warm_torchrun):
    """The rank whose dataset raises closes without the final barrier (its peer is in a step's collective,
    which the barrier would never meet): the job ends at once with the error, not at the collective
    timeout with the error unsaid."""
    (tmp_path / "flaky_pkg.py").write_text(FLAKY)
    job = tmp_path / "job.yaml"
    job.write_text("model: {target: flaky_pkg:model}\ndata: {target: flaky_pkg:Flaky}\n"
                   "loss: {target: torch.nn:CrossEntropyLoss}\n"
                   "training: {epochs: 1, batch_size: 4, timeout_s: 300}\nlogging: {progress: false}\n")
    started = time.monotonic()
    run = warm_torchrun("distributed_training", [str(job)], module=True, nproc=2, env=ENV, cwd=tmp_path, timeout=120)
    took = time.monotonic() - started
    assert run.returncode != 0 and "ValueError: bad record 7" in run.stderr, run.stderr[-3000:]
    assert took < 60, took  # the collective timeout is 300 s


def test_a_printed_config_loads_back_and_takes_the_newer_fields():
    """`--print-config` spells every default out: those are no choices, so the effective config of a user-model
    job loads back, and a printed template takes optimizer.lr or global_batch_size without a conflict with the
    defaults of training.lr / training.batch_size; a value the user did set still conflicts."""
    from distributed_training.config import ConfigError, dump_config, load_config

    job = load_config(str(REPO / "examples" / "configs" / "user_model.yaml"))
    again = load_config(yaml.safe_load(dump_config(job)))
    assert again == job
    template = yaml.safe_load(dump_config(load_config({})))
    template["optimizer"]["lr"] = 0.01
    template["training"]["global_batch_size"] = 32
    load_config(template)
    with pytest.raises(ConfigError, match=r"training.lr \(0.5\) and optimizer.lr \(0.05\) disagree"):
        load_config(str(REPO / "examples" / "configs" / "user_model.yaml"), ["training.lr=0.5"])


# ------------------------------------------------------------------ from session 34's dtrain trial
def test_classifier_metrics_without_a_loss_target_are_a_config_error(jobs, monkeypatch):
    """The model computes its own loss (no loss.target): evaluation.metrics [accuracy] failed with a traceback
    at the final evaluation, after the whole run (output and COMPLETED never written)."""
    said = []
    monkeypatch.setattr(cli, "_report_once", said.append)
    path = _write(jobs, "own_loss_metrics", _job(loss={"target": None}, evaluation={"metrics": ["accuracy"]}))
    assert cli.main([str(path)]) == 2
    assert said and said[0].startswith("dtrain: invalid config: evaluation.metrics: accuracy compares"), said


def test_a_model_returning_logits_without_a_loss_target_is_said_in_the_configs_terms(jobs, monkeypatch, tmp_path):
    """It was a traceback from every rank at the first step, telling the user to pass criterion= (the Python
    API's argument)."""
    said = []
    monkeypatch.setattr(cli, "_report_once", said.append)
    path = _write(jobs, "logits_no_loss", _job(loss={"target": None}, training={"max_steps": 2},
                                               checkpoint={"dir": str(tmp_path / "ckpt")}))
    assert cli.main([str(path)]) == 2
    assert said and said[0].startswith("dtrain: invalid config: loss.target is not set") and "criterion=" not in said[0]


def test_max_steps_counts_from_a_checkpoint_of_another_batch_size():
    """Resumed at a smaller batch, the run's epochs were derived as if from step 0 while the checkpoint's epoch
    counted the old run's larger epochs: it stopped early or said the run was already complete."""
    resumed = {"step": 300, "epoch": 13, "batch_in_epoch": 0}
    assert dtrain_epochs.epochs_for(1, 400, list(range(100)), 4, 1, resumed=resumed) == 13 + 4  # 25 steps an epoch
    assert dtrain_epochs.epochs_for(1, 400, list(range(100)), 4, 1, resumed={**resumed, "batch_in_epoch": 3}) == 18
    assert dtrain_epochs.epochs_for(1, 400, list(range(100)), 4, 1) == 16

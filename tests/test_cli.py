"""The `dtrain` command: YAML configs validated field by field, and the examples under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distributed_training.config import ConfigError, JobConfig, load_config

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _run(args, timeout=180, **kw):
    out = subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout, **kw)
    return out.returncode, out.stdout + out.stderr


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


def test_help_and_print_config():
    code, out = _run([sys.executable, "-m", "distributed_training", "--help"], timeout=60)
    assert code == 0 and "training:" in out and "torchrun" in out and "--set" in out, out
    code, out = _run([sys.executable, "-m", "distributed_training", "--print-config", "--set", "training.lr=0.5"], timeout=60)
    assert code == 0, out
    assert yaml.safe_load(out)["training"]["lr"] == 0.5
    code, out = _run([sys.executable, "-m", "distributed_training", "examples/configs/gpt_cpu.yaml",
                      "--set", "training.batch_size=0"], timeout=60)
    assert code == 2 and "training.batch_size" in out, out


@pytest.mark.timeout(240)
def test_dtrain_trains_under_torchrun_and_marks_completion(tmp_path):
    config = {
        "model": {"preset": "tiny"},
        "data": {"dataset": "repo_text", "block_size": 32},
        "training": {"strategy": "zero2", "epochs": 1, "max_steps": 4, "batch_size": 4, "seed": 0},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 2},
        "output": str(tmp_path / "final.pt"),
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      "-m", "distributed_training", str(path)])
    assert code == 0, out[-3000:]
    assert "finished at step 4" in out, out[-2000:]
    assert (tmp_path / "ckpt" / "COMPLETED").is_file() and (tmp_path / "final.pt").is_file()
    assert {"step_000000002", "step_000000004"} <= set(os.listdir(tmp_path / "ckpt"))


@pytest.mark.timeout(240)
def test_dtrain_auto_strategy_auto_batch_bf16_checkpointed_blocks(tmp_path):
    config = {
        "model": {"preset": "tiny"},
        "data": {"dataset": "repo_text", "block_size": 32},
        "training": {"strategy": "auto", "batch_size": "auto", "precision": "bf16", "activation_checkpointing": True,
                     "memory_budget_gb": 0.02, "epochs": 1, "max_steps": 3, "seed": 0},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      "-m", "distributed_training", str(path)])
    assert code == 0, out[-3000:]
    assert re.search(r"strategy auto -> ddp \(", out), out[-3000:]
    match = re.search(r"batch_size auto -> (\d+) per rank \(estimated", out)
    assert match and int(match.group(1)) >= 1, out[-3000:]
    assert "finished at step 3" in out, out[-2000:]


@pytest.mark.timeout(240)
def test_digits_example_learns():
    code, out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                      "examples/train_digits.py", "--epochs", "2"])
    assert code == 0, out[-3000:]
    match = re.search(r"accuracy ([\d.]+) -> ([\d.]+)", out)
    assert match, out[-2000:]
    before, after = map(float, match.groups())
    assert after > 0.85 and after > before + 0.5, (before, after)

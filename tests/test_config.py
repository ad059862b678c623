"""The job config: scientific notation, strict types and bounds, errors that name the field path."""

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


def _dtrain(*args, timeout=60):
    out = subprocess.run([sys.executable, "-m", "distributed_training", *args], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


def test_scientific_notation_in_files_and_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("training:\n  lr: 1e-3\n  weight_decay: 1E-2\n  max_steps: 1e3\n  timeout_s: 6e+2\n")
    cfg = load_config(str(path))
    assert cfg.training.lr == 1e-3 and cfg.training.weight_decay == 0.01
    assert cfg.training.max_steps == 1000 and isinstance(cfg.training.max_steps, int)
    assert cfg.training.timeout_s == 600.0
    # The --set example of `dtrain --help`; a dict read by plain yaml.safe_load holds such numbers as text.
    assert load_config(str(path), ["training.lr=3e-4"]).training.lr == 3e-4
    assert load_config(yaml.safe_load("training: {lr: 3e-4}")).training.lr == 3e-4
    code, out, err = _dtrain("--print-config", "--set", "training.lr=3e-4", "--set", "data.block_size=1.28e2")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed["training"]["lr"] == 3e-4 and printed["data"]["block_size"] == 128


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"output": 5}, "output"),
        ({"output": ""}, "output"),
        ({"training": {"activation_checkpointing": "no"}}, "training.activation_checkpointing"),
        ({"logging": {"progress": "yes"}}, "logging.progress"),
        ({"communication": {"error_feedback": 0}}, "communication.error_feedback"),
        ({"training": {"seed": "abc"}}, "training.seed"),
        ({"training": {"seed": -1}}, "training.seed"),
        ({"training": {"epochs": True}}, "training.epochs"),
        ({"training": {"epochs": 1.5}}, "training.epochs"),
        ({"training": {"lr": "fast"}}, "training.lr"),
        ({"training": {"lr": float("nan")}}, "training.lr"),
        ({"training": {"timeout_s": float("inf")}}, "training.timeout_s"),
        ({"training": {"weight_decay": -0.1}}, "training.weight_decay"),
        ({"training": {"max_steps": 0}}, "training.max_steps"),
        ({"training": {"gradient_clip_val": 0}}, "training.gradient_clip_val"),
        ({"model": {"n_layer": 0}}, "model.n_layer"),
        ({"model": {"n_embd": 30}}, "model.n_embd"),  # not a multiple of the small preset's 4 heads
        ({"model": {"dropout": 1.0}}, "model.dropout"),
        ({"data": {"block_size": 10**6}}, "data.block_size"),
        ({"data": {"block_size": 0}}, "data.block_size"),
        ({"checkpoint": {"dir": 5}}, "checkpoint.dir"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last"),
        ({"logging": {"every": "often"}}, "logging.every"),
        ({"communication": {"ranks_per_node": 0}}, "communication.ranks_per_node"),
        ({"communication": {"ranks_per_node": 2}}, "communication.ranks_per_node"),
        ({"logging": {"colour": True}}, "logging.colour"),
    ],
)
def test_every_field_is_type_checked_and_named(raw, field):
    with pytest.raises(ConfigError, match=rf"(^|\W){re.escape(field)}\b") as info:
        load_config(raw)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_type_error_fails_before_any_training():
    code, out, err = _dtrain("examples/configs/gpt_cpu.yaml", "--set", "output=5")
    assert code == 2, out + err
    assert "output" in err and "step" not in out + err.replace("training.max_steps", ""), out + err


def test_sections_left_empty_keep_their_defaults():
    cfg = load_config(yaml.safe_load("training:\nmodel:\n  preset: tiny\n"))
    assert cfg.training == JobConfig().training and cfg.model.preset == "tiny"


@pytest.mark.slow
def test_print_config_prints_every_field_with_its_default():
    code, out, err = _dtrain("--print-config")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed == JobConfig().model_dump()
    for section, info in JobConfig.model_fields.items():
        fields = getattr(info.annotation, "model_fields", None)
        if fields:
            assert set(printed[section]) == set(fields), section
    # The field descriptions are the documentation: they come along as comments.
    assert "# AdamW's learning rate." in out
    # What it prints is a valid config that loads back to the same values.
    job = yaml.safe_load(out)
    assert load_config(job).model_dump() == printed

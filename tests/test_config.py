"""The job config: scientific notation, strict types and bounds, errors that name the field path."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from distributed_training.config import ConfigError, JobConfig, load_config

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}


def _dtrain(warm_python, *args, timeout=60):
    """``python -m distributed_training *args`` at the repository root (forked from the warm_python fixture's server)."""
    out = warm_python(["-m", "distributed_training", *args], cwd=REPO, env=ENV, timeout=timeout)
    return out.returncode, out.stdout, out.stderr


def test_scientific_notation_in_files_and_overrides(tmp_path, warm_python):
    path = tmp_path / "job.yaml"
    path.write_text("training:\n  lr: 1e-3\n  weight_decay: 1E-2\n  max_steps: 1e3\n  timeout_s: 6e+2\n")
    cfg = load_config(str(path))
    assert cfg.training.lr == 1e-3 and cfg.training.weight_decay == 0.01
    assert cfg.training.max_steps == 1000 and isinstance(cfg.training.max_steps, int)
    assert cfg.training.timeout_s == 600.0
    # The --set example of `dtrain --help`; a dict read by plain yaml.safe_load holds such numbers as text.
    assert load_config(str(path), ["training.lr=3e-4"]).training.lr == 3e-4
    assert load_config(yaml.safe_load("training: {lr: 3e-4}")).training.lr == 3e-4
    code, out, err = _dtrain(warm_python, "--print-config", "--set", "training.lr=3e-4", "--set", "data.block_size=1.28e2")
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
        ({"training": {"pipeline_parallel_size": 0}}, "training.pipeline_parallel_size"),
        ({"training": {"pipeline_parallel_size": "two"}}, "training.pipeline_parallel_size"),
        ({"training": {"pipeline_schedule": "zb-v"}}, "training.pipeline_schedule"),
        ({"training": {"microbatches": 0}}, "training.microbatches"),
        ({"training": {"pipeline_chunks": 0}}, "training.pipeline_chunks"),
        ({"training": {"pipeline_split_points": "block.2"}}, "training.pipeline_split_points"),
        ({"training": {"pipeline_split_points": [""]}}, "training.pipeline_split_points"),
        ({"training": {"pipeline_half_blocks": "maybe"}}, "training.pipeline_half_blocks"),
        ({"training": {"tensor_parallel_size": 0}}, "training.tensor_parallel_size"),
        ({"training": {"sequence_parallel": "yes"}}, "training.sequence_parallel"),
        ({"training": {"tensor_parallel_plan": ["blocks.*"]}}, "training.tensor_parallel_plan"),
    ],
)
def test_every_field_is_type_checked_and_named(raw, field):
    with pytest.raises(ConfigError, match=rf"(^|\W){re.escape(field)}\b") as info:
        load_config(raw)
    assert "\n" not in str(info.value)


def _pipeline(**fields):
    return {"training": {"pipeline_parallel_size": 2, **fields}}


@pytest.mark.parametrize(
    "raw, field",
    [
        # The trainer's own rules (PipelineOptions), said with the config's paths.
        (_pipeline(pipeline_parallel_size=4, microbatches=3), "training.microbatches"),
        (_pipeline(pipeline_schedule="zbh1", microbatches=1), "training.microbatches"),
        (_pipeline(pipeline_schedule="interleaved_1f1b", microbatches=3), "training.microbatches"),
        (_pipeline(pipeline_schedule="interleaved_1f1b", pipeline_chunks=1, microbatches=4), "training.pipeline_chunks"),
        (_pipeline(pipeline_chunks=2), "training.pipeline_chunks"),  # 1f1b runs one chunk per rank
        (_pipeline(pipeline_split_points=["block.1", "block.2"]), "training.pipeline_split_points"),
        # What the pipeline does not run, or cannot: said before anything starts.
        (_pipeline(strategy="auto"), "training.strategy"),
        (_pipeline(gradient_accumulation_steps=2), "training.gradient_accumulation_steps"),
        (_pipeline(batch_size="auto"), "training.batch_size"),
        (_pipeline(batch_size=4, microbatches=8), "training.microbatches"),
        (_pipeline(pipeline_cuda_graphs=True, strategy="zero2"), "training.pipeline_cuda_graphs"),
        (_pipeline(pipeline_compile_loss="yes"), "training.pipeline_compile_loss"),
        ({"training": {"pipeline_compile_loss": True}}, "training.pipeline_compile_loss"),  # no pipeline
        (_pipeline(pipeline_cuda_graphs=True, strategy="ddp", activation_checkpointing=True),
         "training.pipeline_cuda_graphs"),
        (_pipeline(pipeline_cuda_graphs=True, strategy="ddp", tensor_parallel_size=2), "training.pipeline_cuda_graphs"),
        ({"training": {"pipeline_cuda_graphs": True}}, "training.pipeline_cuda_graphs"),  # no pipeline
    ],
)
def test_pipeline_fields_that_disagree_are_named(raw, field):
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}\b") as info:
        load_config(raw)
    assert "\n" not in str(info.value)


def _tensor(**fields):
    return {"training": {"tensor_parallel_size": 2, **fields}}


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"training": {"sequence_parallel": True}}, "training.sequence_parallel"),
        (_tensor(strategy="auto"), "training.strategy"),
        (_tensor(tensor_parallel_plan={"blocks.*.mlp.0": "sideways"}), "training.tensor_parallel_plan"),
        ({"training": {"tensor_parallel_plan": {"lm_head": "sideways"}}}, "training.tensor_parallel_plan"),  # TP 1 too
        ({**_tensor(sequence_parallel=True), "data": {"block_size": 63}}, "training.sequence_parallel"),
    ],
)
def test_tensor_fields_that_disagree_are_named(raw, field):
    raw["training"].setdefault("strategy", "ddp")
    with pytest.raises(ConfigError, match=rf"^{re.escape(field)}\b") as info:
        load_config(raw)
    assert "\n" not in str(info.value)


def test_pipeline_fields_default_to_the_trainers_and_load():
    import inspect

    from distributed_training import DistributedTrainer

    trainer = inspect.signature(DistributedTrainer).parameters
    training = JobConfig().training
    for name in ("tensor_parallel_size", "tensor_parallel_plan", "sequence_parallel",
                 "pipeline_parallel_size", "pipeline_schedule", "microbatches", "pipeline_split_points",
                 "pipeline_chunks", "pipeline_balance", "pipeline_half_blocks", "pipeline_cuda_graphs",
                 "pipeline_compile_loss"):
        assert getattr(training, name) == trainer[name].default, name
    # GPipe may run fewer microbatches than stages (wasteful, not wrong); split points load as a list.
    cfg = load_config(_pipeline(pipeline_schedule="gpipe", microbatches=1, pipeline_split_points=["block.2"]))
    assert (cfg.training.microbatches, cfg.training.pipeline_split_points) == (1, ["block.2"])
    cfg = load_config(_pipeline(pipeline_schedule="interleaved_1f1b", microbatches=4), ["training.pipeline_chunks=2"])
    assert cfg.training.pipeline_chunks == 2
    # Every data-parallel strategy but "auto" runs inside the stages.
    for strategy in ("ddp", "zero1", "zero2", "zero3", "fsdp"):
        assert load_config(_pipeline(strategy=strategy)).training.strategy == strategy


@pytest.mark.slow
def test_a_type_error_fails_before_any_training(warm_python):
    code, out, err = _dtrain(warm_python, "examples/configs/gpt_cpu.yaml", "--set", "output=5")
    assert code == 2, out + err
    assert "output" in err and "step" not in out + err.replace("training.max_steps", ""), out + err


def test_a_field_given_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    """``training: {lr: 1e-3}`` then ``lr: 2e-3`` a line later trained at 2e-3, silently (PyYAML keeps the last
    value of a repeated key), in a config whose every other slip is an error."""
    path = tmp_path / "job.yaml"
    path.write_text("training:\n  lr: 1e-3\n  epochs: 2\n  lr: 2e-3\nmodel: {preset: tiny}\n")
    with pytest.raises(ConfigError, match=r"job\.yaml.*lr.*given twice.*line 2.*line 4"):
        load_config(str(path))
    path.write_text("training: {lr: 1e-3}\nmodel: {preset: tiny}\ntraining: {epochs: 2}\n")
    with pytest.raises(ConfigError, match=r"training.*given twice.*line 1.*line 3"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="given twice"):
        load_config(str(path), ["training.lr=3e-4"])
    path.write_text("training: {lr: 1e-3, epochs: 2, lr: 2e-3}\n")  # one line: the columns say which
    with pytest.raises(ConfigError, match=r"training\.lr is given twice \(line 1, columns 12 and 33\)"):
        load_config(str(path))
    # YAML's merge keys still override what they merge; the same key in two sections is no repeat.
    path.write_text("training:\n  <<: {lr: 1e-3, epochs: 2}\n  lr: 2e-3\noptimizer: {lr: 5e-3}\n")
    cfg = load_config(str(path))
    assert cfg.training.lr == 2e-3 and cfg.training.epochs == 2 and cfg.optimizer.lr == 5e-3
    with pytest.raises(ConfigError, match="given twice"):
        load_config(str(tmp_path / "job.yaml"), ["training.tensor_parallel_plan={a: colwise, a: rowwise}"])


def test_sections_left_empty_keep_their_defaults():
    cfg = load_config(yaml.safe_load("training:\nmodel:\n  preset: tiny\n"))
    assert cfg.training == JobConfig().training and cfg.model.preset == "tiny"


@pytest.mark.slow
def test_print_config_prints_every_field_with_its_default(warm_python):
    code, out, err = _dtrain(warm_python, "--print-config")
    assert code == 0, err
    printed = yaml.safe_load(out)
    assert printed == JobConfig().model_dump()
    for section, info in JobConfig.model_fields.items():
        fields = getattr(info.annotation, "model_fields", None)
        if fields:
            assert set(printed[section]) == set(fields), section
    # The field descriptions are the documentation: they come along as comments.
    assert "# The learning rate, whatever optimizer.name (the older spelling of optimizer.lr)." in out
    # What it prints is a valid config that loads back to the same values.
    job = yaml.safe_load(out)
    assert load_config(job).model_dump() == printed


def test_field_docs_say_what_the_code_does():
    """Field docs that had gone stale: training.lr / weight_decay said AdamW's (any optimizer.name takes
    them), schedule.total_steps left out the steps of training.epochs, evaluation.every named only
    data.val_fraction as the validation set."""
    from distributed_training.config import EvaluationConfig, OptimizerConfig, ScheduleConfig, TrainingConfig

    def doc(section, name):
        return " ".join(section.model_fields[name].description.split())

    assert "AdamW" not in doc(TrainingConfig, "lr") and "optimizer.lr" in doc(TrainingConfig, "lr")
    assert "AdamW" not in doc(TrainingConfig, "weight_decay") and "sgd / lars" in doc(TrainingConfig, "weight_decay")
    assert "training.epochs" in doc(ScheduleConfig, "total_steps")
    assert "milestones" in doc(ScheduleConfig, "kind")
    assert "global_batch_size" in doc(ScheduleConfig, "scale_lr_with_batch")
    assert "matches no parameter is an error" in doc(OptimizerConfig, "exclude_from_weight_decay")
    every = doc(EvaluationConfig, "every")
    assert all(field in every for field in ("data.val_fraction", "data.val_root", "data.val_target"))

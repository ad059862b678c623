"""Evaluation during training (`fit(eval_dataset=..., eval_every=N)`, dtrain's ``evaluation:``).

The metrics must equal one process's computation over the whole validation set (counts exactly, the
loss to 1e-6) at 2 and 3 ranks with shards of unequal size, under DDP and ZeRO-3; training with an
evaluation every 2 steps must end bit-identical to training without one (dropout draws, a frozen
BatchNorm left frozen); keep-best must keep the step of the best evaluation.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed

CLASSES, FEATURES, N_VAL = 7, 8, 23  # 23 samples: 12 + 11 at 2 ranks, 8 + 8 + 7 at 3


class Net(nn.Module):
    """Dropout (draws from the RNG in training) and a BatchNorm the user froze in eval mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def _model() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.bn.eval()  # frozen: its running statistics must not move, before or after an evaluation
    return model


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def _full_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in trainer.strategy.model_state_dict(trainer.model).items()}


def fit_worker(rank, world, strategy, eval_every, log_dir, checkpoint_dir, best):
    torch.manual_seed(1234)  # the same global stream on every rank: dropout draws the same in both runs
    trainer = DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9), strategy=strategy,
                                 log_dir=log_dir, progress=False, checkpoint_dir=checkpoint_dir,
                                 best_metric=best and best[0], best_mode=best[1] if best else "min", keep_last=1)
    kwargs = {}
    if eval_every is not None:
        kwargs = dict(eval_dataset=_data(N_VAL, 1), eval_every=eval_every, eval_batch_size=5,
                      eval_metrics=["accuracy", "top3"])
    history = trainer.fit(_data(40, 0), epochs=2, criterion=F.cross_entropy, batch_size=4, max_steps=5, **kwargs)
    state = _full_state(trainer)
    evaluations = trainer.evaluation.history if trainer.evaluation is not None else []
    bn_frozen = not trainer.module.bn.training and trainer.module.fc1.training
    trainer.close()
    return state, evaluations, history, bn_frozen


def _reference(state: dict[str, torch.Tensor]) -> dict[str, float]:
    """One process, the whole validation set in one forward."""
    model = _model()
    model.load_state_dict(state)
    model.eval()
    x, y = _data(N_VAL, 1).tensors
    with torch.no_grad():
        logits = model(x)
    return {
        "val_loss": F.cross_entropy(logits, y).item(),
        "val_accuracy": (logits.argmax(-1) == y).sum().item() / N_VAL,
        "val_top3": (logits.topk(3, dim=-1).indices == y[:, None]).any(-1).sum().item() / N_VAL,
    }


@pytest.mark.parametrize("world, strategy", [(2, "ddp"), (3, "ddp"), (2, "zero3")])
def test_metrics_equal_one_process_over_the_whole_set(tmp_path, world, strategy):
    results = run_distributed(fit_worker, world, args=(strategy, 2, str(tmp_path / "logs"), None, None),
                              timeout=180)
    state, evaluations, history, _ = results[0]
    # Every 2 steps and at the end (step 5); the same values on every rank.
    assert [e["step"] for e in evaluations] == [2, 4, 5], evaluations
    values = lambda evals: [{k: v for k, v in e.items() if k != "seconds"} for e in evals]  # noqa: E731
    for other in results[1:]:
        assert values(other[1]) == values(evaluations)  # the seconds are each rank's clock
    last = evaluations[-1]
    want = _reference(state)
    assert last["val_samples"] == N_VAL  # every sample once, none dropped or repeated
    assert last["val_accuracy"] == want["val_accuracy"] and last["val_top3"] == want["val_top3"], (last, want)
    assert abs(last["val_loss"] - want["val_loss"]) <= 1e-6, (last, want)
    assert history[-1]["val_loss"] == last["val_loss"]  # the epoch summary carries its last evaluation
    # The monitor: each rank its shard (val/*), rank 0 the whole set (cluster/val_*).
    shards = []
    for rank in range(world):
        with open(os.path.join(tmp_path, "logs", f"rank_{rank}", "eval.jsonl")) as f:
            records = [json.loads(line) for line in f]
        assert [r["step"] for r in records] == [2, 4, 5]
        assert ("cluster/val_loss" in records[-1]) == (rank == 0)
        shards.append(records[-1])
    assert shards[0]["cluster/val_accuracy"] == want["val_accuracy"]
    assert sum(s["val/samples"] for s in shards) == N_VAL
    assert sum(s["val/accuracy"] * s["val/samples"] for s in shards) == pytest.approx(want["val_accuracy"] * N_VAL)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_evaluating_every_two_steps_leaves_training_bit_identical(strategy):
    plain = run_distributed(fit_worker, 2, args=(strategy, None, None, None, None), timeout=180)
    evaluated = run_distributed(fit_worker, 2, args=(strategy, 2, None, None, None), timeout=180)
    for (a, _, _, _), (b, evals, _, frozen) in zip(plain, evaluated):
        assert len(evals) == 3
        assert frozen  # the frozen BatchNorm stays in eval mode, the rest is back in training mode
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_keep_best_keeps_the_best_evaluation(tmp_path):
    # "max" of the validation loss: the best is an early evaluation, not the last checkpoint.
    results = run_distributed(fit_worker, 2, args=("ddp", 2, None, str(tmp_path), ("val_loss", "max")),
                              timeout=180)
    evaluations = results[0][1]
    best = max(evaluations, key=lambda e: e["val_loss"])
    with open(tmp_path / "best.json") as f:
        record = json.load(f)
    assert record["step"] == best["step"] and record["value"] == best["val_loss"], (record, evaluations)
    kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("step_"))
    assert f"step_{best['step']:09d}" in kept, kept
    assert len(kept) <= 2, kept  # keep_last=1 plus the best


def target_worker(rank, world, strategy):
    def run(**kwargs):
        torch.manual_seed(1234)
        trainer = DistributedTrainer(_model(), lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
                                     strategy=strategy, progress=False)
        trainer.fit(_data(40, 0), epochs=3, criterion=F.cross_entropy, batch_size=4, **kwargs)
        out = (_full_state(trainer), trainer.step, trainer.evaluation and trainer.evaluation.history,
               trainer.evaluation and trainer.evaluation.reached)
        trainer.close()
        return out

    evaluate = dict(eval_dataset=_data(N_VAL, 1), eval_every=1, eval_batch_size=5)
    _, _, history, _ = run(max_steps=10, **evaluate)
    goal = sorted(e["val_loss"] for e in history)[3]  # reached at some step inside the run, not the first
    first = next(e for e in history if e["val_loss"] <= goal)
    state, step, stopped, reached = run(max_steps=10, eval_target={"val_loss": goal}, **evaluate)
    plain, plain_step, _, _ = run(max_steps=first["step"])
    return goal, first, state, step, stopped, reached, plain, plain_step


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_reached_target_ends_training_where_a_run_of_that_length_ends(strategy):
    for goal, first, state, step, stopped, reached, plain, plain_step in run_distributed(
            target_worker, 2, args=(strategy,), timeout=180):
        assert 1 < first["step"] < 10
        assert step == plain_step == first["step"] == reached["step"], (step, first, reached)
        assert reached["metric"] == "val_loss" and reached["value"] == first["val_loss"] <= goal == reached["target"]
        assert [e["step"] for e in stopped] == list(range(1, step + 1))  # no evaluation after the stop
        seconds = [e["seconds"] for e in stopped]
        assert seconds == sorted(seconds) and 0 < reached["seconds"] == seconds[-1]
        for key in plain:  # the steps before the stop are those of a run that long, bit for bit
            assert torch.equal(state[key], plain[key]), key


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


def error_worker(rank, world):
    trainer = DistributedTrainer(nn.Linear(FEATURES, CLASSES), lambda ps: torch.optim.SGD(ps, lr=0.1))
    messages = []
    train = _data(8, 0)
    cases = [
        dict(eval_every=2),  # no eval_dataset
        dict(eval_dataset=_data(5, 1), eval_every=0),
        dict(eval_dataset=_data(5, 1), eval_metrics=["acc"]),
        dict(eval_dataset=_data(5, 1), eval_batch_size=0),
        dict(eval_dataset=_Stream(), eval_every=1),
    ]
    for kwargs in cases:
        try:
            trainer.fit(train, criterion=F.cross_entropy, batch_size=4, max_steps=1, **kwargs)
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    # A regression target with a classifier's metric: named before training (it was at the first evaluation).
    regression = TensorDataset(torch.randn(4, FEATURES), torch.randn(4, CLASSES))
    try:
        trainer.fit(regression, criterion=F.mse_loss, batch_size=2, max_steps=2, eval_dataset=regression,
                    eval_metrics=["accuracy"])
        messages.append(None)
    except ValueError as err:
        messages.append(str(err))
    # "auto" on a regression: the loss alone.
    trainer.fit(regression, epochs=10, criterion=F.mse_loss, batch_size=2, max_steps=trainer.step + 1,
                eval_dataset=regression)
    messages.append(sorted(trainer.evaluation.history[-1]))
    for kwargs in (dict(eval_target={"val_accuracy": 0.9}),
                   dict(eval_dataset=_data(5, 1), eval_every=1, eval_target={"val_acc": 0.9}),
                   dict(eval_dataset=_data(5, 1), eval_target={"val_accuracy": 0.9}),
                   dict(eval_dataset=_data(5, 1), eval_every=1, eval_target={"val_loss": float("nan")})):
        try:
            trainer.fit(train, criterion=F.cross_entropy, batch_size=4, max_steps=trainer.step + 1, **kwargs)
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    trainer.close()
    return messages


def test_bad_evaluation_arguments_are_named():
    messages = run_distributed(error_worker, 1, timeout=120)[0]
    assert "eval_every=2" in messages[0] and "eval_dataset" in messages[0]
    assert "eval_every" in messages[1]
    assert "eval_metrics" in messages[2] and "'acc'" in messages[2]
    assert "eval_batch_size" in messages[3]
    assert "the data (_Stream) yielded no batch on any rank" in messages[4]  # (an iterable of batches: taken)
    assert "eval_metrics: accuracy is for classifiers" in messages[5] and "float32 tensor of shape (7,)" in messages[5]
    assert messages[6] == ["seconds", "step", "val_loss", "val_samples"]
    assert "eval_target" in messages[7] and "eval_dataset" in messages[7]
    assert "'val_acc'" in messages[8] and "val_accuracy" in messages[8]
    assert "eval_target needs eval_every" in messages[9]
    assert "finite number" in messages[10]


# ------------------------------------------------------------------ dtrain
@pytest.mark.parametrize(
    "raw, message",
    [
        ({"evaluation": {"every": 0}}, "evaluation.every"),
        ({"evaluation": {"metrics": ["acc"]}}, "evaluation.metrics: unknown metric 'acc'"),
        ({"evaluation": {"metrics": ["accuracy"]}}, "evaluation.metrics: accuracy is for classifiers"),
        ({"model": {"preset": "classifier"}, "data": {"dataset": "digits"}, "evaluation": {"metrics": ["perplexity"]}},
         "evaluation.metrics: perplexity is for language models"),
        ({"model": {"preset": "resnet18"}, "data": {"dataset": "image_folder", "root": "r"},
          "evaluation": {"metrics": ["accuracy", "perplexity"]}}, "evaluation.metrics: perplexity is for language"),
        ({"evaluation": {"every": 2, "best_metric": "val_accuracy"}}, "evaluation.best_metric must be one of"),
        ({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
          "evaluation": {"every": 2, "best_metric": "val_accuracy"}}, "evaluation.best_metric keeps the best"),
        ({"model": {"preset": "classifier"}, "data": {"dataset": "digits"}, "checkpoint": {"dir": "c"},
          "evaluation": {"best_metric": "val_accuracy"}}, "needs evaluation.every"),
        ({"data": {"val_fraction": 0}, "evaluation": {"every": 2}}, "data.val_fraction"),
        ({"evaluation": {"best_mode": "largest"}}, "evaluation.best_mode"),
        ({"evaluation": {"often": 2}}, "unknown field evaluation.often"),
        ({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
          "evaluation": {"target": {"val_accuracy": 0.9}}}, "evaluation.target needs evaluation.every"),
        ({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
          "evaluation": {"every": 2, "target": {"val_acc": 0.9}}}, "evaluation.target must name one of"),
        ({"model": {"preset": "classifier"}, "data": {"dataset": "digits"},
          "evaluation": {"every": 2, "target": {"val_accuracy": 0.9, "val_loss": 0.1}}},
         "evaluation.target must be one metric"),
    ],
)
def test_dtrain_evaluation_fields_name_themselves(raw, message):
    from distributed_training.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        load_config(raw)


def dtrain_worker(rank, world, checkpoint_dir):
    from distributed_training import cli
    from distributed_training.config import load_config

    cfg = load_config({
        "model": {"preset": "classifier"}, "data": {"dataset": "digits"},
        "training": {"max_steps": 6, "batch_size": 32, "lr": 0.01},
        "checkpoint": {"dir": checkpoint_dir, "keep_last": 1},
        "evaluation": {"every": 2, "metrics": ["accuracy", "top3"], "best_metric": "val_accuracy"},
    })
    return cli.run_job(cfg)


def test_dtrain_evaluates_every_n_steps_and_keeps_the_best(tmp_path):
    from distributed_training import dtrain_job
    from distributed_training.config import load_config

    metrics = run_distributed(dtrain_worker, 2, args=(str(tmp_path),), timeout=180)[0]
    assert set(metrics) >= {"loss", "val_loss", "val_accuracy", "val_top3", "val_samples"}, metrics
    assert metrics["loss"] == metrics["val_loss"] and metrics["val_top3"] >= metrics["val_accuracy"]
    # The whole validation split, once: what _build holds out.
    _, _, val, _ = dtrain_job._build(load_config({"model": {"preset": "classifier"}, "data": {"dataset": "digits"}}))
    assert metrics["val_samples"] == len(val)
    record = json.loads((tmp_path / "best.json").read_text())
    assert record["metric"] == "val_accuracy" and record["step"] in (2, 4, 6) and not math.isnan(record["value"])
    assert record["value"] >= metrics["val_accuracy"]  # mode max (auto for an accuracy)


def dtrain_target_worker(rank, world):
    from distributed_training import cli
    from distributed_training.config import load_config

    cfg = load_config({
        "model": {"preset": "classifier"}, "data": {"dataset": "digits"},
        "training": {"max_steps": 6, "batch_size": 32, "lr": 0.01},
        "evaluation": {"every": 2, "target": {"val_loss": 1e9}},  # reached at the first evaluation
    })
    return cli.run_job(cfg)


def test_dtrain_stops_at_its_target_and_says_when(tmp_path):
    metrics = run_distributed(dtrain_target_worker, 2, timeout=180)[0]
    assert metrics["target_step"] == 2 and metrics["time_to_target_s"] > 0, metrics

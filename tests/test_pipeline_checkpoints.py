"""Checkpoints and evaluate() with pipeline_parallel_size: the one format across pipeline sizes.

A checkpoint saved by a pipelined trainer (P=2 x DP=2) loads into one with another pipeline size (P=4)
or none (strategy "ddp" on one process), and one saved without a pipeline loads into a pipelined
trainer. After loading, the parameters and AdamW's state (moments and step) must equal those the
saving run held, bit for bit, read independently of the checkpoint code (each optimizer tensor named
through the user's model object, whose kept parameters the stages hold); after each of three more
steps they must equal the run that never stopped (the loading layout given that state directly, not
through a checkpoint; 1e-6) and one process that starts from that state and trains on the whole batch
(1e-6 for the MLP; the GPT's key biases need the cross-layout tolerance, see `_check_resume`). A lost
optimizer state moves them by far more (checked below). BatchNorm statistics cross pipeline sizes;
`fit` with `checkpoint_dir` resumes bit for bit. evaluate() under a pipeline must return, on every
rank, what evaluate() of one process returns.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.testing import run_distributed

from _models import tiny_gpt

ROWS = 8  # the global batch: divisible by every data-parallel size used here
SEQ = 12
STEPS_BEFORE, STEPS_AFTER = 3, 3
ATOL, RTOL = 1e-6, 1e-5


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "gpt":
        return tiny_gpt()
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 4))


def _batches(kind: str):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS_BEFORE + STEPS_AFTER):
        if kind == "gpt":
            tokens = torch.randint(0, 64, (ROWS, SEQ + 1), generator=g)
            out.append((tokens[:, :-1], tokens[:, 1:]))
        else:
            out.append((torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 4, generator=g)))
    return out


def _criterion(kind: str):
    return None if kind == "gpt" else F.mse_loss  # the GPT: its own language-model loss


def _trainer(kind: str, pipe: int, seed: int) -> tuple[DistributedTrainer, dict[int, str]]:
    model = _model(kind, seed)
    names = {id(p): name for name, p in model.named_parameters()}  # the stages keep these very tensors
    kwargs = dict(pipeline_parallel_size=pipe, microbatches=pipe) if pipe > 1 else {}
    return DistributedTrainer(model, _adamw, strategy="ddp", progress=False, **kwargs), names


def _my_part(trainer: DistributedTrainer, batch):
    n = ROWS // trainer.dp_world_size
    rows = slice(trainer.dp_rank * n, (trainer.dp_rank + 1) * n)
    return batch[0][rows], batch[1][rows]


def _optimizer_state(trainer: DistributedTrainer, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's AdamW state by the model's parameter names (not through the checkpoint code)."""
    state = {}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            state[names[id(p)]] = {k: v.detach().cpu().clone() for k, v in trainer.optimizer.state[p].items()}
    return state


def save_worker(rank, world, kind, pipe, directory):
    trainer, names = _trainer(kind, pipe, seed=0)
    for batch in _batches(kind)[:STEPS_BEFORE]:
        trainer.train_step(_my_part(trainer, batch), _criterion(kind))
    trainer.save_checkpoint(directory)
    params, optim = trainer.full_state_dict(), _optimizer_state(trainer, names)
    trainer.close()
    return params, optim


def _train_on(trainer, names, kind):
    params, optim = [trainer.full_state_dict()], [_optimizer_state(trainer, names)]
    for batch in _batches(kind)[STEPS_BEFORE:]:
        trainer.train_step(_my_part(trainer, batch), _criterion(kind))
        params.append(trainer.full_state_dict())
        optim.append(_optimizer_state(trainer, names))
    step = trainer.step
    trainer.close()
    return params, optim, step


def load_worker(rank, world, kind, pipe, directory, saved_params, saved_optim):
    """The run loaded from the checkpoint, then the same layout's run that never stopped: given the
    saved parameters and AdamW state directly (the model's state_dict before the trainer is built,
    each optimizer tensor's state by name), not through any checkpoint code."""
    trainer, names = _trainer(kind, pipe, seed=123)  # another initialisation: all must come from the checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG states are not restored at another world size
        trainer.load_checkpoint(directory)
    loaded = _train_on(trainer, names, kind)

    model = _model(kind, seed=7)
    model.load_state_dict(saved_params)
    names = {id(p): name for name, p in model.named_parameters()}
    kwargs = dict(pipeline_parallel_size=pipe, microbatches=pipe) if pipe > 1 else {}
    trainer = DistributedTrainer(model, _adamw, strategy="ddp", progress=False, **kwargs)
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            trainer.optimizer.state[p] = {k: v.clone() for k, v in saved_optim[names[id(p)]].items()}
    return loaded, _train_on(trainer, names, kind)


def _merge(per_rank: list[dict]) -> dict:
    """Every rank's optimizer state in one dict; copies of a tied weight (or replicas) must agree."""
    merged: dict = {}
    for part in per_rank:
        for key, state in part.items():
            if key in merged:
                for name, value in state.items():
                    torch.testing.assert_close(value, merged[key][name], atol=0, rtol=0,
                                               msg=lambda m: f"two ranks hold different '{name}' of '{key}': {m}")
            merged[key] = state
    return merged


def _reference(kind: str, params: dict, optim: dict, resets_optimizer: bool = False):
    """One process on the whole batch from the saved parameters and AdamW state: (params, state) after
    each later step."""
    model = _model(kind)
    model.load_state_dict(params)
    optimizer = _adamw(model.parameters())
    if not resets_optimizer:
        for name, p in model.named_parameters():
            optimizer.state[p] = {k: v.clone() for k, v in optim[name].items()}
    out = []
    for x, y in _batches(kind)[STEPS_BEFORE:]:
        loss = model(x, y) if kind == "gpt" else F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in model.named_parameters()}
        out.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, state))
    return out


def _assert_close(got: dict, want: dict, where: str, atol: float = ATOL, rtol: float = RTOL) -> None:
    assert set(got) == set(want), f"{where}: keys {sorted(set(got) ^ set(want))} differ"
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_close(got[key], value, f"{where}, {key}", atol, rtol)
        else:
            torch.testing.assert_close(got[key], value, atol=atol, rtol=rtol, msg=lambda m: f"{where}, {key}: {m}")


def _check_resume(kind, saved, directory, world, pipe, where):
    """Load at `world` ranks with `pipeline_parallel_size=pipe`; check the state after loading (exactly
    the saved one) and after each later step (the run that never stopped; one process on the whole
    batch)."""
    saved_params, saved_optim = saved[0][0], _merge([optim for _, optim in saved])
    results = run_distributed(load_worker, world, args=(kind, pipe, directory, saved_params, saved_optim),
                              timeout=180)
    runs = {}
    for which in (0, 1):  # the loaded run, the run that never stopped
        params, _, step = results[0][which]
        assert step == (STEPS_BEFORE if which == 0 else 0) + STEPS_AFTER, step
        assert all(r[which][0] == [{}] * (STEPS_AFTER + 1) for r in results[1:]), "full_state_dict() is {} off rank 0"
        runs[which] = params, [_merge([r[which][1][i] for r in results]) for i in range(STEPS_AFTER + 1)]
    (params, optims), (never_params, never_optims) = runs[0], runs[1]
    _assert_close(params[0], saved_params, f"{where}: parameters after loading", atol=0, rtol=0)
    _assert_close(optims[0], saved_optim, f"{where}: AdamW state after loading", atol=0, rtol=0)
    for i in range(1, STEPS_AFTER + 1):
        at = f"after step {STEPS_BEFORE + i}"
        _assert_close(params[i], never_params[i], f"{where}: parameters {at} (vs the run that never stopped)")
        _assert_close(optims[i], never_optims[i], f"{where}: AdamW state {at} (vs the run that never stopped)")
    # One process on the whole batch: as close as its rounding allows. AdamW turns rounding noise into
    # full steps where a gradient is zero but for rounding (the GPT's key biases: softmax ignores a
    # shift of every score), so the GPT gets the cross-layout tolerance of test_checkpoint_format.
    atol, rtol = (ATOL, RTOL) if kind == "mlp" else (3e-4, 1e-3)
    for i, (want_params, want_optim) in enumerate(_reference(kind, saved_params, saved_optim), start=1):
        at = f"after step {STEPS_BEFORE + i}"
        _assert_close(params[i], want_params, f"{where}: parameters {at} (vs one process)", atol, rtol)
        _assert_close(optims[i], want_optim, f"{where}: AdamW state {at} (vs one process)", atol, rtol)


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_saved_without_pipeline_loads_at_p2(tmp_path, kind):
    """P=1 on 2 ranks (DDP, the tied GPT's one parameter) -> P=2 (the tie as two copies, both loaded)."""
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(save_worker, 2, args=(kind, 1, directory), timeout=120)
    _check_resume(kind, saved, directory, 2, 2, "P1 x DP2 -> P2")


@pytest.mark.parametrize("kind", ["gpt", "mlp"])
def test_saved_at_p2_dp2_loads_at_p1_and_at_p4(tmp_path, kind):
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(save_worker, 4, args=(kind, 2, directory), timeout=180)
    files = sorted(os.listdir(directory))
    assert "meta.pt" in files and [f for f in files if f.startswith("rank")] == [f"rank{r}.pt" for r in range(4)]
    _check_resume(kind, saved, directory, 1, 1, "P2 x DP2 -> P1 (ddp, one process)")
    _check_resume(kind, saved, directory, 4, 4, "P2 x DP2 -> P4")


def test_the_tolerance_would_catch_a_lost_optimizer_state(tmp_path):
    saved = run_distributed(save_worker, 2, args=("mlp", 2, str(tmp_path / "ckpt")), timeout=120)
    params, optim = saved[0][0], _merge([o for _, o in saved])
    kept = _reference("mlp", params, optim)[0][0]
    lost = _reference("mlp", params, optim, resets_optimizer=True)[0][0]
    worst = max((kept[k] - lost[k]).abs().max().item() for k in kept)
    assert worst > 1000 * ATOL, worst


# ------------------------------------------------------------------ buffers
def _batchnorm_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32), nn.BatchNorm1d(32),
                         nn.Tanh(), nn.Linear(32, 4))


def buffers_worker(rank, world, pipe, directory, load):
    kwargs = dict(pipeline_parallel_size=pipe, microbatches=2) if pipe > 1 else {}
    trainer = DistributedTrainer(_batchnorm_mlp(), _adamw, progress=False, **kwargs)
    if load:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.load_checkpoint(directory)
    else:
        for batch in _batches("mlp")[:2]:
            trainer.train_step(_my_part(trainer, batch), F.mse_loss)
        trainer.save_checkpoint(directory)
    state = trainer.full_state_dict()
    trainer.close()
    return state


@pytest.mark.parametrize("saved_pipe, loaded_pipe", [(2, 1), (1, 2)])
def test_batchnorm_statistics_cross_pipeline_sizes(tmp_path, saved_pipe, loaded_pipe):
    """Buffers go by the model's keys: each stage's BatchNorm statistics come back from the rank that held them."""
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(buffers_worker, 2, args=(saved_pipe, directory, False), timeout=120)[0]
    assert any("running_mean" in key for key in saved) and saved["4.num_batches_tracked"] > 0
    loaded = run_distributed(buffers_worker, loaded_pipe, args=(loaded_pipe, directory, True), timeout=120)[0]
    _assert_close(loaded, saved, f"P{saved_pipe} -> P{loaded_pipe}", atol=0, rtol=0)


# ------------------------------------------------------------------ fit: resume from checkpoint_dir
def fit_worker(rank, world, directory, max_steps):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g))
    kwargs = dict(checkpoint_dir=directory, checkpoint_every=2) if directory is not None else {}
    trainer = DistributedTrainer(_model("mlp"), _adamw, pipeline_parallel_size=2, microbatches=2, progress=False,
                                 **kwargs)
    history = trainer.fit(data, epochs=1, criterion=F.mse_loss, batch_size=4, max_steps=max_steps)
    state, step = trainer.full_state_dict(), trainer.step
    trainer.close()
    return state, step, sum(epoch["steps"] for epoch in history)


def test_fit_resumes_from_checkpoint_dir_as_if_never_stopped(tmp_path):
    """fit with checkpoint_dir at P=2 x DP=2 stops after 2 steps; a new job resumes and finishes: the
    same parameters, bit for bit, as a run that never stopped (same layout: same reduction order)."""
    directory = str(tmp_path / "run")
    run_distributed(fit_worker, 4, args=(directory, 2), timeout=180)
    assert os.listdir(directory) == ["step_000000002"], os.listdir(directory)
    resumed = run_distributed(fit_worker, 4, args=(directory, 4), timeout=180)
    unbroken = run_distributed(fit_worker, 4, args=(None, 4), timeout=180)
    assert resumed[0][1] == unbroken[0][1] == 4
    assert resumed[0][2] == 2 and unbroken[0][2] == 4  # the resumed job trained the last two steps only
    _assert_close(resumed[0][0], unbroken[0][0], "resumed vs never stopped", atol=0, rtol=0)


# ------------------------------------------------------------------ evaluate
def _eval_data(kind):
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(9)
    if kind == "gpt":
        tokens = torch.randint(0, 64, (18, SEQ + 1), generator=g)
        return TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return TensorDataset(torch.randn(18, 16, generator=g), torch.randn(18, 4, generator=g))


def evaluate_worker(rank, world, kind, pipe, schedule):
    model = _model(kind)
    kwargs = dict(pipeline_parallel_size=pipe, pipeline_schedule=schedule, microbatches=2 * pipe) if pipe > 1 else {}
    trainer = DistributedTrainer(model, _adamw, progress=False, **kwargs)
    trainer.train_step(_my_part(trainer, _batches(kind)[0]), _criterion(kind))
    metrics = {"mae": lambda out, y: (out - y).abs().mean()} if kind == "mlp" else None
    result = trainer.evaluate(_eval_data(kind), _criterion(kind), batch_size=4, metrics=metrics)
    # Training goes on after evaluate: the pipeline's messages still pair up.
    trainer.train_step(_my_part(trainer, _batches(kind)[1]), _criterion(kind))
    again = trainer.evaluate(_eval_data(kind), _criterion(kind), batch_size=4, metrics=metrics)
    trainer.close()
    return result, again


@pytest.mark.parametrize("kind, world, pipe, schedule", [
    ("mlp", 2, 2, "1f1b"),
    ("gpt", 2, 2, "interleaved_1f1b"),  # two chunks per rank: stage 1 -> 2 goes from rank 1 back to rank 0
    ("mlp", 4, 2, "gpipe"),  # P=2 x DP=2: 9 samples per replica, batches of 4, 4 and 1
])
def test_evaluate_under_a_pipeline_matches_one_process(kind, world, pipe, schedule):
    want = run_distributed(evaluate_worker, 1, args=(kind, 1, "1f1b"), timeout=120)[0]
    results = run_distributed(evaluate_worker, world, args=(kind, pipe, schedule), timeout=120)
    for rank, got in enumerate(results):  # every rank returns the same values
        for got_one, want_one in zip(got, want):
            assert set(got_one) == set(want_one)
            for name, value in want_one.items():
                assert abs(got_one[name] - value) <= 1e-6 * max(1.0, abs(value)), (rank, name, got_one, want_one)
    assert results[0][0] != results[0][1]  # the second evaluate saw the trained model


def evaluate_error_worker(rank, world):
    trainer = DistributedTrainer(_model("mlp"), _adamw, pipeline_parallel_size=2, microbatches=2, progress=False)
    try:
        trainer.evaluate(_eval_data("mlp"), batch_size=4)  # an MLP has no loss of its own
    except ValueError as err:
        return str(err)
    finally:
        trainer.close()
    return None


def test_evaluate_without_criterion_names_it():
    for message in run_distributed(evaluate_error_worker, 2, timeout=60):
        assert message is not None and "evaluate needs a criterion" in message, message


def changed_config_worker(rank, world, directory, pipe=1):
    import logging

    from distributed_training.logs import get_logger

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        trainer, _ = _trainer("mlp", pipe, seed=1)
        trainer.load_checkpoint(directory)
        trainer.close()
    finally:
        get_logger().removeHandler(handler)
    return seen


def test_resuming_a_pipeline_checkpoint_without_a_pipeline_says_so(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(save_worker, 2, args=("mlp", 2, directory), timeout=120)
    seen = "\n".join(run_distributed(changed_config_worker, 1, args=(directory,), timeout=120)[0])
    assert "the configuration changed" in seen and "pipeline_parallel_size: 2 (pipeline_schedule=1f1b, microbatches=2, pipeline_chunks=1) -> 1 (no pipeline)" in seen, seen
    assert "RNG states not restored" in seen, seen  # said once, by rank 0, through the package's log


def test_resuming_a_checkpoint_without_a_pipeline_under_one_says_so(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(save_worker, 1, args=("mlp", 1, directory), timeout=120)
    seen = "\n".join(run_distributed(changed_config_worker, 2, args=(directory, 2), timeout=120)[0])
    assert "the configuration changed" in seen and "pipeline_parallel_size: 1 (no pipeline) -> 2 (pipeline_schedule=1f1b, microbatches=2, pipeline_chunks=1)" in seen, seen

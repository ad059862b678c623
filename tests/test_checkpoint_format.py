"""One checkpoint format: saved under any strategy at world N, loaded under any other at world M.

Each case trains a tiny GPT (tied embedding, units spanning several parameters) for a few steps under
strategy A on N ranks, saves, then loads into a differently initialised model under strategy B on M
ranks and trains on. A single process training on the whole batch is the reference: after loading
and after every later step, `trainer.full_state_dict()` on rank 0 must equal the reference's
parameters, and AdamW's moments must have come through (without them the steps after the load differ
by far more than the tolerance).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from distributed_training import DistributedTrainer, FSDPStrategy
from distributed_training.checkpoint import CheckpointMismatchError
from distributed_training.checkpoint_shards import Piece, flat_pieces
from distributed_training.testing import run_distributed

from _models import tiny_gpt

GLOBAL_BATCH = 12  # divisible by every world size used here
STEPS_BEFORE, STEPS_AFTER = 3, 3


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batches():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _strategy(name: str, world: int):
    if name == "hybrid":
        per_node = 2 if world % 2 == 0 else 1
        return FSDPStrategy(sharding_strategy="hybrid", ranks_per_node=per_node)
    return name


def _my_part(batch, rank, world):
    x, y = batch
    n = GLOBAL_BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _reference(reset_optimizer_at: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Parameters after each step of a single process on the whole batch (index 0: the initial ones);
    `reset_optimizer_at`: a fresh optimizer from that step on (what losing its state would do)."""
    torch.manual_seed(0)
    model = tiny_gpt()
    optimizer = _adamw(model.parameters())
    states = [{k: v.clone() for k, v in model.state_dict().items()}]
    for step, (x, y) in enumerate(_batches()):
        if step == reset_optimizer_at:
            optimizer = _adamw(model.parameters())
        optimizer.zero_grad()
        model(x, y).backward()
        optimizer.step()
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return states


def _save_under(rank, world, strategy, directory):
    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(), _adamw, strategy=_strategy(strategy, world), progress=False)
    for batch in _batches()[:STEPS_BEFORE]:
        trainer.train_step(_my_part(batch, rank, world))
    trainer.save_checkpoint(directory)
    trainer.close()


def _load_under(rank, world, strategy, directory):
    torch.manual_seed(123)  # another initialisation: everything must come from the checkpoint
    trainer = DistributedTrainer(tiny_gpt(), _adamw, strategy=_strategy(strategy, world), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG states are not restored at another world size
        trainer.load_checkpoint(directory)
    states = [trainer.full_state_dict()]
    for batch in _batches()[STEPS_BEFORE:]:
        trainer.train_step(_my_part(batch, rank, world))
        states.append(trainer.full_state_dict())
    step = trainer.step
    trainer.close()
    return states, step


def _assert_close(got: dict, want: dict, where: str) -> None:
    assert set(got) == set(want), f"{where}: keys {sorted(set(got) ^ set(want))} differ"
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}, {key}: {m}")


# Adam divides by the root of its second moment, so tiny gradients summed in another order by other
# ranks move by up to ~1e-4 after a few steps; a lost optimizer state moves them by ~1e-2 (checked below).
ATOL, RTOL = 3e-4, 1e-3


def test_the_tolerance_would_catch_a_lost_optimizer_state():
    kept, lost = _reference()[STEPS_BEFORE + 1], _reference(reset_optimizer_at=STEPS_BEFORE)[STEPS_BEFORE + 1]
    worst = max((kept[k] - lost[k]).abs().max().item() for k in kept)
    assert worst > 20 * ATOL, worst


PAIRS = [("ddp", "zero3"), ("zero3", "ddp"), ("zero1", "hybrid"), ("zero2", "zero1")]


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [(2, 3), (3, 1)], ids=lambda w: f"{w[0]}to{w[1]}")
@pytest.mark.parametrize("saved,loaded", PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_checkpoint_loads_under_another_strategy_and_world_size(tmp_path, saved, loaded, worlds):
    directory = str(tmp_path / "ckpt")
    old_world, new_world = worlds
    run_distributed(_save_under, old_world, args=(saved, directory), timeout=180)
    results = run_distributed(_load_under, new_world, args=(loaded, directory), timeout=180)
    reference = _reference()
    states, step = results[0]
    assert step == STEPS_BEFORE + STEPS_AFTER
    for i, state in enumerate(states):
        _assert_close(state, reference[STEPS_BEFORE + i],
                      f"{saved}@{old_world} -> {loaded}@{new_world}, step {STEPS_BEFORE + i}")
    assert all(r[0] == [{}] * len(states) for r in results[1:]), "full_state_dict() is {} off rank 0"


def _full_state_after_steps(rank, world, strategy):
    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(), _adamw, strategy=_strategy(strategy, world), progress=False)
    for batch in _batches()[:2]:
        trainer.train_step(_my_part(batch, rank, world))
    state = trainer.full_state_dict()
    trainer.close()
    return state


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3", "fsdp", "hybrid"])
def test_full_state_dict_is_the_plain_modules_state_dict_under_every_strategy(strategy):
    results = run_distributed(_full_state_after_steps, 2, args=(strategy,), timeout=120)
    state = results[0]
    want = _reference()[2]
    _assert_close(state, want, strategy)
    assert all(v.device.type == "cpu" for v in state.values())
    assert state["lm_head.weight"].data_ptr() != 0 and torch.equal(state["lm_head.weight"], state["wte.weight"])
    assert results[1] == {}


def _load_into_another_shape(rank, world, directory):
    from distributed_training.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=48))
    trainer = DistributedTrainer(model, _adamw, strategy="zero3", progress=False)
    try:
        trainer.load_checkpoint(directory)
    except (ValueError, CheckpointMismatchError) as err:
        return str(err)
    finally:
        trainer.close()
    return None


def test_another_shape_is_an_error_naming_the_parameter(tmp_path):
    directory = str(tmp_path / "ckpt")
    run_distributed(_save_under, 2, args=("ddp", directory), timeout=120)
    errors = run_distributed(_load_into_another_shape, 2, args=(directory,), timeout=120)
    assert errors[0] is not None and "shape" in errors[0] and ".weight" in errors[0], errors[0]


def _save_and_list_reads(rank, world, save_strategy, load_strategy, directory):
    from distributed_training import checkpoint as ckpt_module
    from distributed_training import trainer_checkpoint_loading

    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(), _adamw, strategy=load_strategy, progress=False)
    trainer.train_step(_my_part(_batches()[0], rank, world))
    if save_strategy == load_strategy:
        trainer.save_checkpoint(directory)
    read = []
    original = ckpt_module.load_file

    def spy(path, *args, **kwargs):
        read.append(os.path.basename(path))
        return original(path, *args, **kwargs)

    trainer_checkpoint_loading.load_file = spy
    try:
        trainer.load_checkpoint(directory)
    finally:
        trainer_checkpoint_loading.load_file = original
        trainer.close()
    return sorted(set(read))


@pytest.mark.parametrize("strategy,expected", [("zero3", lambda r: {f"rank{r}.pt"}),
                                                ("ddp", lambda r: {"rank0.pt", f"rank{r}.pt"})])
def test_each_rank_reads_only_the_files_it_needs(tmp_path, strategy, expected):
    directory = str(tmp_path / "ckpt")
    reads = run_distributed(_save_and_list_reads, 3, args=(strategy, strategy, directory), timeout=120)
    for rank, files in enumerate(reads):
        assert set(files) == expected(rank), f"rank {rank} read {files}"


def test_flat_pieces_cut_a_slice_of_concatenated_parameters():
    members = [("a", 0, 5), ("b", 5, 3), ("c", 8, 4)]
    assert flat_pieces(members, 3, 9) == [Piece("a", 3, 2, 0), Piece("b", 0, 3, 2), Piece("c", 0, 1, 5)]
    assert flat_pieces(members, 12, 15) == []  # padding only

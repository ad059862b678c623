"""Models built on the meta device, handed to DistributedTrainer(pipeline_parallel_size=P): each rank
gives storage to its own stages only and initialises them (`pipeline.meta_init`). Checked against one
process holding the whole model with the same initial weights (`GPTStages(cfg, seed).model()` for the
GPT, `materialize` of the same meta module otherwise): parameters after every step."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.models import GPT, GPTConfig
from distributed_training.pipeline import GPTStages
from distributed_training.pipeline.meta_init import check_initialisable, materialize
from distributed_training.testing import run_distributed

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16)
SEED = 7
STEPS = 3
TOL = 1e-5


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _meta_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(CFG)


def _meta_mlp() -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32),
                             nn.Tanh(), nn.Linear(32, 4))


def _meta_tied() -> nn.Sequential:
    """An embedding and an output layer sharing one weight (on different stages at P=2)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 10, bias=False))
    model[3].weight = model[0].weight
    return model


def _meta(kind: str) -> nn.Module:
    return {"gpt": _meta_gpt, "mlp": _meta_mlp, "tied": _meta_tied}[kind]()


def _batch(kind: str, step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)
    if kind == "tied":
        return torch.randint(0, 10, (rows,), generator=g), torch.randint(0, 10, (rows,), generator=g)
    tokens = torch.randint(0, CFG.vocab_size, (rows, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def meta_parity_worker(rank, world, kind, pipe, microbatches, balance="parameters", halves=False):
    if kind == "gpt":
        reference = GPTStages(CFG, SEED).model()
    else:
        reference = _meta(kind)
        materialize(reference, "cpu", seed=SEED)
    ref_opt = _sgd(reference.parameters())
    model = _meta(kind)
    torch.manual_seed(1000 + rank)  # the global RNG differs by rank: the initialisation must not use it
    trainer = DistributedTrainer(model, _sgd, seed=SEED, pipeline_parallel_size=pipe, microbatches=microbatches,
                                 pipeline_balance=balance, pipeline_half_blocks=halves)
    # Only this rank's stages were given storage: the rest of the model object stays meta, and the
    # real bytes are exactly the stages'.
    stages = trainer.module.stages
    stage_ids = {id(p) for p in stages.parameters()}
    real = [p for p in model.parameters() if not p.is_meta]
    held = {"real_ids_are_stage_ids": {id(p) for p in real} == stage_ids,
            "real_bytes": sum(p.numel() * p.element_size() for p in real),
            "stage_bytes": sum(p.numel() * p.element_size() for p in stages.parameters()),
            "meta_left": sum(p.is_meta for p in model.parameters()),
            "all_params": sum(1 for _ in model.parameters()),
            "costs": trainer.strategy.layer_costs, "bounds": trainer.strategy.bounds}
    dp, dp_rank = trainer.dp_world_size, trainer.dp_rank
    per_replica = 2 * microbatches
    worst = []
    criterion = {"gpt": None, "mlp": F.mse_loss, "tied": F.cross_entropy}[kind]
    for step in range(STEPS + 1):
        state = trainer.full_state_dict()  # before the first step too: the initial weights
        if rank == 0:
            want = reference.state_dict()
            assert list(state) == list(want), (list(state), list(want))
            worst.append(max((state[k] - want[k]).abs().max().item() for k in want))
        if step == STEPS:
            break
        x, y = _batch(kind, step, per_replica * dp)
        sl = slice(dp_rank * per_replica, (dp_rank + 1) * per_replica)
        trainer.train_step((x[sl], y[sl]), criterion)
        loss = reference(x, y) if kind == "gpt" else criterion(reference(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    trainer.close()
    return worst, held


@pytest.mark.parametrize("world, kind, microbatches, balance, halves", [
    (2, "gpt", 2, "parameters", False), (4, "gpt", 2, "parameters", False), (2, "mlp", 2, "parameters", False),
    (2, "tied", 2, "parameters", False), (2, "gpt", 2, "time", False), (4, "gpt", 4, "time", False),
    (2, "gpt", 2, "time", True)])
def test_meta_model_trains_like_one_process(world, kind, microbatches, balance, halves):
    """P=2 (and P=2 x DP=2 for the GPT): the initial weights equal the whole-model build's exactly (a
    weight tied across stages: the later stage's copy receives the first stage's), and the parameters
    after every step equal one process's on the whole batch. Balanced by measured time too: each layer
    timed on a copy materialised alone (the model object keeps no storage beyond the stages), the
    same costs and cut on every rank, and the same training whatever the cut. Cut at half blocks
    (``pipeline_half_blocks``), each half initialised with exactly its block's weights."""
    results = run_distributed(meta_parity_worker, world, args=(kind, 2, microbatches, balance, halves), timeout=120)
    worst = results[0][0]
    assert worst[0] == 0.0, f"initial weights differ from the whole-model build by {worst[0]:.3g}"
    assert max(worst) <= TOL, f"parameters differ from one process by {worst}"
    for rank, (_, held) in enumerate(results):
        assert held["real_ids_are_stage_ids"], (rank, held)
        assert held["real_bytes"] == held["stage_bytes"] > 0, (rank, held)
        assert 0 < held["meta_left"] < held["all_params"], (rank, held)
        assert held["costs"] == results[0][1]["costs"] and held["bounds"] == results[0][1]["bounds"], (rank, held)
    if balance == "time":
        layers = (2 if halves else 1) * CFG.n_layer + 2
        assert len(held["costs"]) == layers and all(0 < c < 1 for c in held["costs"]), held["costs"]


def test_meta_gpt_materialised_whole_equals_the_stage_builder():
    model = _meta_gpt()
    materialize(model, "cpu", seed=SEED)
    assert model.lm_head.weight is model.wte.weight  # the tie stays one parameter
    want = GPTStages(CFG, SEED).model().state_dict()
    got = model.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    other = _meta_gpt()
    materialize(other, "cpu", seed=SEED + 1)
    assert not torch.equal(other.state_dict()["blocks.0.attn.qkv.weight"], got["blocks.0.attn.qkv.weight"])


class Scaled(nn.Module):
    """A layer without reset_parameters: on the meta device its parameter cannot be initialised."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def test_reset_parameters_rules():
    """Children before parents (a parent's own rule wins), per-module streams (the global RNG neither
    used nor changed), a weight shared by two modules keeps its first owner's value."""
    with torch.device("meta"):
        mha = nn.Sequential(nn.Linear(8, 8), nn.MultiheadAttention(8, 2))
    state = torch.random.get_rng_state()
    materialize(mha, "cpu", seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.count_nonzero(mha[1].out_proj.bias) == 0  # MultiheadAttention's rule, after Linear's
    with torch.device("meta"):
        tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    materialize(tied, "cpu", seed=1)
    with torch.device("meta"):
        alone = nn.Sequential(nn.Embedding(10, 4))
    materialize(alone, "cpu", seed=1)
    assert tied[1].weight is tied[0].weight and torch.equal(tied[0].weight, alone[0].weight)


def test_meta_module_without_reset_parameters_is_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scaled(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'1\.scale' \(Scaled\).*reset_parameters"):
        check_initialisable(model)
    with pytest.raises(ValueError, match=r"'1\.scale'"):
        materialize(model, "cpu")
    assert model[0].weight.is_meta  # refused before anything was allocated


class Masked(nn.Module):
    """A layer with a buffer (and no reset_parameters): on the meta device nothing fills it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(16))

    def forward(self, x):
        return x * self.mask


def meta_errors_worker(rank, world):
    found = {}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), Masked(), nn.Linear(16, 4))
    try:  # the bad layer lands on rank 1: every rank must refuse alike (no rank left waiting)
        DistributedTrainer(model, _sgd, pipeline_parallel_size=2, microbatches=2).close()
        found["pipeline"] = None
    except ValueError as err:
        found["pipeline"] = str(err)
    with torch.device("meta"):
        plain = nn.Sequential(nn.Linear(16, 16), Scaled())
    try:
        DistributedTrainer(plain, _sgd).close()
        found["plain"] = None
    except ValueError as err:
        found["plain"] = str(err)
    # Without a pipeline a meta model that can be initialised works: every rank materialises it whole.
    trainer = DistributedTrainer(_meta_mlp(), _sgd, seed=SEED)
    reference = _meta_mlp()
    materialize(reference, "cpu", seed=SEED)
    got = trainer.full_state_dict()
    found["plain_ok"] = all(torch.equal(got[k], v) for k, v in reference.state_dict().items()) if rank == 0 else True
    trainer.close()
    return found


def test_meta_errors_name_the_tensor_on_every_rank():
    for found in run_distributed(meta_errors_worker, 2, timeout=120):
        assert found["pipeline"] is not None and "'2.mask'" in found["pipeline"], found
        assert found["plain"] is not None and "'1.scale'" in found["plain"], found
        assert found["plain_ok"], found

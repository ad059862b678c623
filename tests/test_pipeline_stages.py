"""Pipeline stages: the chain equals the model, the cut is optimal, each stage builds only its own
layers with the whole model's weights, and tied copies sum their gradients (on 2 real processes)."""

from __future__ import annotations

import copy
import itertools
import random
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_training.models import GPT, GPTConfig
from distributed_training.pipeline.gpt_stages import ATTENTION_CORE_COST, LOSS_FLOPS_PER_LOGIT
from distributed_training.pipeline import (GPTStages, Stage, TiedGroup, chain, find_ties, gpt_key, layer_seed, lm_loss,
                                           partition, split_at, sync_tied_grads, tied_groups)
from distributed_training.testing import run_distributed

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


def _batch(cfg=CFG, B=3, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def _run_chain(layers, x):
    for _, layer in layers:
        x = layer(x)
    return x


def _grads(module):
    return {k: p.grad.clone() for k, p in module.named_parameters()}


# ------------------------------------------------------------------------------------------- chain


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt_chain_with_the_criterion_is_gpt_forward(dropout):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CFG.__dict__, "dropout": dropout}))
    twin = copy.deepcopy(model)
    idx, targets = _batch()
    torch.manual_seed(1)  # the same dropout masks: the chain draws them in the model's order
    loss = model(idx, targets)
    loss.backward()
    layers = chain(twin)
    assert [name for name, _ in layers] == ["embed", "block.0", "block.1", "block.2", "block.3", "head"]
    torch.manual_seed(1)
    chained = lm_loss(_run_chain(layers, idx), targets)
    chained.backward()
    assert torch.equal(loss, chained)
    mine, reference = _grads(twin), _grads(model)
    assert mine.keys() == reference.keys()
    for k in reference:
        assert torch.equal(mine[k], reference[k]), k
    # The chain trains the model's own parameters, the tie kept: one parameter, two uses.
    assert layers[-1][1].lm_head.weight is twin.wte.weight
    assert find_ties(layers) == [("embed.wte.weight", "head.lm_head.weight")]


def test_tied_gradient_is_the_sum_of_both_uses():
    torch.manual_seed(0)
    model = GPT(CFG)
    untied = copy.deepcopy(model)
    untied.lm_head.weight = nn.Parameter(untied.wte.weight.detach().clone())
    idx, targets = _batch()
    model(idx, targets).backward()
    layers = chain(untied)
    lm_loss(_run_chain(layers, idx), targets).backward()
    assert find_ties(layers) == []
    both = untied.wte.weight.grad + untied.lm_head.weight.grad
    assert untied.wte.weight.grad.abs().sum() > 0 and untied.lm_head.weight.grad.abs().sum() > 0
    torch.testing.assert_close(model.wte.weight.grad, both, rtol=0, atol=1e-7)


@pytest.mark.parametrize("named", [False, True])
def test_sequential_chain_is_its_children(named):
    torch.manual_seed(0)
    parts = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)]
    if named:
        seq = nn.Sequential(OrderedDict((f"l{i}", m) for i, m in enumerate(parts)))
    else:
        seq = nn.Sequential(*parts)
    twin = copy.deepcopy(seq)
    x = torch.randn(5, 8)
    seq(x).square().mean().backward()
    layers = chain(twin)
    assert [n for n, _ in layers] == ([f"l{i}" for i in range(5)] if named else [str(i) for i in range(5)])
    out = _run_chain(layers, x)
    assert torch.equal(out, seq(x))
    out.square().mean().backward()
    for (k, g), (k2, g2) in zip(_grads(seq).items(), _grads(twin).items()):
        assert k == k2 and torch.equal(g, g2), k
    # Cut into stages, the same function.
    stages = [Stage(layers[lo:hi], s, 3) for s, (lo, hi) in enumerate(itertools.pairwise([0, 2, 3, 5]))]
    y = x
    for stage in stages:
        y = stage(y)
    assert torch.equal(y, seq(x))


def test_sequential_with_a_module_twice_keeps_both_uses():
    lin = nn.Linear(4, 4)
    seq = nn.Sequential(lin, nn.ReLU(), lin)
    layers = chain(seq)
    assert [n for n, _ in layers] == ["0", "1", "2"]
    assert find_ties(layers) == [("0.weight", "2.weight"), ("0.bias", "2.bias")]


def test_chain_rejects_other_models_and_checks_adapters():
    from _models import MLP

    with pytest.raises(TypeError, match=r"_models\.MLP.*adapter"):
        chain(MLP())
    layers = [("a", nn.Linear(2, 3)), ("b.c", nn.Linear(3, 2))]
    assert chain(layers) == layers and chain(layers) is not layers
    with pytest.raises(ValueError, match="'a' appears twice"):
        chain([("a", nn.ReLU()), ("a", nn.ReLU())])
    with pytest.raises(TypeError, match="item 1"):
        chain([("a", nn.ReLU()), nn.ReLU()])
    with pytest.raises(ValueError, match="invalid name 'b..c'"):
        chain([("b..c", nn.ReLU())])
    with pytest.raises(ValueError, match="no layers"):
        chain(nn.Sequential())


# --------------------------------------------------------------------------------------- the cut


def _brute_force(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        b = [0, *cuts, n]
        worst = max(sum(costs[lo:hi]) for lo, hi in zip(b, b[1:]))
        best = worst if best is None else min(best, worst)
    return best


def test_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        if trial % 3 == 0:
            costs = [rng.random() * 10 for _ in range(n)]
        else:
            costs = [rng.choice([0, 0, 1, 2, 3, 5, 8, 20]) for _ in range(n)]
        bounds = partition(costs, stages)
        assert len(bounds) == stages + 1 and bounds[0] == 0 and bounds[-1] == n
        assert all(lo < hi for lo, hi in zip(bounds, bounds[1:])), (costs, stages, bounds)  # none empty
        worst = max(sum(costs[lo:hi]) for lo, hi in zip(bounds, bounds[1:]))
        assert worst == pytest.approx(_brute_force(costs, stages), rel=1e-12, abs=0), (costs, stages, bounds)


def test_partition_evens_out_the_other_stages():
    # The first layer decides the largest stage (10); the other six split 3 / 3, not 1 / 5.
    assert partition([10, 1, 1, 1, 1, 1, 1], 3) == [0, 1, 4, 7]
    assert partition([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert partition([0, 0, 0], 3) == [0, 1, 2, 3]


def test_partition_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"stages \(4\) exceeds the number of layers \(3\)"):
        partition([1, 2, 3], 4)
    with pytest.raises(ValueError, match="stages must be an int >= 1"):
        partition([1, 2, 3], 0)
    with pytest.raises(ValueError, match=r"costs\[1\]"):
        partition([1, -2, 3], 2)
    with pytest.raises(ValueError, match=r"costs\[0\]"):
        partition([float("nan")], 1)


def test_split_at_and_its_errors():
    names = ["embed", "block.0", "block.1", "block.2", "head"]
    assert split_at([], names) == [0, 5]
    assert split_at(["block.1"], names) == [0, 2, 5]
    assert split_at(["block.0", "block.2", "head"], names) == [0, 1, 3, 4, 5]
    with pytest.raises(ValueError, match="'block.7' is not a layer"):
        split_at(["block.7"], names)
    with pytest.raises(ValueError, match="'block.0' is out of order"):
        split_at(["block.1", "block.0"], names)
    with pytest.raises(ValueError, match="'block.1' is repeated"):
        split_at(["block.1", "block.1"], names)
    with pytest.raises(ValueError, match="'embed' is the first layer"):
        split_at(["embed"], names)
    with pytest.raises(TypeError, match="boundary_names"):
        split_at("block.1", names)


# ------------------------------------------------------------------------------------------ Stage


def test_stage_registers_layers_under_their_chain_names():
    torch.manual_seed(0)
    model = GPT(CFG)
    layers = chain(model)
    stage = Stage(layers[2:], 1, 2)
    keys = list(stage.state_dict())
    assert keys[0] == "block.1.ln1.weight" and keys[-1] == "head.lm_head.weight"
    assert stage.names == ("block.1", "block.2", "block.3", "head") and stage.is_last and not stage.is_first
    # The keys are the chain's: the GPT's own state_dict under gpt_key.
    reference = model.state_dict()
    for k, v in stage.state_dict().items():
        assert v is reference[gpt_key(k)] or torch.equal(v, reference[gpt_key(k)])
    with pytest.raises(ValueError, match="index must be"):
        Stage(layers, 2, 2)
    with pytest.raises(ValueError, match="num_stages must be"):
        Stage(layers, 0, 0)
    with pytest.raises(ValueError, match="'block.0' would go inside layer 'block'"):
        Stage([("block", nn.ReLU()), ("block.0", nn.ReLU())], 0, 1)


# ----------------------------------------------------------------------------------- GPTStages


def _count(module):
    return sum(p.numel() for p in module.parameters())


def test_gpt_stages_costs_and_balance():
    builder = GPTStages(CFG)
    counts = builder.costs()
    C, V, T = CFG.n_embd, CFG.vocab_size, CFG.block_size
    with torch.device("meta"):
        whole = GPT(CFG)
    block = _count(whole.blocks[0])
    assert counts == [V * C + CFG.block_size * C, *[block] * CFG.n_layer, V * C + 2 * C]  # the tie in both
    # per token: a lookup, the blocks' matmuls and attention, the head's matmul and its loss's memory traffic
    forward, backward = builder.step_costs()
    attention = 8 * C * C + ATTENTION_CORE_COST * 2 * T * C
    assert forward == [C, *[attention + 16 * C * C] * CFG.n_layer, 2 * C * V + LOSS_FLOPS_PER_LOGIT * V]
    assert builder.compute_costs() == [f + b for f, b in zip(forward, backward)]
    assert builder.step_costs(loss=False)[0] == [*forward[:-1], 2 * C * V]
    assert builder.step_costs(microbatch_tokens=2 * T)[1][0] == backward[0] / 2  # the embedding's, per microbatch
    costs = counts
    for S in range(1, 7):
        assert builder.bounds(S) == partition(costs, S)
    assert builder.bounds(3, split=["block.1", "block.3"]) == [0, 2, 4, 6]
    with pytest.raises(ValueError, match="num_stages"):
        builder.bounds(7)
    with pytest.raises(ValueError, match="split names 3 stages"):
        builder.bounds(2, split=["block.1", "block.3"])
    assert builder.tied_groups(1) == []
    assert builder.tied_groups(3) == [
        TiedGroup("embed.wte.weight", (0, 2), ("embed.wte.weight", "head.lm_head.weight"))]
    with pytest.raises(ValueError, match="costs has 2 entries"):
        builder.bounds(2, costs=[1, 2])


@pytest.mark.parametrize("S,halves", [(1, False), (2, False), (3, False), (5, False), (2, True), (5, True)])
def test_gpt_stages_compose_to_the_single_stage_build(S, halves):
    builder = GPTStages(CFG, seed=3, halves=halves)
    reference = builder.build(0, 1, "cpu")
    stages = [builder.build(s, S, "cpu") for s in range(S)]
    costs, bounds = builder.costs(), builder.bounds(S)
    ref_state = reference.state_dict()
    C, V = CFG.n_embd, CFG.vocab_size
    for s, stage in enumerate(stages):
        # Only its own layers, with the whole model's weights.
        assert stage.names == tuple(builder.layer_names()[bounds[s]:bounds[s + 1]])
        own = sum(costs[bounds[s]:bounds[s + 1]]) - (V * C if S == 1 else 0)  # one tensor when both on it
        assert _count(stage) == own
        for k, v in stage.state_dict().items():
            assert torch.equal(v, ref_state[k]), (S, s, k)
    assert sum(_count(st) for st in stages) == _count(reference) + (V * C if S > 1 else 0)

    # Forward stage by stage with the boundary cut as a pipeline cuts it (each stage's input a leaf),
    # backward from the last stage to the first, passing the input gradient back.
    idx, targets = _batch()
    ref_logits = reference(idx)
    ref_loss = lm_loss(ref_logits, targets)
    ref_loss.backward()
    inputs, outputs = [], []
    x = idx
    for stage in stages:
        x = x.detach().requires_grad_(x.is_floating_point())
        inputs.append(x)
        outputs.append(stage(x))
        x = outputs[-1]
    assert torch.equal(x, ref_logits)
    loss = lm_loss(x, targets)
    assert torch.equal(loss, ref_loss)
    grad = None
    for s in reversed(range(S)):
        if s == S - 1:
            loss.backward()
        else:
            outputs[s].backward(grad)
        grad = inputs[s].grad
    # What sync_tied_grads does between the first and last stage: sum the copies' gradients.
    tied = builder.tied_groups(S)
    if S > 1:
        (group,) = tied
        copies = [stages[s].get_parameter(group.key_on(s)) for s in group.stages]
        tied_ref = reference.get_parameter("embed.wte.weight").grad
        for p in copies:  # each copy alone has only its own use's gradient
            assert not torch.allclose(p.grad, tied_ref, atol=1e-6)
        total = sum(p.grad for p in copies)
        for p in copies:
            p.grad = total.clone()
    for stage in stages:
        for k, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, reference.get_parameter(k).grad, rtol=0, atol=1e-7, msg=k)


def test_half_blocks_hold_the_whole_blocks_weights_and_compute_the_same():
    """A chain cut at half blocks (`halves=True`): ``block.i.a`` / ``block.i.m``, each with exactly the
    weights the whole block has (same seed), keys mapping to the GPT's, the same logits, a finer balance."""
    rng_before = torch.random.get_rng_state()
    whole, halves = GPTStages(CFG, seed=3), GPTStages(CFG, seed=3, halves=True)
    assert halves.layer_names() == ["embed", *(f"block.{i}.{h}" for i in range(CFG.n_layer) for h in "am"), "head"]
    ref = whole.model().state_dict()
    for S in (1, 3):
        for s in range(S):
            for k, v in halves.build(s, S).state_dict().items():
                assert torch.equal(v, ref[gpt_key(k)]), (S, s, k)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the scratch draws touch no global stream
    assert gpt_key("block.3.a.ln1.weight") == "blocks.3.ln1.weight"
    assert gpt_key("block.3.m.mlp.2.weight") == "blocks.3.mlp.2.weight"
    assert gpt_key("block.3.attn.qkv.weight") == "blocks.3.attn.qkv.weight"
    idx, _ = _batch()
    assert torch.equal(halves.build(0, 1)(idx), whole.build(0, 1)(idx))
    C, T = CFG.n_embd, CFG.block_size
    assert halves.step_costs()[0][1:3] == [8 * C * C + ATTENTION_CORE_COST * 2 * T * C, 16 * C * C]
    assert sum(halves.compute_costs()) == sum(whole.compute_costs())
    assert halves.stage_names(1, 2, split=["block.2.m"])[0] == "block.2.m"
    with pytest.raises(ValueError, match="blocks in halves"):
        halves.bounds(2 * CFG.n_layer + 3)


def test_gpt_stages_weights_depend_on_seed_and_name_only():
    rng_before = torch.random.get_rng_state()
    a = GPTStages(CFG, seed=0).build(1, 3)
    b = GPTStages(CFG, seed=0).build(1, 3)
    c = GPTStages(CFG, seed=1).build(1, 3)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the global stream is untouched
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.state_dict()["block.1.attn.qkv.weight"], c.state_dict()["block.1.attn.qkv.weight"])
    # Blocks differ from each other (each its own seed), and GPT's initialisation rules hold.
    whole = GPTStages(CFG).build(0, 1)
    sd = whole.state_dict()
    assert not torch.equal(sd["block.0.attn.qkv.weight"], sd["block.1.attn.qkv.weight"])
    assert torch.equal(sd["block.0.ln1.weight"], torch.ones(CFG.n_embd))
    assert torch.equal(sd["block.0.attn.qkv.bias"], torch.zeros(3 * CFG.n_embd))
    assert sd["block.0.attn.proj.weight"].std() < 0.6 * sd["block.0.attn.qkv.weight"].std()  # 0.02 / sqrt(8)
    assert whole.get_parameter("head.lm_head.weight") is whole.get_parameter("embed.wte.weight")
    assert layer_seed(0, "block.1") != layer_seed(0, "block.2") != layer_seed(1, "block.2")


def test_gpt_stages_on_meta_and_the_reference_model():
    meta = GPTStages(CFG).build(2, 3, "meta")
    assert all(p.is_meta for p in meta.parameters()) and meta.names[-1] == "head"
    builder = GPTStages(CFG, seed=5)
    model = builder.model()
    assert model.lm_head.weight is model.wte.weight
    assert not any(p.is_meta for p in model.parameters())
    idx, targets = _batch()
    whole = builder.build(0, 1)
    assert torch.equal(model(idx, targets), lm_loss(whole(idx), targets))
    for k, v in whole.state_dict().items():
        assert torch.equal(v, model.state_dict()[gpt_key(k)])


def test_tied_groups_for_a_chain():
    torch.manual_seed(0)
    layers = chain(GPT(CFG))
    names = [n for n, _ in layers]
    ties = find_ties(layers)
    assert tied_groups(ties, names, [0, 6]) == []
    assert tied_groups(ties, names, [0, 3, 6]) == [
        TiedGroup("embed.wte.weight", (0, 1), ("embed.wte.weight", "head.lm_head.weight"))]
    with pytest.raises(ValueError, match="'nope.weight' is not a parameter key"):
        tied_groups([("nope.weight", "head.lm_head.weight")], names, [0, 3, 6])
    with pytest.raises(ValueError, match="bounds must rise"):
        tied_groups(ties, names, [0, 3, 3, 6])
    with pytest.raises(ValueError, match="stage 1 holds no copy"):
        TiedGroup("w", (0, 2), ("a", "b")).key_on(1)


# ------------------------------------------------------------------------------ sync_tied_grads


def sync_worker(rank, world):
    """Stage `rank` of a 2-stage GPT on each rank: activation and gradient travel by send/recv, then
    the tied copies' gradients are summed; the untouched-copy case syncs zeros into a sum."""
    builder = GPTStages(CFG, seed=3)
    stage = builder.build(rank, 2, "cpu")
    tied = builder.tied_groups(2)
    idx, targets = _batch()
    shape = (idx.size(0), idx.size(1), CFG.n_embd)
    if rank == 0:
        out = stage(idx)
        dist.send(out.detach(), 1)
        grad = torch.empty(shape)
        dist.recv(grad, 1)
        out.backward(grad)
    else:
        x = torch.empty(shape)
        dist.recv(x, 0)
        x.requires_grad_()
        loss = lm_loss(stage(x), targets)
        loss.backward()
        dist.send(x.grad, 0)
    before = stage.get_parameter(tied[0].key_on(rank)).grad.clone()
    synced = sync_tied_grads(stage, tied, None)
    grads = {k: p.grad.clone() for k, p in stage.named_parameters()}
    # A copy with no gradient takes part as zeros: rank 1 clears its grad, rank 0 keeps its own.
    p = stage.get_parameter(tied[0].key_on(rank))
    p.grad = None if rank == 1 else before.clone()
    sync_tied_grads(stage, tied)
    after_none = p.grad.clone()
    errors = []
    for bad in ([TiedGroup("x", (0, 1), ("embed.wte.weight", "head.lm_head.weight")),
                 TiedGroup("y", (0, 1, 2), ("embed.wte.weight", "a", "head.lm_head.weight"))],
                [TiedGroup("y", (0, 1, 2), ("embed.wte.weight", "a", "head.lm_head.weight")) if rank == 0 else
                 TiedGroup("y", (0, 1, 2), ("a", "head.lm_head.weight", "b"))]):
        try:
            sync_tied_grads(stage, bad)
        except ValueError as e:
            errors.append(str(e))
    return synced, before, grads, after_none, errors


def test_sync_tied_grads_on_two_ranks():
    results = run_distributed(sync_worker, 2, timeout=90)
    builder = GPTStages(CFG, seed=3)
    reference = builder.build(0, 1)
    idx, targets = _batch()
    lm_loss(reference(idx), targets).backward()
    (s0, before0, grads0, none0, errors0), (s1, before1, grads1, none1, errors1) = results
    assert s0 == s1 == 1
    # Each copy alone has only its own use's gradient; synced, both have the tied parameter's.
    tied_ref = reference.get_parameter("embed.wte.weight").grad
    assert not torch.allclose(before0, tied_ref, atol=1e-6) and not torch.allclose(before1, tied_ref, atol=1e-6)
    for grads in (grads0, grads1):
        for k, g in grads.items():
            torch.testing.assert_close(g, reference.get_parameter(k).grad, rtol=0, atol=1e-7, msg=k)
    assert torch.equal(grads0["embed.wte.weight"], grads1["head.lm_head.weight"])
    assert torch.equal(none0, before0) and torch.equal(none1, before0)
    for errors in (errors0, errors1):
        assert len(errors) == 2
        assert "span different stages" in errors[0] and "group has 2 ranks but the ties span 3 stages" in errors[1]


def test_gpt_compute_model_gives_the_measured_step_ratios():
    """The compute model against what it was fitted to: session 27's per-stage times on 4x H200 at
    GPT-1.3B, 8 microbatches of 2 x 1024 tokens (`benchmarks/results/pipeline_2026-11-28_4xh200_s27.md`):
    per step, forward / backward, an MLP half 2.24 / 5.7 ms, an attention half 1.72 / 4.4, the head
    11.46 / 19.1, the embedding 0.0 / 2.2."""
    from distributed_training.models.gpt import GPT_PRESETS

    forward, backward = GPTStages(GPT_PRESETS["gpt-1.3b"], halves=True).step_costs(1024, microbatch_tokens=2048)
    step = [f + b for f, b in zip(forward, backward)]
    embed, attention, mlp, head = step[0], step[1], step[2], step[-1]
    measured = {"attention": (1.72 + 4.4) / (2.24 + 5.7), "head": (11.46 + 19.1) / (2.24 + 5.7),
                "embed": 2.2 / (2.24 + 5.7)}
    for name, model in (("attention", attention / mlp), ("head", head / mlp), ("embed", embed / mlp)):
        assert model == pytest.approx(measured[name], rel=0.03), (name, model, measured[name])
    assert forward[-1] / forward[2] == pytest.approx(11.46 / 2.24, rel=0.03)  # the head's forward alone
    assert backward[1] / forward[1] == pytest.approx(4.4 / 1.72, rel=0.03)

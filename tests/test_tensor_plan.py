"""Tensor-parallel plans applied to whole models, against one process on the whole model.

Each case builds a model from a seed, keeps a copy as the single-process reference, applies the
model's plan over a tensor group on every rank and trains both for a few steps on the same full
batch (every tensor rank sees it all), with SGD and momentum (AdamW for one model: Adam's scale
invariance hides gradient-scaling bugs, so it is not the only optimizer). The loss of a vocabulary-
split head is the vocabulary-parallel cross-entropy. After backward the gradients of the parameters
that saw a part of the sequence are summed over the tensor group (the trainer's job). After every
step every parameter, reassembled from the tensor ranks with `unshard`, must equal the reference's.

Models: our GPT (tied embedding and head), a Llama-style stack (RMSNorm, grouped-query attention with
rotary embedding, SwiGLU, untied head), an MLP over tokens with a user's plan, and Hugging Face
GPT-2's layout (Conv1D, fused c_attn) with the documented plan. Tensor sizes 2 and 4 on worlds of 2
and 4 (with two tensor groups side by side at TP = 2 on 4 ranks), with and without sequence
parallelism.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed_training.models import GPT, GPTConfig
from distributed_training.tensor import (ShardSpec, apply_plan, gpt_plan, is_cross_entropy, is_sequence_parallel,
                                         parallel_loss, spec_of, unshard)
from distributed_training.testing import run_distributed

from _tp_models import MLP_PLAN, HFGPT2, Llama, hf_gpt2_localize, hf_gpt2_plan, llama_plan, token_mlp

TOL = 1e-5
STEPS = 3
VOCAB, SEQ, BATCH = 64, 8, 2
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32)
MODELS = ("gpt", "llama", "mlp", "hf_gpt2")


def _tensor_group(world: int, size: int):
    """This rank's tensor group: consecutive ranks (every rank creates every group, in order)."""
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= dist.get_rank() < start + size:
            mine = group
    return mine


def _build(case: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    if case == "gpt":
        return GPT(GPT_CFG), gpt_plan(GPT_CFG)
    if case == "llama":
        return Llama(vocab=VOCAB), llama_plan()
    if case == "mlp":
        return token_mlp(), MLP_PLAN
    return HFGPT2(vocab=VOCAB), hf_gpt2_plan()


def _batch(case: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if case == "mlp":
        return torch.randn(BATCH, SEQ, 16, generator=g), torch.randn(BATCH, SEQ, 16, generator=g)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.roll(idx, -1, dims=1)
    targets[0, -1] = -100  # one ignored target
    return idx, targets


def _reference_loss(case: str, model: nn.Module, x, y) -> torch.Tensor:
    if case == "gpt":
        return model(x, y)
    if case == "mlp":
        return F.mse_loss(model(x), y)
    smoothing = 0.0 if case == "llama" else 0.1
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1), label_smoothing=smoothing)


def _parallel_loss(case: str, model: nn.Module, x, y, group, sp: bool) -> torch.Tensor:
    if case == "gpt":
        return model(x, y)  # the model finds its vocabulary-parallel loss itself
    if case == "mlp":
        out = model(x)
        if sp:  # the output is this rank's part of the sequence: its share of the global mean
            part = SEQ // dist.get_world_size(group)
            y = y.narrow(1, dist.get_rank(group) * part, part)
            return F.mse_loss(out, y, reduction="sum") / (BATCH * SEQ * 16)
        return F.mse_loss(out, y)
    criterion = F.cross_entropy if case == "llama" else nn.CrossEntropyLoss(label_smoothing=0.1)
    assert is_cross_entropy(criterion)
    return parallel_loss(model, criterion)(model(x), y)  # logits stay split by vocabulary


def _full(param: torch.Tensor, group) -> torch.Tensor:
    spec = spec_of(param)
    if spec is None:
        return param.detach()
    parts = [torch.empty_like(param) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return unshard(parts, spec)


def _train_and_compare(case: str, group, sp: bool, optimizer: str) -> list[str]:
    model, plan = _build(case)
    reference = copy.deepcopy(model)
    specs = apply_plan(model, plan, group, sequence_parallel=sp)
    size = dist.get_world_size(group)
    if case == "hf_gpt2":
        hf_gpt2_localize(model, size)
    assert set(model.state_dict()) == set(reference.state_dict()), case  # the plain model's keys
    assert all(isinstance(s, ShardSpec) for s in specs.values()) and specs, case
    if case in ("gpt", "hf_gpt2"):  # the tie survives: one local parameter, both keys described
        head = model.lm_head.weight
        assert head is (model.wte.weight if case == "gpt" else model.transformer.wte.weight), case
        assert specs["lm_head.weight"] == spec_of(head), case

    def make(m):
        if optimizer == "adamw":
            return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    opt, ref_opt = make(model), make(reference)
    errors = []
    for step in range(STEPS):
        x, y = _batch(case, step)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad(set_to_none=True)
        loss = _parallel_loss(case, model, x, y, group, sp)
        ref_loss = _reference_loss(case, reference, x, y)
        loss.backward()
        ref_loss.backward()
        value = loss.detach().clone()
        if case == "mlp" and sp:  # each rank's loss is its share: the sum over the tensor group is the loss
            dist.all_reduce(value, group=group)
        for p in model.parameters():
            if is_sequence_parallel(p) and p.grad is not None:
                dist.all_reduce(p.grad, group=group)
        opt.step()
        ref_opt.step()
        if abs(value.item() - ref_loss.item()) > TOL:
            errors.append(f"{case} step {step}: loss {value.item()} vs {ref_loss.item()}")
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            diff = (_full(p, group) - ref_params[name].detach()).abs().max().item()
            if diff > TOL:
                errors.append(f"{case} step {step}: {name} differs by {diff:.3g}")
    return errors


def _parity_job(rank: int, world: int, size: int, sp: bool) -> list[str]:
    torch.use_deterministic_algorithms(True)
    group = _tensor_group(world, size)
    errors = []
    for case in MODELS:
        if case == "hf_gpt2" and sp:  # GPT2Model reshapes at the whole sequence: no sequence parallelism
            continue
        errors += _train_and_compare(case, group, sp, "adamw" if case == "llama" else "sgd")
    marked = any(is_sequence_parallel(p) for p in _marked_gpt(group, sp).parameters())
    if marked != sp:
        errors.append(f"sequence_parallel={sp}: GPT LayerNorm parameters marked: {marked}")
    return errors


def _marked_gpt(group, sp: bool) -> nn.Module:
    model = GPT(GPT_CFG)
    apply_plan(model, gpt_plan(GPT_CFG), group, sequence_parallel=sp)
    return model


@pytest.mark.parametrize("world,size", [(2, 2), (4, 4), (4, 2)])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
def test_plans_match_one_process(world, size, sp):
    for rank, errors in enumerate(run_distributed(_parity_job, world, args=(size, sp), timeout=120)):
        assert not errors, f"rank {rank}: " + "\n".join(errors[:10])


# -- one tensor rank: the plan changes nothing numerically -----------------------------------------------

def _single_rank_job(rank: int, world: int) -> list[str]:
    errors = []
    x, y = _batch("gpt", 0)
    for sp in (False, True):
        torch.manual_seed(0)
        plain = GPT(GPT_CFG)
        model = copy.deepcopy(plain)
        specs = apply_plan(model, gpt_plan(GPT_CFG), None, sequence_parallel=sp)  # None: the default group
        split = ("attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight")
        expected = {k for k in plain.state_dict() if k in ("wte.weight", "lm_head.weight") or k.endswith(split)}
        if set(specs) != expected:
            errors.append(f"sp={sp}: specs for {sorted(specs)}")
        if not torch.equal(model(x), plain(x)):
            errors.append(f"sp={sp}: logits differ at TP=1")
        loss, ref = model(x, y), plain(x, y)
        if abs(loss.item() - ref.item()) > 1e-6:
            errors.append(f"sp={sp}: loss {loss.item()} vs {ref.item()} at TP=1")
        if not torch.equal(copy.deepcopy(model)(x), model(x)):  # a deep copy (pipeline balancing) works
            errors.append(f"sp={sp}: a deep copy computes differently")
    # With dropout, the plan's dropouts draw what the plain ones draw (same masks, same RNG use).
    cfg = GPTConfig(**{**GPT_CFG.__dict__, "dropout": 0.2})
    torch.manual_seed(0)
    plain = GPT(cfg)
    model = copy.deepcopy(plain)
    apply_plan(model, gpt_plan(cfg), None, sequence_parallel=True)
    losses = []
    for m in (plain, model):
        torch.manual_seed(5)
        losses.append(torch.stack([m(x, y).detach() for _ in range(2)]))  # two steps' masks
    if not torch.allclose(losses[0], losses[1], rtol=0, atol=1e-6) or torch.equal(losses[0][0], losses[0][1]):
        errors.append(f"dropout: losses {losses[1].tolist()} vs {losses[0].tolist()} at TP=1")
    return errors


def test_plan_at_one_tensor_rank_is_the_plain_model():
    assert run_distributed(_single_rank_job, 1, timeout=60) == [[]]


# -- errors: each names what is wrong, and a failed apply leaves the model untouched ----------------------

def _snapshot(model: nn.Module):
    return ([(n, type(m)) for n, m in model.named_modules()], [(n, id(p)) for n, p in model.named_parameters()],
            [any(map(is_sequence_parallel, model.parameters())), any(spec_of(p) for p in model.parameters())],
            [len(m._forward_pre_hooks) for m in model.modules()])


def _error(model: nn.Module, plan, group, **kwargs) -> str:
    before = _snapshot(model)
    try:
        apply_plan(model, plan, group, **kwargs)
    except ValueError as e:
        assert _snapshot(model) == before, f"a failed apply changed the model: {e}"
        return str(e)
    raise AssertionError(f"no error for {plan}")


class _PerHeadAttention(nn.Module):
    """q, k and v fused per head (Bloom's layout: heads x (q, k, v) x head_dim), where a plain split is right."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = 4, 2
        self.qkv = nn.Linear(8, 24)


def _errors_job(rank: int, world: int) -> dict[str, str]:
    group = dist.group.WORLD  # T = 4
    torch.manual_seed(0)
    gpt = GPT(GPT_CFG)
    two_heads = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=2, n_embd=32))
    narrow = nn.Sequential(nn.Linear(8, 30), nn.ReLU(), nn.Linear(30, 8))
    out = {
        "nothing": _error(gpt, {**gpt_plan(), "blocks.*.attn.qkvz": "colwise"}, group),
        "heads": _error(two_heads, gpt_plan(), group, sequence_parallel=True),
        "width": _error(narrow, {"0": "colwise", "2": "rowwise"}, group),
        "rows": _error(narrow, {"2": "rowwise"}, group),
        "type": _error(gpt, {"blocks.0.ln1": "colwise"}, group),
        "vocab_type": _error(gpt, {"blocks.0.ln1": "vocab"}, group),
        "style": _error(gpt, {"wte": "columnwise"}, group),
        "chunks": _error(gpt, {"blocks.*.attn.qkv": ("rowwise", 3)}, group),
        "tie": _error(gpt, {**gpt_plan(), "lm_head": "replicate"}, group),
        # A fused q/k/v given a plain 'colwise' (trained silently wrong: 2.5e-3 off after one step, a trial).
        "fused": _error(gpt, {**gpt_plan(), "blocks.*.attn.qkv": "colwise"}, group),
    }
    # Only layouts known to be [q | k | v] are checked: a fused projection laid out per head (Bloom's) or
    # any linear of a module that happens to have head counts is a plan as given (a review's false positives).
    apply_plan(_PerHeadAttention(), {"qkv": "colwise"}, group)
    apply_plan(gpt, gpt_plan(), group)
    out["twice"] = _error(gpt, gpt_plan(), group)
    mlp = token_mlp()
    apply_plan(mlp, MLP_PLAN, group)
    out["no_head"] = str(parallel_loss(mlp))
    out["criterion"] = ""
    try:
        parallel_loss(gpt, F.mse_loss)
    except ValueError as e:
        out["criterion"] = str(e)
    loss = parallel_loss(gpt, nn.CrossEntropyLoss(ignore_index=0, reduction="sum", label_smoothing=0.1))
    out["options"] = f"{loss.ignore_index} {loss.reduction} {loss.label_smoothing} {loss.vocab_start}"
    return out


def test_plan_errors_name_the_culprit():
    out = run_distributed(_errors_job, 4, timeout=60)
    msgs = out[0]
    assert "'blocks.*.attn.qkvz'" in msgs["nothing"] and "matches no module" in msgs["nothing"]
    assert "blocks.0.attn" in msgs["heads"] and "n_head=2" in msgs["heads"] and "T=4" in msgs["heads"]
    assert "0 (Linear" in msgs["width"] and "30" in msgs["width"] and "T=4" in msgs["width"]
    assert "2 (Linear" in msgs["rows"] and "input features 30" in msgs["rows"] and "T=4" in msgs["rows"]
    for key in ("type", "vocab_type"):
        assert "blocks.0.ln1 (LayerNorm)" in msgs[key], msgs[key]
    assert "'colwise'" in msgs["type"] and "'vocab'" in msgs["vocab_type"]
    assert "'columnwise'" in msgs["style"] and "'wte'" in msgs["style"]
    assert "('rowwise', 3)" in msgs["chunks"]
    assert "blocks.0.attn.qkv" in msgs["fused"] and "give it ('colwise', 3)" in msgs["fused"], msgs["fused"]

    assert "wte.weight" in msgs["tie"] and "lm_head.weight" in msgs["tie"] and "'replicate'" in msgs["tie"]
    assert "already" in msgs["twice"]
    assert msgs["no_head"] == "None"
    assert "tensor_parallel_plan" in msgs["criterion"] and "mse_loss" in msgs["criterion"]
    assert [o["options"] for o in out] == [f"0 sum 0.1 {r * VOCAB // 4}" for r in range(4)]


def test_cross_entropy_recognised():
    import functools
    assert is_cross_entropy(F.cross_entropy) and is_cross_entropy(nn.CrossEntropyLoss(ignore_index=3))
    assert is_cross_entropy(functools.partial(F.cross_entropy, reduction="sum"))
    assert is_cross_entropy(nn.CrossEntropyLoss(label_smoothing=0.1))
    assert not is_cross_entropy(nn.CrossEntropyLoss(weight=torch.ones(4)))
    assert not is_cross_entropy(functools.partial(F.cross_entropy, weight=torch.ones(4)))
    assert not is_cross_entropy(F.mse_loss) and not is_cross_entropy(nn.NLLLoss())


def test_gpt_forward_with_its_loss_hook_is_one_graph():
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    x, y = _batch("gpt", 0)
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # raises on a graph break
    assert torch.equal(compiled(x, y), model(x, y))


def test_plan_without_a_process_group_is_the_plain_model():
    """No process group: T = 1 (as the layers' own rank and size say), the model computes as before."""
    assert not dist.is_initialized()
    torch.manual_seed(0)
    plain = GPT(GPT_CFG)
    model = copy.deepcopy(plain)
    specs = apply_plan(model, gpt_plan(GPT_CFG))
    assert specs and all(spec.parts == 1 for spec in specs.values()), specs
    x, y = _batch("gpt", 0)
    assert torch.equal(model(x), plain(x))  # logits bit for bit; the loss is the vocabulary-parallel one
    torch.testing.assert_close(model(x, y), plain(x, y), rtol=1e-6, atol=1e-6)


class _SharedWeight(nn.Module):
    """One weight in two column-parallel layers (`a`, `b`: their biases their own), each followed by its
    row-parallel layer (`c` without bias); the second branch's output layer without bias too."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight
        self.c, self.d = nn.Linear(8, 4, bias=False), nn.Linear(8, 4)
        self.e = nn.Linear(4, 6, bias=False)

    def forward(self, x):
        return self.e(self.c(torch.tanh(self.a(x))) + self.d(torch.tanh(self.b(x))))


def _shared_job(rank: int, world: int) -> list[str]:
    errors = []
    torch.manual_seed(0)
    plain = _SharedWeight().double()
    model = copy.deepcopy(plain)
    plan = {"[ab]": "colwise", "[cd]": "rowwise", "e": ("colwise", 3)}
    specs = apply_plan(model, plan, None)
    model.e.gather_output = True  # the whole output, its 3 blocks back in the plain layer's order
    if model.a.weight is not model.b.weight or {"a.weight", "b.weight"} - set(specs):
        errors.append(f"the shared weight is not one split parameter under both keys: {sorted(specs)}")
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, want = model(x), plain(x)
    if not torch.allclose(got, want, atol=1e-12):
        errors.append(f"outputs differ by {(got - want).abs().max().item()}")
    got.square().sum().backward()
    want.square().sum().backward()
    for name, p in model.named_parameters():
        full = dict(plain.named_parameters())[name]
        grad = p.grad
        if name in specs:
            parts = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(parts, grad.contiguous())
            grad = unshard(parts, specs[name])
        if not torch.allclose(grad, full.grad, atol=1e-12):
            errors.append(f"{name}: gradient differs by {(grad - full.grad).abs().max().item()}")
    return errors


def test_a_weight_shared_by_two_split_layers_and_layers_without_bias():
    assert run_distributed(_shared_job, 2, timeout=60) == [[], []]

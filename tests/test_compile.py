"""Our wrappers as ordinary nn.Modules: DDP's state_dict keys like torch's DDP, and torch.compile of DDP,
ZeRO-1, FSDP and the trainer, in either order and per block, equal to eager and to one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from distributed_training import DDP
from distributed_training.testing import run_distributed

from _models import ConvBN
from _once import run_once

# The compiled tests' parts run in one job (`compiled_job`, at the end). Its limit: a hang is a failure
# after it (all the parts: ~145 s in CI's last run as nine jobs; 203 s as one on 2 cores at a load of
# 10-13). The tests that use it wait for it within pytest's own limit, raised to past it.
JOB_TIMEOUT = 900
waits_for_the_job = pytest.mark.timeout(JOB_TIMEOUT + 60)


def state_dict_worker(rank, world):
    torch.manual_seed(0)
    model = ConvBN()
    ddp = DDP(model)
    sd = ddp.state_dict()
    # As torch's DDP: the wrapped module's entries under "module.", buffers included.
    assert list(sd) == ["module." + k for k in model.state_dict()], list(sd)[:4]
    assert [n for n, _ in ddp.named_buffers()] == ["module." + n for n, _ in model.named_buffers()]
    changed = {k: v + 1 if v.is_floating_point() else v for k, v in sd.items()}
    ddp.load_state_dict(changed)
    assert all(torch.equal(model.state_dict()[k[len("module."):]], v) for k, v in changed.items())
    return True


@pytest.mark.slow
def test_ddp_state_dict_and_buffers_like_torch_ddp():
    assert run_distributed(state_dict_worker, 2, timeout=120) == [True, True]


def compile_worker(rank, world, order):
    """Each step, the compiled run's parameters and BatchNorm buffers equal the eager run's."""
    torch.manual_seed(0)
    eager_model, compiled_model = ConvBN(), ConvBN()
    compiled_model.load_state_dict(eager_model.state_dict())
    eager = DDP(eager_model)
    if order == "compile(ddp)":
        compiled = torch.compile(DDP(compiled_model), backend="eager")
    else:
        compiled = DDP(torch.compile(compiled_model, backend="eager"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager_model, compiled_model)]
    g = torch.Generator().manual_seed(100 + rank)
    for step in range(4):
        x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
        for wrapped, opt in zip((eager, compiled), opts):
            F.cross_entropy(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for (name, a), b in zip(eager_model.state_dict().items(), compiled_model.state_dict().values()):
            assert torch.allclose(a.float(), b.float(), atol=1e-6), (order, step, name)
    return True


@pytest.mark.slow
@waits_for_the_job
def test_torch_compile_in_either_order_matches_eager(compiled_job):
    for order in ("compile(ddp)", "ddp(compile)"):
        assert compiled_job(("order", order)) == [True, True]


# ------------------------------------------------------------------ every wrapper, every order, against eager and one process
# A GPT small enough to compile in about a second, with blocks to compile one by one (and to be FSDP's
# units) and a tied embedding (one parameter in two modules: two owners under ZeRO-1 and FSDP).
CFG = dict(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
PER_RANK, STEPS = 2, 3
MODES = ("eager", "compile(wrapper)", "wrapper(compile)", "blocks")
TIGHT = 1e-6  # compiled against the same wrapper in eager mode (aot_eager: the same kernels)
TOL = 1e-5    # against one process on the whole batch (another summation order)


def _gpt():
    from distributed_training.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _batches(world):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CFG["vocab_size"], (PER_RANK * world, CFG["block_size"] + 1), generator=g)
            for _ in range(STEPS)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class _HeldGather:
    """An all-gather whose result reaches the parameters only when it is waited for: a forward that
    skipped its wait computes with the parameters of before the step, and the test sees it."""

    def __init__(self, out, shard, group, async_op=False):
        from distributed_training.comm.sharded import all_gather_flat

        self.out, self.staging = out, torch.empty_like(out)
        self.work = all_gather_flat(self.staging, shard, group, async_op=True)
        self.done = False

    def wait(self):
        self.work.wait()
        if not self.done:
            self.done = True
            self.out.copy_(self.staging)
        return True


def _wrap(kind, model, mode, backend):
    """(what to call, the optimizer, a function returning the parameters by the plain model's names)."""
    from distributed_training import FSDP
    from distributed_training.strategies.zero1 import Zero1Strategy, Zero1DDP

    if mode == "wrapper(compile)":
        model = torch.compile(model, backend=backend)
    elif mode == "blocks":
        for block in model.blocks:
            block.compile(backend=backend)
    if kind == "fsdp":
        wrapped = FSDP(model)
        opt = _sgd(wrapped.parameters())
        params = lambda: wrapped.full_state_dict(rank0_only=False)  # noqa: E731
    elif kind == "zero1":
        wrapped = Zero1DDP(model, bucket_cap_mb=2000 / 2**20, first_bucket_cap_mb=500 / 2**20)
        assert len(wrapped.shards) >= 3, len(wrapped.shards)  # gathers in flight when each forward starts
        opt = Zero1Strategy().setup_optimizer(_sgd, wrapped)
        params = lambda: _owned_slices(wrapped)  # noqa: E731
    else:
        wrapped = DDP(model)
        opt = _sgd(wrapped.parameters())
        params = lambda: wrapped.state_dict()  # noqa: E731
    call = torch.compile(wrapped, backend=backend) if mode == "compile(wrapper)" else wrapped

    def named():
        return {_plain_name(k): v.detach().clone() for k, v in params().items()}

    return call, opt, named


def _plain_name(key: str) -> str:
    """The plain model's name of a wrapper's (or a compiled module's) parameter."""
    for prefix in ("module.", "_orig_mod."):
        key = key[len(prefix):] if key.startswith(prefix) else key
    return key.replace("._orig_mod", "")


def _owned_slices(zero1) -> dict:
    """ZeRO-1: the part of each parameter this rank's optimizer owns, as the step left it, read without
    waiting for the all-gathers (so that the next forward starts with them in flight). Keyed
    ``name@start:end``, flat element ranges of the parameter; the two ranks together own everything."""
    names = {id(p): name for name, p in zero1.module.named_parameters()}
    out = {}
    for s in zero1.shards:
        for p, start in s.members:
            lo, hi = max(start, s.lo), min(start + p.numel(), s.hi)
            if lo < hi:
                out[f"{names[id(p)]}@{lo - start}:{hi - start}"] = s.flat[lo:hi]
    return out


def _expected(want: dict, key: str) -> torch.Tensor:
    name, _, span = key.partition("@")
    if not span:
        return want[name]
    lo, hi = map(int, span.split(":"))
    return want[name].reshape(-1)[lo:hi]


def wrappers_worker(rank, world, kind, backend):
    """Each mode trains STEPS steps on this rank's half of each batch; the parameters after every
    step, compiled against eager and eager against one process on the whole batch."""
    from torch._dynamo.utils import counters

    from distributed_training.strategies import zero1_ddp

    if kind == "zero1":
        assert hasattr(zero1_ddp, "all_gather_flat")  # patched where Zero1DDP looks it up
        zero1_ddp.all_gather_flat = _HeldGather  # the forward must wait, or it sees stale parameters
    torch._dynamo.reset()
    batches = _batches(world)
    reference = _gpt()
    ref_opt = _sgd(reference.parameters())
    expected = []
    for idx in batches:
        reference(idx[:, :-1], idx[:, 1:]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append({k: v.detach().clone() for k, v in reference.state_dict().items()})
    runs, late_compiles = {}, {}
    for mode in MODES:
        call, opt, named = _wrap(kind, _gpt(), mode, backend)
        runs[mode] = []
        for step, idx in enumerate(batches):
            if step == 1:
                compiled_before = counters["stats"]["unique_graphs"]
            mine = idx[rank * PER_RANK:(rank + 1) * PER_RANK]
            call(mine[:, :-1], mine[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            runs[mode].append(named())
        # After the first step nothing new is compiled: a guard on the wrapper's state, which changes from
        # step to step (how many all-gathers are in flight, whether buckets await their rebuild), would
        # recompile, and past torch._dynamo's recompile limit run that code eagerly.
        late_compiles[mode] = counters["stats"]["unique_graphs"] - compiled_before
    worst = {"eager vs one process": 0.0}
    for step, want in enumerate(expected):
        got = runs["eager"][step]
        # Every parameter (ZeRO-1: this rank's parts of some of them; the ranks together hold all).
        assert {k.partition("@")[0] for k in got} <= set(want) and len(got) > 4, (sorted(got), sorted(want))
        worst["eager vs one process"] = max(worst["eager vs one process"],
                                            max((got[k] - _expected(want, k)).abs().max().item() for k in got))
        for mode in MODES[1:]:
            other = runs[mode][step]
            assert set(other) == set(got), (mode, sorted(other))
            worst[mode] = max(worst.get(mode, 0.0), max((other[k] - got[k]).abs().max().item() for k in got))
    initial = _gpt().state_dict()
    moved = max((v - _expected(initial, k)).abs().max().item() for k, v in runs["eager"][-1].items())
    return worst, moved, late_compiles


@pytest.mark.parametrize("kind", ["ddp", "zero1", "fsdp"])
@waits_for_the_job
def test_every_compile_order_trains_as_eager_and_as_one_process(kind, compiled_job):
    for worst, moved, late_compiles in compiled_job(("wrappers", kind, "aot_eager")):
        assert moved > 1e-3, moved  # training moved the parameters: the comparisons below can fail
        assert not any(late_compiles.values()), late_compiles
        assert worst["eager vs one process"] <= TOL, worst
        for mode in MODES[1:]:
            assert worst[mode] <= TIGHT, (kind, worst)


# ------------------------------------------------------------------ the trainer
TRAINER_MODES = ("eager", "compile=", "compiled model", "compiled blocks")


def trainer_worker(rank, world, strategy, backend):
    """The trainer with each strategy: its `compile` option (the wrapper compiled in place), a model
    compiled by the user (whole, or block by block with torch.compile), each against the eager trainer
    after every step, and the eager trainer against one process on the whole batch."""
    from distributed_training import DistributedTrainer

    torch._dynamo.reset()
    batches = _batches(world)
    reference = _gpt()
    ref_opt = _sgd(reference.parameters())
    runs = {}
    for mode in TRAINER_MODES:
        model = _gpt()
        if mode == "compiled model":
            model = torch.compile(model, backend=backend)
        elif mode == "compiled blocks":
            for i, block in enumerate(model.blocks):
                model.blocks[i] = torch.compile(block, backend=backend)
        trainer = DistributedTrainer(model, _sgd, strategy=strategy, progress=False,
                                     compile={"backend": backend} if mode == "compile=" else False)
        runs[mode] = []
        for idx in batches:
            mine = idx[rank * PER_RANK:(rank + 1) * PER_RANK]
            trainer.train_step((mine[:, :-1], mine[:, 1:]))  # the model returns its loss
            runs[mode].append({_plain_name(k): v.clone() for k, v in trainer.strategy.model_state_dict(trainer.model)
                               .items()} if strategy == "zero3" else
                              {_plain_name(k): v.detach().clone() for k, v in trainer.module.state_dict().items()})
        if mode == "compile=":
            # Compiled in place: the plain model's names (a zero3 full state dict is rank 0's).
            keys = list(trainer.strategy.model_state_dict(trainer.model)) or None
        trainer.close()
    worst = {"eager vs one process": 0.0}
    for step, idx in enumerate(batches):
        reference(idx[:, :-1], idx[:, 1:]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want = reference.state_dict()
        if not runs["eager"][step]:  # zero3's full state dict: rank 0's
            continue
        worst["eager vs one process"] = max(worst["eager vs one process"],
                                            max((runs["eager"][step][k] - want[k]).abs().max().item() for k in want))
        for mode in TRAINER_MODES[1:]:
            got = runs[mode][step]
            assert set(got) == set(want), (mode, sorted(got))
            worst[mode] = max(worst.get(mode, 0.0), max((got[k] - runs["eager"][step][k]).abs().max().item()
                                                        for k in want))
    return worst, keys in (None, list(reference.state_dict()))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3"])
@waits_for_the_job
def test_trainer_compiles_under_every_strategy(strategy, compiled_job):
    for worst, plain_keys in compiled_job(("trainer", strategy, "aot_eager")):
        assert plain_keys
        assert worst["eager vs one process"] <= TOL, worst
        for mode in TRAINER_MODES[1:]:
            assert worst.get(mode, 0.0) <= TIGHT, (strategy, worst)


# ------------------------------------------------------------------ the default backend (inductor: C++ on CPU)
def inductor_worker(rank, world, kind):
    torch._dynamo.reset()
    batches = _batches(world)
    params = {}
    for mode in ("eager", "compile(wrapper)"):
        call, opt, named = _wrap(kind, _gpt(), mode, "inductor")
        params[mode] = []
        for idx in batches:
            mine = idx[rank * PER_RANK:(rank + 1) * PER_RANK]
            call(mine[:, :-1], mine[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
            params[mode].append(named())
    # Inductor fuses kernels, so rounding differs from eager's: equal to float32 accuracy, not bitwise.
    return max((b[k] - a[k]).abs().max().item() for a, b in zip(*params.values()) for k in a)


def _cxx_works() -> bool:
    import shutil
    import subprocess
    import tempfile

    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.cpp")
        with open(src, "w") as f:
            f.write("int main() { return 0; }\n")
        return subprocess.run([cxx, src, "-o", os.path.join(d, "t")], capture_output=True).returncode == 0


CXX = _cxx_works()


@pytest.mark.slow
@pytest.mark.skipif(not CXX, reason="inductor on CPU needs a working C++ compiler")
@waits_for_the_job
def test_inductor_compile_of_fsdp_matches_eager(compiled_job):
    # FSDP: compiled code reads views of storage that is freed after each unit and gathered again.
    for worst in compiled_job(("inductor", "fsdp")):
        assert worst <= TOL, worst


# ------------------------------------------------------------------ the compiled tests' one job
# Each compiled test was a job of its own (nine in all), and each paid a fresh process's first compile
# (torch._dynamo's and aot_autograd's first use: as long as compiling the GPT itself on 2 loaded cores)
# once more. One job runs the parts of every test selected in this module, one after another, each
# from torch._dynamo.reset() (what a fresh process's cache holds: nothing) and with the zero1 gather
# restored after it; each test checks its own part's results as before. A rank that raises fails the
# job, and every test of the module with it (a rank stuck in a collective can't go on to the next part).
PARTS = {"order": compile_worker, "wrappers": wrappers_worker, "trainer": trainer_worker, "inductor": inductor_worker}


def _parts_of(item) -> list[tuple]:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return {"test_torch_compile_in_either_order_matches_eager": [("order", "compile(ddp)"), ("order", "ddp(compile)")],
            "test_every_compile_order_trains_as_eager_and_as_one_process":
                [("wrappers", params.get("kind"), "aot_eager")],
            "test_trainer_compiles_under_every_strategy": [("trainer", params.get("strategy"), "aot_eager")],
            "test_inductor_compile_of_fsdp_matches_eager": [("inductor", "fsdp")] if CXX else [],
            }.get(getattr(item, "originalname", item.name), [])


def compiled_job_worker(rank, world, parts):
    from distributed_training.strategies import zero1_ddp

    gather = zero1_ddp.all_gather_flat
    results = []
    for name, *args in parts:
        torch._dynamo.reset()
        try:
            results.append(PARTS[name](rank, world, *args))
        finally:
            zero1_ddp.all_gather_flat = gather  # the wrappers' zero1 part holds its gathers back
    return results


@pytest.fixture(scope="module")
def compiled_job(request):
    """``compiled_job(part)``: every rank's result of `part` (``(name, *args)`` of `PARTS`), from the one
    job that ran the parts of the module's selected tests."""
    parts = list(dict.fromkeys(p for item in request.session.items if item.module is request.module
                               for p in _parts_of(item)))

    def launch():
        per_rank = run_distributed(compiled_job_worker, 2, args=(parts,), timeout=JOB_TIMEOUT)
        return {p: [r[i] for r in per_rank] for i, p in enumerate(parts)}

    return run_once(launch)

"""Tensor parallelism through the trainer: `DistributedTrainer(tensor_parallel_size=T, ...)` against one
process on the whole batch, parameters compared after every step (1e-5, fp32), at TP=2, TP=4 and
TP=2 x DP=2 with DDP and ZeRO-3 inside, with and without sequence parallelism, clipping by the norm
over the tensor shards; checkpoints saved at TP=2 x DP=2 load at TP=1 and TP=4; errors name the field.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.models import GPT, GPTConfig
from distributed_training.testing import run_distributed

from _once import once_per_key, run_once
from _pipeline import train_against_reference

TOL = 1e-5
STEPS = 3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 32), nn.Tanh(),
                         nn.Linear(32, 4))


MLP_PLAN = {"0": "colwise", "2": "rowwise", "4": "colwise", "6": "rowwise"}


def _batch(kind: str, step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "mlp":
        return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)
    length = (8, 4, 12)[step % 3]  # the sequence length changes between steps; each splits at T = 2 and 4
    tokens = torch.randint(0, 64, (rows, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)
    # Adam divides each gradient by its own magnitude, so on elements whose gradient is tiny (the key
    # bias's is zero but for rounding: softmax ignores a shift of the keys) it turns the rounding of a
    # summation order that tensor parallelism changes (partial products reduced across ranks) into
    # steps of up to lr * 1e-3: lr 1e-3 and eps 1e-6 keep that under the tolerance; each step still
    # moves the parameters by about 1e-3. SGD with momentum (no normalisation) is the sharper check.
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, eps=1e-6)


def parity_worker(rank, world, kind, tp, strategy, sequence_parallel, clip, optimizer, pipeline=None, context=None,
                  compile=False):
    base = _gpt() if kind == "gpt" else _mlp()
    reference = copy.deepcopy(base)
    factory = _optimizer(optimizer)
    ref_opt = factory(reference.parameters())
    trainer = DistributedTrainer(copy.deepcopy(base), factory, strategy=strategy, gradient_clip_val=clip,
                                 tensor_parallel_size=tp, sequence_parallel=sequence_parallel,
                                 tensor_parallel_plan=MLP_PLAN if kind == "mlp" else None, progress=False,
                                 **({} if pipeline is None else {"pipeline_parallel_size": 2,
                                                                 "pipeline_schedule": pipeline}),
                                 **({} if context is None else {"context": context}),
                                 **({"compile": {"backend": "aot_eager"}} if compile else {}))
    record = _count_norm_collectives(trainer.strategy) if clip is not None and tp > 1 else None
    batch = _batch
    if compile and not sequence_parallel:  # one compile (about 20 s on 2 loaded cores), not one per length:
        batch = lambda kind, step, rows: _batch(kind, 0, rows)  # noqa: E731 (the sequence-parallel run varies it)
    elif compile:
        batch = _counting_graphs(batch)
    results = train_against_reference(trainer, reference, ref_opt, batch, kind, clip, rank, 4, STEPS)
    trainer.close()
    # The clipping norm (checked against one process's by the callers): one pass of the inner strategy
    # and one all-reduce of its own per step, whatever the inner strategy reduces over its groups.
    assert record is None or record == [(1, 1)] * STEPS, f"(inner passes, own all-reduces) per step: {record}"
    return results


def _count_norm_collectives(strategy) -> list[tuple[int, int]]:
    """Wrap the tensor-parallel `strategy`'s `gradient_norm_squares`: each call appends (how many times it
    called the inner strategy's, how many all-reduces it ran outside those) to the returned list."""
    import torch.distributed as dist

    record, state = [], {"inner": 0, "reduces": 0, "depth": 0}
    inner_fn, outer_fn, all_reduce = strategy.inner.gradient_norm_squares, strategy.gradient_norm_squares, dist.all_reduce

    def inner(*args, **kwargs):
        state["inner"] += 1
        state["depth"] += 1
        try:
            return inner_fn(*args, **kwargs)
        finally:
            state["depth"] -= 1

    def counted_all_reduce(*args, **kwargs):
        state["reduces"] += state["depth"] == 0
        return all_reduce(*args, **kwargs)

    def outer(*args, **kwargs):
        state.update(inner=0, reduces=0)
        dist.all_reduce = counted_all_reduce
        try:
            return outer_fn(*args, **kwargs)
        finally:
            dist.all_reduce = all_reduce
            record.append((state["inner"], state["reduces"]))

    strategy.inner.gradient_norm_squares, strategy.gradient_norm_squares = inner, outer
    return record


# The parity tests' runs at each world size (the selected ones of the two tests below: 2 at world 2,
# 9 at world 4) run one after another in one job (`parity_job`): a job each was 11 launches of 2-4
# processes with their process groups. The worker and every assertion are as they were. A rank that
# raises fails its world's job and every test of that world (the later ones re-raise the first error,
# no rerun); a hang fails at the runs' former limits (180 s each) added up, at most 600 s (the nine runs
# at world 4 take ~10 s on 2 loaded cores), within pytest's own limit for these tests, raised past it.
PARITY_LIMIT, JOB_LIMIT = 180, 600
waits_for_its_world = pytest.mark.timeout(JOB_LIMIT + 60)


def _parity_args(item) -> tuple | None:
    """(world, parity_worker's arguments) of one of the two parity tests below."""
    p = getattr(getattr(item, "callspec", None), "params", {})
    name = getattr(item, "originalname", None)
    if name == "test_tensor_parallel_trainer_matches_one_process":
        return p["world"], (p["kind"], p["tp"], p["strategy"], p["sequence_parallel"], p["clip"], p["optimizer"])
    if name == "test_tensor_times_pipeline_matches_one_process":
        return 4, ("gpt", 2, p["strategy"], p["sequence_parallel"], 0.5, "sgd", p["schedule"])
    return None


def parity_job_worker(rank, world, runs):
    return [parity_worker(rank, world, *args) for args in runs]


@pytest.fixture(scope="module")
def parity_job(request):
    """``parity_job(world, *args)``: every rank's result of ``parity_worker(rank, world, *args)``, from
    the one job that ran the selected parity runs at that world size."""
    runs: dict[int, list] = {}
    for item in request.session.items:
        found = _parity_args(item) if item.module is request.module else None
        if found is not None and found[1] not in runs.setdefault(found[0], []):
            runs[found[0]].append(found[1])
    def launch(world):
        per_rank = run_distributed(parity_job_worker, world, args=(runs[world],),
                                   timeout=min(JOB_LIMIT, PARITY_LIMIT * len(runs[world])))
        return {run: [r[i] for r in per_rank] for i, run in enumerate(runs[world])}

    job = once_per_key(launch)
    return lambda world, *args: job(world)[args]


@pytest.mark.parametrize("kind, world, tp, strategy, sequence_parallel, clip, optimizer", [
    ("gpt", 2, 2, "ddp", False, 0.5, "sgd"),
    ("gpt", 2, 2, "ddp", True, 0.5, "adamw"),
    ("gpt", 4, 4, "ddp", True, 0.5, "sgd"),
    ("gpt", 4, 2, "ddp", True, 0.5, "sgd"),
    ("gpt", 4, 2, "zero3", False, 0.5, "sgd"),
    ("gpt", 4, 2, "zero3", True, None, "adamw"),
    ("gpt", 4, 2, "zero1", False, 0.5, "adamw"),
    ("mlp", 4, 2, "ddp", False, 0.05, "sgd"),
])
@waits_for_its_world
def test_tensor_parallel_trainer_matches_one_process(kind, world, tp, strategy, sequence_parallel, clip, optimizer,
                                                      parity_job):
    results = parity_job(world, kind, tp, strategy, sequence_parallel, clip, optimizer)
    worst = results[0][0]
    assert len(worst) == STEPS and max(worst) <= TOL, f"parameters differ from one process by {worst}"
    for rank, (_, losses, norms) in enumerate(results):
        for got, want in losses:  # every tensor rank reports its replica's loss
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, losses)
        for got, want in norms:  # the norm over every tensor shard, replicated parameters counted once
            assert abs(got - want) <= 1e-5 * max(1.0, want), (rank, norms)
        if clip is not None:
            assert any(want > clip for _, want in norms), "the clip threshold must actually clip"


GRAPHS_BY_STEP: list[int] = []  # (a compiled run's graphs compiled before each step, `_counting_graphs`)


def _counting_graphs(batch):
    """`batch`, noting in GRAPHS_BY_STEP how many graphs torch._dynamo had compiled before each step."""
    from torch._dynamo.utils import counters

    GRAPHS_BY_STEP.clear()

    def counted(kind, step, rows):
        GRAPHS_BY_STEP.append(counters["stats"]["unique_graphs"])
        return batch(kind, step, rows)

    return counted


def compiled_parity_worker(rank, world, variants):
    """The compiled parity run of each `sequence_parallel` in `variants`, one after the other in this one
    job, each from torch._dynamo.reset() (a fresh process's empty cache)."""
    results = []
    for sequence_parallel in variants:
        torch._dynamo.reset()
        result = parity_worker(rank, world, "gpt", 2, "ddp", sequence_parallel, 0.5, "sgd", None, None, True)
        from torch._dynamo.utils import counters

        graphs = GRAPHS_BY_STEP + [counters["stats"]["unique_graphs"]]  # (and after the last step)
        results.append((result, graphs if sequence_parallel else None))
    return results


@pytest.fixture(scope="module")
def compiled_parity(request):
    """``compiled_parity(sequence_parallel)``: every rank's result of the compiled parity run. The variants
    of the selected tests run in one job: a job each paid a fresh process's first compile (torch._dynamo's
    and aot_autograd's first use, seconds on 2 loaded cores) twice. A rank that raises fails the job and
    both tests; a hang, its limit (each variant's 240 s, as before)."""
    name = "test_compiled_tensor_parallel_model_matches_one_process"
    variants = [item.callspec.params["sequence_parallel"] for item in request.session.items
                if item.module is request.module and getattr(item, "originalname", None) == name]

    def launch():
        per_rank = run_distributed(compiled_parity_worker, 2, args=(variants,), timeout=240 * len(variants))
        return {v: [r[i] for r in per_rank] for i, v in enumerate(variants)}

    return run_once(launch)


@pytest.mark.timeout(540)  # the first waits for both variants' job
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_compiled_tensor_parallel_model_matches_one_process(sequence_parallel, compiled_parity):
    """DistributedTrainer(compile=...) over a tensor-parallel GPT: the autograd collectives traced
    into the graph (aot_eager: the eager kernels), parameters equal to one process after every step. With
    sequence parallelism the sequence length changes every step (recompiled, then symbolic: the split of
    a symbolic length); without it, one length and one compile."""
    results = compiled_parity(sequence_parallel)
    worst = results[0][0][0]
    assert len(worst) == STEPS and max(worst) <= TOL, f"parameters differ from one process by {worst}"
    if sequence_parallel:
        # The second length recompiles with a symbolic one; the third runs that graph. The sequence-parallel
        # bookkeeping (the recent lengths) was guarded on, and each new length recompiled the model again.
        for _, graphs in results:
            compiled = [after - before for before, after in zip(graphs, graphs[1:])]  # in each step
            assert len(compiled) == STEPS == 3 and compiled[0] and compiled[1], compiled
            assert compiled[2] == 0, f"a third sequence length compiled again: graphs per step {compiled}"


@pytest.mark.parametrize("schedule, strategy, sequence_parallel", [
    ("1f1b", "ddp", False),
    ("gpipe", "ddp", True),
    ("1f1b", "zero3", True),
])
@waits_for_its_world
def test_tensor_times_pipeline_matches_one_process(schedule, strategy, sequence_parallel, parity_job):
    """TP = 2 x PP = 2 (3D with the data dimension of 1): the tied embedding split by vocabulary on the
    first and last stages, its copies summed over the pipeline."""
    results = parity_job(4, "gpt", 2, strategy, sequence_parallel, 0.5, "sgd", schedule)
    worst = results[0][0]
    assert len(worst) == STEPS and max(worst) <= TOL, f"parameters differ from one process by {worst}"
    for rank, (_, losses, norms) in enumerate(results):
        for got, want in losses:
            assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (rank, losses)
        for got, want in norms:
            assert abs(got - want) <= 1e-5 * max(1.0, want), (rank, norms)


class _FlatLlama(nn.Module):
    """The Llama-style stack with its logits flattened to (B * T, vocab): `F.cross_entropy` then reads
    them as one process's criterion would, and the trainer swaps in the vocabulary-parallel loss."""

    def __init__(self) -> None:
        super().__init__()
        from _tp_models import Llama

        self.model = Llama()

    def forward(self, idx):
        logits = self.model(idx)
        return logits.reshape(-1, logits.size(-1))


def llama_worker(rank, world, tp, strategy, sequence_parallel):
    from _tp_models import llama_plan

    torch.manual_seed(0)
    base = _FlatLlama()
    reference = copy.deepcopy(base)
    factory = _optimizer("sgd")
    ref_opt = factory(reference.parameters())
    plan = {f"model.{pattern}": style for pattern, style in llama_plan().items()}
    trainer = DistributedTrainer(copy.deepcopy(base), factory, strategy=strategy, gradient_clip_val=0.5,
                                 tensor_parallel_size=tp, tensor_parallel_plan=plan,
                                 sequence_parallel=sequence_parallel, progress=False)
    dp, d = trainer.dp_world_size, trainer.dp_rank
    worst, norms = [], []
    for step in range(STEPS):
        x, y = _batch("gpt", step, 4 * dp)
        rows = slice(d * 4, (d + 1) * 4)
        metrics = trainer.train_step((x[rows], y[rows].reshape(-1)), F.cross_entropy)
        F.cross_entropy(reference(x), y.reshape(-1)).backward()
        norms.append((float(metrics["grad_norm"]), float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))))
        ref_opt.step()
        ref_opt.zero_grad()
        state = trainer.full_state_dict()
        if rank == 0:
            want = reference.state_dict()
            worst.append(max((state[k] - want[k]).abs().max().item() for k in want))
    trainer.close()
    return worst, norms


@pytest.mark.parametrize("world, tp, strategy, sequence_parallel", [(2, 2, "ddp", False), (4, 2, "zero3", True)])
def test_llama_style_stack_with_a_user_plan_matches_one_process(world, tp, strategy, sequence_parallel):
    """RMSNorm, grouped key/value heads, rotary, SwiGLU, an untied head split by vocabulary: through the
    trainer with `F.cross_entropy` (swapped for the vocabulary-parallel loss), clipped."""
    results = run_distributed(llama_worker, world, args=(tp, strategy, sequence_parallel), timeout=180)
    worst = results[0][0]
    assert len(worst) == STEPS and max(worst) <= TOL, f"parameters differ from one process by {worst}"
    for _, norms in results:
        assert all(abs(got - want) <= 1e-5 * max(1.0, want) for got, want in norms), norms
        assert any(want > 0.5 for _, want in norms)


# ------------------------------------------------------------------ setup
def share_weights_worker(rank, world):
    """Setup's coalesced broadcast of tensor rank 0's weights (`_share_weights`) against its naive twin,
    one `dist.broadcast` per tensor, on a GPT with buffers of other dtypes; each rank built its own."""
    import torch.distributed as dist

    from distributed_training.tensor.strategy import _share_weights

    torch.manual_seed(rank)  # every rank starts from other weights
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32))
    model.register_buffer("steps", torch.randint(0, 1000, (3,)))  # int64
    model.register_buffer("scale", torch.randn(5, dtype=torch.float64))
    naive = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for tensor in [*naive.parameters(), *naive.buffers()]:
            dist.broadcast(tensor, src=0)
    calls = []
    broadcast = dist.broadcast

    def counted(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return broadcast(tensor, *args, **kwargs)

    dist.broadcast = counted
    try:
        _share_weights(model, 0, None, torch.device("cpu"))
    finally:
        dist.broadcast = broadcast
    got, want = model.state_dict(), naive.state_dict()
    equal = all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    changed = any(not torch.equal(got[k], before[k]) for k in want)
    return equal, changed, len(calls), len([*model.parameters(), *model.buffers()])


def test_setup_shares_rank_zero_weights_in_a_few_messages():
    for rank, (equal, changed, calls, tensors) in enumerate(run_distributed(share_weights_worker, 2, timeout=60)):
        assert equal, f"rank {rank}: the coalesced broadcast differs from the one per tensor"
        assert changed == (rank != 0), (rank, changed)
        assert calls == 3 and tensors > 20, (calls, tensors)  # one per dtype (fp32, int64, fp64), not per tensor


# ------------------------------------------------------------------ checkpoints
def save_worker(rank, world, directory):
    trainer = DistributedTrainer(_gpt(), _optimizer("adamw"), strategy="zero3", tensor_parallel_size=2,
                                 progress=False)
    for step in range(2):
        x, y = _batch("gpt", step, 4 * trainer.dp_world_size)
        rows = slice(trainer.dp_rank * 4, (trainer.dp_rank + 1) * 4)
        trainer.train_step((x[rows], y[rows]))
    trainer.save_checkpoint(directory)
    state = trainer.full_state_dict()
    trainer.close()
    return state


def load_worker(rank, world, directory, tp, strategy):
    trainer = DistributedTrainer(_gpt(), _optimizer("adamw"), strategy=strategy, tensor_parallel_size=tp,
                                 progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG states are not restored at another world size
        trainer.load_checkpoint(directory)
    state = trainer.full_state_dict()
    step = trainer.step
    x, y = _batch("gpt", 7, 4 * trainer.dp_world_size)
    rows = slice(trainer.dp_rank * 4, (trainer.dp_rank + 1) * 4)
    loss = float(trainer.train_step((x[rows], y[rows]))["loss"])
    after = trainer.full_state_dict()
    trainer.close()
    return step, state, loss, after


def test_checkpoint_saved_at_tp2_dp2_loads_at_tp1_and_tp4(tmp_path):
    directory = os.fspath(tmp_path / "ckpt")
    saved = run_distributed(save_worker, 4, args=(directory,), timeout=180)[0]
    results = {}
    for world, tp, strategy in ((1, 1, "ddp"), (4, 4, "ddp"), (2, 2, "zero3")):
        out = run_distributed(load_worker, world, args=(directory, tp, strategy), timeout=180)[0]
        step, state, loss, after = out
        assert step == 2
        assert list(state) == list(saved)
        for key in saved:
            assert torch.equal(state[key], saved[key]), (world, tp, key)
        results[(world, tp)] = (loss, after)
    # The optimizer state came back too: one more step from the checkpoint agrees at every layout.
    (loss1, after1) = results[(1, 1)]
    for (world, tp), (loss, after) in results.items():
        assert abs(loss - loss1) <= 1e-5, (world, tp, loss, loss1)
        for key in after1:
            assert (after[key] - after1[key]).abs().max().item() <= 1e-5, (world, tp, key)


# ------------------------------------------------------------------ errors
def error_worker(rank, world, case):
    kwargs = {"tensor_parallel_size": 2}
    model, criterion, batch = _gpt(), None, _batch("gpt", 0, 2)
    if case == "world":
        kwargs["tensor_parallel_size"] = 3
    elif case == "no_plan":
        model = _mlp()
    elif case == "criterion":
        criterion = lambda logits, y: F.mse_loss(logits.float().mean(-1), y.float())  # noqa: E731
    elif case == "heads":
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=3, n_embd=48))
    try:
        trainer = DistributedTrainer(model, _optimizer("sgd"), progress=False, **kwargs)
        trainer.train_step(batch, criterion)
    except (ValueError, TypeError, NotImplementedError) as err:
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize("case, words", [
    ("world", ["tensor_parallel_size=3", "world size 2"]),
    ("no_plan", ["tensor_parallel_plan", "Sequential"]),
    ("criterion", ["tensor_parallel_plan", "vocab"]),
    ("heads", ["3", "2"]),
])
def test_errors_name_the_field(case, words):
    results = run_distributed(error_worker, 2, args=(case,), timeout=120)
    for result in results:
        assert result is not None, f"{case}: no error"
        for word in words:
            assert word in result[1], (case, result)


def test_options_are_checked_before_any_rendezvous():
    with pytest.raises(ValueError, match="sequence_parallel"):
        DistributedTrainer(_gpt(), _optimizer("sgd"), sequence_parallel=True)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        DistributedTrainer(_gpt(), _optimizer("sgd"), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_plan"):
        DistributedTrainer(_mlp(), _optimizer("sgd"), tensor_parallel_plan={"0": "sideways"}, tensor_parallel_size=2)


# ------------------------------------------------------------------ evaluate
def evaluate_worker(rank, world, sequence_parallel):
    """evaluate() at TP = world: the model's own loss and a cross-entropy criterion (both the
    vocabulary-parallel loss) against one process (metrics: tests/test_tensor_user.py)."""
    reference = _gpt()
    trainer = DistributedTrainer(_gpt(), _optimizer("sgd"), tensor_parallel_size=world,
                                 sequence_parallel=sequence_parallel, progress=False)
    x, y = _batch("gpt", 3, 6)
    data = list(zip(x, y))
    with torch.no_grad():
        want = reference(x, y).item()
    own = trainer.evaluate(data, batch_size=2)["loss"]
    criterion = trainer.evaluate(data, torch.nn.CrossEntropyLoss(), batch_size=2)["loss"]
    trainer.close()
    return want, own, criterion


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_evaluate_uses_the_vocabulary_parallel_loss(sequence_parallel):
    for want, own, criterion in run_distributed(evaluate_worker, 2, args=(sequence_parallel,), timeout=120):
        assert abs(own - want) <= 1e-5 and abs(criterion - want) <= 1e-5, (own, criterion, want)


def meta_3d_worker(rank, world):
    """A GPT built on the meta device at TP = 2 x PP = 2: materialised whole (the trainer's seed), then
    split by the plan and cut into stages; its state equals the same GPT materialised in one process."""
    from distributed_training.pipeline.meta_init import materialize

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
    with torch.device("meta"):
        model = GPT(cfg)
    trainer = DistributedTrainer(model, _optimizer("sgd"), tensor_parallel_size=2, pipeline_parallel_size=2,
                                 seed=5, progress=False)
    state = trainer.full_state_dict()
    x, y = _batch("gpt", 0, 4)
    loss = float(trainer.train_step((x, y))["loss"])
    trainer.close()
    with torch.device("meta"):
        reference = GPT(cfg)
    materialize(reference, "cpu", seed=5)
    with torch.no_grad():
        want = reference(x, y).item()
    if rank != 0:
        return None
    worst = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return worst, loss, want


def test_a_meta_gpt_in_3d_starts_as_one_process_would():
    worst, loss, want = run_distributed(meta_3d_worker, 4, timeout=180)[0]
    assert worst == 0.0, worst
    assert abs(loss - want) <= 1e-5, (loss, want)

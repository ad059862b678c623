"""``pipeline_balance="time"``: the stages cut by each layer's measured forward + backward
(`pipeline.balance`). Layers that sleep make the costs known: the slow layer goes alone, and ranks
whose measurements differ still agree on one cut (the mean over the ranks). That the cut does not
change what trains is in tests/test_pipeline_meta.py (a meta-built GPT balanced by time, against one
process)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from distributed_training import DistributedTrainer
from distributed_training.models import GPT, GPTConfig
from distributed_training.pipeline import chain, partition
from distributed_training.pipeline.balance import default_sample, layer_costs, measure_layer_times, schedule_cut
from distributed_training.pipeline.options import PipelineOptions
from distributed_training.testing import run_distributed


class Sleepy(nn.Linear):
    """A Linear whose forward first sleeps: `seconds`, or ``seconds[rank]`` (a rank-dependent cost)."""

    def __init__(self, seconds, width: int = 8) -> None:
        super().__init__(width, width)
        self.seconds = seconds

    def forward(self, x):
        s = self.seconds
        time.sleep(s[dist.get_rank()] if isinstance(s, (list, tuple)) else s)
        return super().forward(x)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def balance_worker(rank, world):
    found = {}
    # One slow layer at the end: by parameters the cut is [0 1 | 2 3]; by time the slow layer alone.
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), Sleepy(0.03))
    trainer = DistributedTrainer(model, _sgd, pipeline_parallel_size=2, pipeline_balance="time",
                                 pipeline_sample_input=torch.randn(2, 8))
    found["slow"] = (list(trainer.strategy.engine.chunks[0].names), trainer.strategy.layer_costs,
                     trainer.strategy.bounds)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    found["slow_loss"] = trainer.train_step((x, y), F.mse_loss)["loss"].item()
    trainer.close()
    # Rank-dependent costs: rank 0 alone measures about [40, 10, 10, 2] ms (its own best cut: [0 | 1 2 3]),
    # rank 1 [2, 10, 10, 40] (its own: [0 1 2 | 3]); their mean [21, 10, 10, 21] cuts [0 1 | 2 3] on both
    # (with 8 microbatches the step is about 8 x the larger stage's: even stages are best).
    model = nn.Sequential(Sleepy([0.04, 0.002]), Sleepy(0.01), Sleepy(0.01), Sleepy([0.002, 0.04]))
    trainer = DistributedTrainer(model, _sgd, pipeline_parallel_size=2, pipeline_balance="time",
                                 pipeline_sample_input=torch.randn(2, 8), microbatches=8)
    found["ranks"] = (list(trainer.strategy.engine.chunks[0].names), trainer.strategy.layer_costs,
                      trainer.strategy.bounds)
    trainer.close()
    return found


def test_time_balance_puts_the_slow_layer_alone_and_every_rank_cuts_alike():
    results = run_distributed(balance_worker, 2, timeout=120)
    (names0, costs0, bounds0), (names1, costs1, bounds1) = results[0]["slow"], results[1]["slow"]
    assert costs0 == costs1 and bounds0 == bounds1 == [0, 3, 4], (costs0, bounds0, bounds1)
    assert names0 == ["0", "1", "2"] and names1 == ["3"], (names0, names1)
    assert costs0[3] >= 0.03 > 10 * max(costs0[:3]), costs0
    assert partition([8 * 8 + 8] * 4, 2) == [0, 2, 4]  # what parameters would have cut
    assert results[0]["slow_loss"] == results[1]["slow_loss"] and results[0]["slow_loss"] > 0

    (names0, costs0, bounds0), (names1, costs1, bounds1) = results[0]["ranks"], results[1]["ranks"]
    assert costs0 == costs1, (costs0, costs1)  # the same numbers on every rank, to the bit
    assert bounds0 == bounds1 == [0, 2, 4] and names0 == ["0", "1"] and names1 == ["2", "3"], (bounds0, bounds1)
    assert 0.019 <= costs0[0] <= 0.035 and 0.019 <= costs0[3] <= 0.035, costs0  # the mean of 40 and 2 ms
    # neither rank's own times would have given this cut
    for own, its_cut in (([0.04, 0.01, 0.01, 0.002], [0, 1, 4]), ([0.002, 0.01, 0.01, 0.04], [0, 3, 4])):
        assert schedule_cut([t / 3 for t in own], [2 * t / 3 for t in own], "1f1b", 2, 8) == its_cut


def test_measuring_leaves_the_model_and_the_rng_alone():
    """Copies are timed: no gradients, no storage for a meta model, the global RNG as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(4, 8)
    state = torch.random.get_rng_state()
    times = measure_layer_times(chain(model), sample, "cpu", warmup=1, repeats=2)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # BatchNorm's statistics too

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    with torch.device("meta"):
        meta = GPT(cfg)
    assert default_sample(meta).shape == (1, cfg.block_size)
    costs = layer_costs(meta, chain(meta), "time", budget_s=0.0)  # the budget spent: one run each, still timed
    assert len(costs) == cfg.n_layer + 2 and all(c > 0 for c in costs), costs
    assert all(p.is_meta for p in meta.parameters())


def test_time_balance_errors_name_the_field():
    with pytest.raises(ValueError, match="pipeline_sample_input"):
        PipelineOptions(size=2, balance="parameters", sample_input=torch.zeros(2, 8))
    with pytest.raises(TypeError, match="pipeline_sample_input"):
        PipelineOptions(size=2, balance="time", sample_input=[1, 2])
    assert PipelineOptions(size=2, balance="time", sample_input={"x": torch.zeros(2)}).balance == "time"
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with pytest.raises(ValueError, match="pass pipeline_sample_input"):
        layer_costs(model, chain(model), "time")
    # A sample that does not fit the model: the error names the field, the layer and what it got.
    with pytest.raises(RuntimeError, match=r"layer '0' failed on the sample \(pipeline_sample_input.*\(2, 7\)"):
        layer_costs(model, chain(model), "time", sample=torch.zeros(2, 7))


SEEN_DTYPES: list[torch.dtype] = []


class Probe(nn.Linear):
    """Records the dtype its matmul computes in (the copies that are timed share this module's list)."""

    def forward(self, x):
        out = super().forward(x)
        SEEN_DTYPES.append(out.dtype)
        return out


def test_layers_are_timed_under_the_trainers_autocast():
    from distributed_training.pipeline.stage_setup import autocast_for as _autocast

    model = nn.Sequential(Probe(8, 8), Probe(8, 8))
    SEEN_DTYPES.clear()
    measure_layer_times(chain(model), torch.randn(2, 8), "cpu", warmup=0, repeats=1,
                        autocast=_autocast("bf16", torch.device("cpu")))
    assert SEEN_DTYPES == [torch.bfloat16] * 2, SEEN_DTYPES
    SEEN_DTYPES.clear()
    measure_layer_times(chain(model), torch.randn(2, 8), "cpu", warmup=0, repeats=1,
                        autocast=_autocast("fp32", torch.device("cpu")))
    assert SEEN_DTYPES == [torch.float32] * 2, SEEN_DTYPES
    SEEN_DTYPES.clear()  # a loss after the last layer: timed with it, backward from it
    measure_layer_times(chain(model), torch.randn(2, 8), "cpu", warmup=0, repeats=2,
                        loss=lambda out: (SEEN_DTYPES.append("loss"), out.square().mean())[1])
    assert SEEN_DTYPES == [torch.float32] * 3 + ["loss", torch.float32, "loss"], SEEN_DTYPES


class FailsOnRank1(nn.Linear):
    def forward(self, x):
        if dist.get_rank() == 1:
            raise MemoryError("simulated: out of memory while timing")
        return super().forward(x)


def failing_worker(rank, world):
    model = nn.Sequential(nn.Linear(8, 8), FailsOnRank1(8, 8))
    try:
        DistributedTrainer(model, _sgd, pipeline_parallel_size=2, pipeline_balance="time",
                           pipeline_sample_input=torch.randn(2, 8)).close()
    except (RuntimeError, MemoryError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def test_a_rank_failing_to_time_makes_every_rank_raise():
    """Not a hang: the failure travels with the times, and the other ranks raise too."""
    found = run_distributed(failing_worker, 2, timeout=60)
    assert found[1] == "MemoryError: simulated: out of memory while timing", found
    assert found[0] is not None and "failed on another rank" in found[0], found


def _makespan(forward, backward, cut, schedule, P, M, V):
    from distributed_training.pipeline.schedules import build_schedule, simulate, stage_of

    S = P * V
    fw = [sum(forward[cut[s]:cut[s + 1]]) for s in range(S)]
    bw = [sum(backward[cut[s]:cut[s + 1]]) for s in range(S)]

    def cost(rank, action):
        s = stage_of(rank, action.chunk, P)
        return fw[s] if action.kind == "F" else bw[s] if action.kind == "B" else bw[s] / 2

    return simulate(build_schedule(schedule, P, M, V), P, V, cost, microbatches=M).makespan


def _gpt_1p3b_costs(halves: bool):
    from distributed_training.models.gpt import GPT_PRESETS
    from distributed_training.pipeline.gpt_stages import GPTStages

    return GPTStages(GPT_PRESETS["gpt-1.3b"], halves=halves).step_costs(1024, microbatch_tokens=2048)


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("zbh1", 1)])
def test_schedule_cut_finds_the_exhaustive_best_on_gpt_1p3b_whole_blocks(schedule, chunks):
    import itertools

    forward, backward = _gpt_1p3b_costs(halves=False)
    P, M, n = 4, 8, len(forward)
    cut = schedule_cut(forward, backward, schedule, P, M, chunks)
    best = min(_makespan(forward, backward, [0, *c, n], schedule, P, M, chunks)
               for c in itertools.combinations(range(1, n), P * chunks - 1))
    assert _makespan(forward, backward, cut, schedule, P, M, chunks) == pytest.approx(best, rel=1e-9)


def test_schedule_cut_beats_the_smallest_largest_stage_where_the_schedule_needs_it():
    """Interleaved, 2 chunks a rank: the last chunk's forward is on every microbatch's turn to its
    backward, so the cut that only evens the stages' sums (`partition`) is far from the best."""
    forward, backward = _gpt_1p3b_costs(halves=True)
    P, M, V = 4, 8, 2
    even = partition([f + b for f, b in zip(forward, backward)], P * V)
    cut = schedule_cut(forward, backward, "interleaved_1f1b", P, M, V)
    assert cut != even
    assert _makespan(forward, backward, cut, "interleaved_1f1b", P, M, V) < 0.97 * _makespan(
        forward, backward, even, "interleaved_1f1b", P, M, V)
    # never worse than where it starts, on any costs; the same answer every time (every rank cuts alike)
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        f = (torch.rand(12, generator=g) + 0.1).tolist()
        b = [x * (1.5 + torch.rand(1, generator=g).item()) for x in f]
        for schedule, chunks in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zbh1", 1)):
            start = partition([x + y for x, y in zip(f, b)], 2 * chunks)
            cut = schedule_cut(f, b, schedule, 2, 4, chunks)
            assert cut == schedule_cut(f, b, schedule, 2, 4, chunks)
            assert cut[0] == 0 and cut[-1] == 12 and all(x < y for x, y in zip(cut, cut[1:]))
            assert (_makespan(f, b, cut, schedule, 2, 4, chunks)
                    <= _makespan(f, b, start, schedule, 2, 4, chunks) * (1 + 1e-12)), (trial, schedule)
    with pytest.raises(ValueError, match="one each per layer"):
        schedule_cut([1.0, 2.0], [1.0], "1f1b", 2, 2)


def test_compute_balance_takes_the_sequence_length_and_microbatch_from_a_sample():
    """`pipeline_sample_input` with `pipeline_balance="compute"`: the GPT compute model at the sample's
    sequence length and tokens a microbatch (the attention core grows with the length, the embedding's
    gradient is per microbatch), not at one sequence of `cfg.block_size`."""
    from distributed_training.pipeline.balance import _gpt_costs, split_step
    from distributed_training.pipeline.gpt_stages import gpt_layer_costs

    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    model = GPT(cfg)
    layers = chain(model)
    sample = torch.zeros(3, 8, dtype=torch.long)
    assert _gpt_costs(model, layers, sample) == gpt_layer_costs(cfg, 8, microbatch_tokens=24)
    assert _gpt_costs(model, layers) == gpt_layer_costs(cfg)
    assert _gpt_costs(model, layers, sample) != _gpt_costs(model, layers)
    assert split_step(model, layers, "compute", [], sample) == _gpt_costs(model, layers, sample)
    costs = layer_costs(model, layers, "compute", sample=sample)
    assert costs == [f + b for f, b in zip(*gpt_layer_costs(cfg, 8, microbatch_tokens=24))]
    for bad in (torch.zeros(3, 8), torch.zeros(24, dtype=torch.long), torch.zeros(0, 8, dtype=torch.long)):
        with pytest.raises(ValueError, match="pipeline_sample_input"):
            _gpt_costs(model, layers, bad)
    assert PipelineOptions(size=2, balance="compute", sample_input=sample).balance == "compute"

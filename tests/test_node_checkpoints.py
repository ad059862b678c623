"""Checkpoints with one directory per node (a Kubernetes pod's own volume): every node writes, verifies
and prunes its own directory, and a resumed job agrees on one step and equals an unbroken run.

Four real processes play two nodes of two processes each: each builds its `DistributedContext` with
``local_rank = rank % 2`` (what torchrun would set on two nodes), and each "node" gets a directory of
its own that the other node's processes never open. The two-agents-on-one-host version of this, through
docker/entrypoint.sh and torchrun, is `tests/test_deploy.py::test_per_node_volumes_resume_after_a_crash`.
"""

from __future__ import annotations

import os
import signal
import warnings

import pytest
import torch

from distributed_training import DistributedContext, DistributedTrainer
from distributed_training.checkpoint import CheckpointManager
from distributed_training.checkpoint_layout import detect_layout
from distributed_training.testing import run_distributed

from _models import sgd_momentum, tiny_gpt, tiny_gpt_data

PER_NODE = 2


def _context(rank: int, world: int) -> DistributedContext:
    return DistributedContext(rank=rank, world_size=world, local_rank=rank % PER_NODE, local_world_size=PER_NODE,
                              device=torch.device("cpu"), backend="gloo")




def node_resume_worker(rank, world, base, strategy, interrupt_at, swap, damage):
    """Train 10 steps (2 epochs); with `interrupt_at`, stop there and resume in a new trainer.

    `swap`: on resume the two nodes trade directories (torchrun ordered them the other way round).
    `damage`: before resuming, node 1's newest checkpoint loses its meta.pt (``"meta"``: the node died
    while saving it) or gets a truncated rank file (``"truncate"``), so every node must fall back to the
    checkpoint before. Returns the full model state after every step, the steps the resumed trainer ran,
    what each node directory holds at the end, and the warnings of the resume.
    """
    nodes = world // PER_NODE
    dirs = [os.path.join(base, f"node{k}") for k in range(nodes)]
    states: dict[int, dict] = {}
    resumed_steps: list[int] = []
    trainer = None

    def record(step, _metrics):
        states[step] = {k: v.clone() for k, v in trainer.strategy.model_state_dict(trainer.model).items()}
        resumed_steps.append(step)

    def make(node):
        torch.manual_seed(0)  # a fresh process starts from the same seed; resuming must undo the rest
        return DistributedTrainer(tiny_gpt(dropout=0.1), sgd_momentum, strategy=strategy, context=_context(rank, world), seed=3,
                                  checkpoint_dir=dirs[node], checkpoint_every=2, keep_last=2,
                                  best_metric="loss")

    node = rank // PER_NODE
    trainer = make(node)
    if interrupt_at:
        trainer.fit(tiny_gpt_data(), epochs=2, batch_size=3, max_steps=interrupt_at, log_every=1, on_step=record)
        trainer.close()
        resumed_steps.clear()
        if damage and rank == PER_NODE:  # node 1's first rank: the writer of its directory
            manager = CheckpointManager(dirs[1])
            newest = manager.path_for(manager.steps()[-1])
            if damage == "meta":
                os.remove(os.path.join(newest, "meta.pt"))
            else:
                victim = os.path.join(newest, f"rank{world - 1}.pt")
                with open(victim, "r+b") as f:
                    f.truncate(100)
        torch.distributed.barrier()
        trainer = make((node + 1) % nodes if swap else node)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(tiny_gpt_data(), epochs=2, batch_size=3, log_every=1, on_step=record)
    step = trainer.step
    trainer.close()
    torch.distributed.barrier()
    listing = {os.path.basename(d): sorted(os.listdir(d)) for d in dirs}
    best = {os.path.basename(d): CheckpointManager(d).best() for d in dirs}
    steps = {os.path.basename(d): {s: sorted(os.listdir(CheckpointManager(d).path_for(s)))
                                   for s in CheckpointManager(d).steps()} for d in dirs}
    return states, resumed_steps, step, listing, steps, [str(w.message) for w in caught], best


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """Reference runs per strategy, never interrupted."""
    cache = {}

    def get(strategy):
        if strategy not in cache:
            base = str(tmp_path_factory.mktemp(f"unbroken-{strategy}"))
            cache[strategy] = run_distributed(node_resume_worker, 4, args=(base, strategy, 0, False, None),
                                              timeout=240)[0]
        return cache[strategy]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("strategy,swap,damage,resumed_from", [
    ("ddp", False, None, 5),  # fit(max_steps=5) stops with a checkpoint at step 5
    ("zero3", True, None, 5),
    ("ddp", True, "truncate", 4),
    ("zero3", False, "meta", 4),
])
def test_per_node_directories_resume_and_prune(tmp_path, unbroken, strategy, swap, damage, resumed_from):
    full_states, _, full_step, *_ = unbroken(strategy)
    results = run_distributed(node_resume_worker, 4, args=(str(tmp_path), strategy, 5, swap, damage), timeout=240)
    states, _, step, listing, steps, _, best = results[0]
    assert full_step == step == 10  # 54 samples / 4 ranks / 3 per batch: 5 steps per epoch
    # Both nodes track the same best checkpoint (by rank 0's loss, not each node's own).
    assert best["node0"] is not None and best["node0"][1] == best["node1"][1], best
    best_dir = os.path.basename(best["node0"][0])
    # Every node's directory got complete checkpoints (its own meta.pt) and was pruned to keep_last=2
    # (and the best one).
    for node in ("node0", "node1"):
        kept = [n for n in listing[node] if n.startswith("step_")]
        assert kept == sorted({"step_000000008", "step_000000010", best_dir}), listing
        for s, files in steps[node].items():
            assert "meta.pt" in files, f"{node}/step {s} has no meta.pt: {files}"
    first, second = (["meta.pt", "meta.pt.sha256", "rank0.pt", "rank1.pt"], ["meta.pt", "meta.pt.sha256", "rank2.pt", "rank3.pt"])
    assert steps["node0"][10] == (second if swap else first), steps  # after a swap, ranks 0-1 run on node 1
    assert steps["node1"][10] == (first if swap else second), steps
    # Every rank resumed from the same step (the newest that is good on both nodes) and then matched
    # the unbroken run after every step, every parameter bit for bit.
    for rank, result in enumerate(results):
        assert result[1] == list(range(resumed_from + 1, 11)), f"rank {rank} resumed at {result[1][:1]}"
    if damage == "truncate":
        # Warned by the rank that verifies node 1's directory (rank 0 after the swap).
        warned = [m for result in results for m in result[5] if "skipping checkpoint" in m]
        assert len(warned) == 1 and "step_000000005" in warned[0] and "node1" in warned[0], warned
    for s in range(1, 11):
        assert list(states[s]) == list(full_states[s])
        for key in full_states[s]:
            assert torch.equal(states[s][key], full_states[s][key]), f"step {s}: {key} differs from the unbroken run"


def layout_worker(rank, world, shared_dir, node_base):
    ctx = _context(rank, world)
    shared = detect_layout(shared_dir, ctx)
    per_node = detect_layout(os.path.join(node_base, f"node{rank // PER_NODE}"), ctx)
    forced = detect_layout(shared_dir, ctx, shared=False)
    return shared.writer_of, per_node.writer_of, forced.writer_of, sorted(os.listdir(shared_dir))


def test_layout_is_detected(tmp_path):
    results = run_distributed(layout_worker, 4, args=(str(tmp_path / "shared"), str(tmp_path / "nodes")), timeout=120)
    for shared, per_node, forced, leftover in results:
        assert shared == (0, 0, 0, 0)
        assert per_node == (0, 0, 2, 2)
        assert forced == (0, 0, 2, 2)
        assert leftover == [], f"marker files left behind: {leftover}"


def _pod_context(rank: int, world: int) -> DistributedContext:
    """One process per node, as in the StatefulSet test: every rank is its node's local rank 0."""
    return DistributedContext(rank=rank, world_size=world, local_rank=0, local_world_size=1,
                              device=torch.device("cpu"), backend="gloo")


def pods_worker(rank, world, base, max_steps, stop_at, stopped):
    """One phase of a job whose size changes between phases: rank r runs on pod r, with the directory
    ``pod<r>`` (an empty one for a new pod). Trains the global batch 6 up to `max_steps` (epochs=2: 18
    steps), checkpointing every 2; with `stop_at`, after that step SIGTERM reaches the last pod
    (`stopped="last"`: Kubernetes stopping the pod a scale-down removes) or every pod (``"all"``:
    torchrun restarting every node's workers to grow the job), and every rank stops at the step they
    agree on. Returns the full state after each step trained, what the directory holds, the last step."""
    torch.manual_seed(0)
    directory = os.path.join(base, f"pod{rank}")
    trainer = DistributedTrainer(tiny_gpt(), sgd_momentum, strategy="zero3", context=_pod_context(rank, world),
                                 seed=3, checkpoint_dir=directory, checkpoint_every=2, keep_last=2)
    states: dict[int, dict] = {}

    def record(step, _metrics):
        states[step] = {k: v.clone() for k, v in trainer.strategy.model_state_dict(trainer.model).items()}
        if step == stop_at and (stopped == "all" or rank == world - 1):
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        trainer.fit(tiny_gpt_data(), epochs=2, global_batch_size=6, max_steps=max_steps, log_every=1, on_step=record)
    except SystemExit as stop:  # fit passes the agreed SIGTERM on: SystemExit(143) on every rank
        assert stop_at is not None and stop.code == 128 + signal.SIGTERM, stop.code
    trainer.close()
    torch.distributed.barrier()
    manager = CheckpointManager(directory)
    held = {s: sorted(os.listdir(manager.path_for(s))) for s in manager.steps()}
    return states, held, trainer.step


@pytest.mark.slow
def test_pods_scaled_up_and_down_resume_with_their_own_directories(tmp_path):
    """The StatefulSet scaled 2 -> 3 -> 2 -> 3 pods, each with its own volume. Growing, every pod's workers
    get SIGTERM (first growth) or the job stops at max_steps (second), and the new pod starts with an
    empty directory, the second time with one kept from the first (older steps only); shrinking, the
    removed pod alone gets SIGTERM and leaves with its directory. Every phase resumes from the last step
    of the one before (for the shrink, the stop's checkpoint, made whole on every pod), and after every
    step the parameters equal one process with one directory (global batch 6 at 1, 2 and 3 pods)."""
    reference = run_distributed(pods_worker, 1, args=(str(tmp_path / "one"), 18, None, None), timeout=120)[0][0]
    base = str(tmp_path / "pods")
    trained: dict[int, dict] = {}
    last = 0
    for world, max_steps, stop_at, stopped in ((2, 18, 3, "all"), (3, 14, 7, "last"), (2, 12, None, None),
                                               (3, 18, None, None)):
        stale = CheckpointManager(os.path.join(base, "pod2")).steps()
        results = run_distributed(pods_worker, world, args=(base, max_steps, stop_at, stopped), timeout=120)
        end = results[0][2]
        for rank, (states, held, step) in enumerate(results):
            assert step == end and sorted(states) == list(range(last + 1, end + 1)), (world, rank, sorted(states))
            assert end in held and held[end][:2] == ["meta.pt", "meta.pt.sha256"], (world, rank, held)
            if stop_at is not None:
                assert end in (stop_at + 1, stop_at + 2), (stop_at, end)
            if stopped == "last":  # a pod leaves: the stop's checkpoint holds every rank's file on every pod
                assert held[end][2:] == ["rank0.pt", "rank1.pt", "rank2.pt"], held
            elif stopped == "all":  # the whole job stops: nobody leaves, nothing is copied
                assert held[end][2:] == [f"rank{rank}.pt"], held
        if world == 3 and stopped is None:
            assert stale and max(stale) < last, stale  # the pod removed earlier kept its volume: older steps only
        elif world == 3:
            assert stale == [], stale
        trained.update(results[0][0])
        last = end
    assert last == 18 and sorted(trained) == list(range(1, 19))
    for step in range(1, 19):
        for key, value in reference[step].items():
            torch.testing.assert_close(trained[step][key], value, rtol=0, atol=1e-5,
                                       msg=lambda m: f"step {step}, {key}: {m}")


def pod_lost_worker(rank, world, base):
    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(), sgd_momentum, strategy="zero3", context=_pod_context(rank, world),
                                 seed=3, checkpoint_dir=os.path.join(base, f"pod{rank}"), checkpoint_every=2)
    with pytest.raises(RuntimeError) as caught:
        trainer.fit(tiny_gpt_data(), epochs=2, global_batch_size=6, max_steps=18, log_every=1)
    trainer.close()
    return str(caught.value)


@pytest.mark.slow
def test_a_pod_lost_without_a_stop_is_an_error_not_a_fresh_start(tmp_path):
    """Three pods checkpoint (each holds its share: ZeRO-3); pod 2 is then lost without a stop, its volume
    with it. The two left cannot resume whole: every rank refuses, naming the steps and what to do,
    instead of throwing the run away by training from step 0."""
    base = str(tmp_path)
    run_distributed(pods_worker, 3, args=(base, 6, None, None), timeout=120)
    messages = run_distributed(pod_lost_worker, 2, args=(base,), timeout=120)
    for message in messages:
        assert "none is whole among the nodes here" in message and "[4, 6]" in message, message
        assert "Bring that node or its volume back" in message, message


def one_node_of_two_worker(rank, world, base, train):
    """`train`: 4 ranks on two nodes write a ZeRO-3 checkpoint into their own directories; else 2 ranks on
    one node resume from node 0's directory alone (the other node's volume is gone)."""
    directory = os.path.join(base, f"node{rank // PER_NODE}")
    torch.manual_seed(0)
    trainer = DistributedTrainer(tiny_gpt(), sgd_momentum, strategy="zero3", context=_context(rank, world),
                                 checkpoint_dir=directory, checkpoint_every=2)
    try:
        trainer.fit(tiny_gpt_data(), epochs=1, batch_size=3, max_steps=2)
        return "trained"
    except FileNotFoundError as err:
        return str(err)
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_resume_without_the_other_nodes_files_says_where_they_are(tmp_path):
    # It failed with "checkpoint file '.../rank2.pt' does not exist", nothing saying the files are on the
    # other node's volume (meta.pt of a directory per node covers only its own node's files).
    assert run_distributed(one_node_of_two_worker, 4, args=(str(tmp_path), True), timeout=240) == ["trained"] * 4
    for said in run_distributed(one_node_of_two_worker, 2, args=(str(tmp_path), False), timeout=240):
        assert "checkpoint file rank2.pt is not in" in said and "a directory per node" in said, said
        assert "Copy the other nodes' rank files" in said, said

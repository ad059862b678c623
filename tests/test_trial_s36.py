"""Defects found in session 36 (trials and the ROADMAP's open points), each tested where it can fail on CPU."""

from __future__ import annotations

import warnings

import torch

from distributed_training.testing import run_distributed


def group_dataset_worker(rank, world):
    """A group of the job's ranks 1 and 2 (as a parameter server's workers are), each with a dataset of
    its own length: the warning names the job's ranks, not the members' indices in the group."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from distributed_training.data import ShardedSampler, agree_steps_per_epoch
    from distributed_training.runtime import DistributedContext

    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    member = rank - 1
    ctx = DistributedContext(rank=member, world_size=2, local_rank=0, local_world_size=1, device=torch.device("cpu"),
                             backend="gloo", group=group)
    data = TensorDataset(torch.zeros(8 + 4 * member, 1))
    sampler = ShardedSampler(data, num_replicas=1, rank=0)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        agree_steps_per_epoch(DataLoader(data, batch_size=2, sampler=sampler), sampler, ctx)
    return [str(w.message) for w in said]


def test_the_dataset_length_warning_names_a_groups_members_by_their_job_rank():
    results = run_distributed(group_dataset_worker, 3, timeout=60)
    for said in results[1:]:
        assert len(said) == 1 and "(rank 1: 8, rank 2: 12)" in said[0], said


def empty_on_one_rank_worker(rank, world):
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    n = 0 if rank == 1 else 16
    trainer = DistributedTrainer(torch.nn.Linear(4, 2), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(TensorDataset(torch.randn(n, 4), torch.randn(n, 2)), epochs=1, criterion=F.mse_loss,
                        batch_size=4)
    except ValueError as err:
        return str(err)
    finally:
        trainer.close()
    return None


def test_an_empty_dataset_on_one_rank_is_not_blamed_on_the_others():
    # The rank holding 16 samples said "the training data gives no step: 16 sample(s) ... An empty dataset?"
    said = run_distributed(empty_on_one_rank_worker, 2, timeout=60)
    assert said[0].startswith("fit(): another rank's training data gives no step") and "16 sample(s)" in said[0]
    assert said[1].startswith("fit(): the training data gives no step in an epoch: 0 sample(s)"), said[1]


def evaluation_waits_worker(rank, world, log_dir):
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero3", log_dir=log_dir,
                                 progress=False)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    waits = trainer.model.waits
    armed = waits.on  # the first step's communication is timed
    trainer.evaluate(data, F.mse_loss, batch_size=4)
    result = armed, waits.on, waits._host_s
    trainer.close()
    return result


def test_an_evaluation_between_timed_steps_is_not_counted_as_their_communication(tmp_path):
    # The waits of the evaluation's all-gathers were added to the next step's exposed communication.
    for armed, still_on, waited in run_distributed(evaluation_waits_worker, 2, args=(str(tmp_path / "logs"),),
                                                   timeout=90):
        assert armed and still_on and waited == 0.0, (armed, still_on, waited)


class _Experts(torch.nn.Module):
    """A mixture of experts routed by the data: each sample goes to the expert its first feature's sign
    picks, and an expert no sample of the batch goes to does not run (as in Mixtral-style layers)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                            for _ in range(2)])

    def forward(self, h, route):
        out = torch.zeros_like(h)
        for k, expert in enumerate(self.experts):
            rows = (route == k).nonzero().flatten()
            if len(rows):
                out = out.index_add(0, rows, expert(h[rows]))
        return out


class _MoENet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.moe, self.out = torch.nn.Linear(4, 8), _Experts(), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.out(self.moe(self.inp(x), (x[:, 0] > 0).long()))


def experts_worker(rank, world, policy):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer
    from distributed_training.strategies import FSDPStrategy

    torch.manual_seed(0)
    model = _MoENet()
    reference = _MoENet()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    strategy = FSDPStrategy(auto_wrap_policy={_Experts}) if policy else "zero3"
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), strategy=strategy,
                                 progress=False)
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        x[:4, 0] = x[:4, 0].abs()  # rank 0's rows all go to expert 1, rank 1's to expert 0
        x[4:, 0] = -x[4:, 0].abs()
        before = {k: v.clone() for k, v in trainer.full_state_dict().items()}
        try:
            trainer.train_step((x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]), F.mse_loss)
        except RuntimeError as err:
            after = trainer.full_state_dict()
            trainer.close(barrier=False)
            return "raised", str(err), all(torch.equal(before[k], after[k]) for k in before)  # (rank 0's only)
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        full = trainer.full_state_dict()
        if full:  # (rank 0's)
            worst = max(worst, max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items()))
    trainer.close()
    return "trained", worst, None


def test_fsdp_ranks_running_different_units_raise_and_one_unit_for_the_experts_trains_exactly():
    # Each expert a unit (the default policy: a ModuleList's repeated blocks), rank 0 ran expert 1 where
    # rank 1 ran expert 0: their gathers met and both trained on mixed weights, silently.
    for outcome, said, unchanged in run_distributed(experts_worker, 2, args=(False,), timeout=90):
        assert outcome == "raised" and "ran different units" in said, said
        assert "rank 0 gathered 'moe.experts.1'; rank 1 gathered 'moe.experts.0'" in said and unchanged, said
    for outcome, worst, _ in run_distributed(experts_worker, 2, args=(True,), timeout=90):
        assert outcome == "trained" and worst < 1e-5, (outcome, worst)


def _head_faster(params):
    """The head at a higher learning rate than the backbone, chosen by identity (a fine-tuning habit)."""
    params = list(params)
    head = {id(p) for p in _HEAD}
    return torch.optim.SGD([{"params": [p for p in params if id(p) not in head], "lr": 0.001},
                            {"params": [p for p in params if id(p) in head], "lr": 0.1}], lr=0.001, momentum=0.9)


_HEAD: list = []


def lr_groups_worker(rank, world, strategy):
    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    _HEAD[:] = list(model[2].parameters())
    try:
        DistributedTrainer(model, _head_faster, strategy=strategy, progress=False).close()
    except ValueError as err:
        return str(err)
    return "built"


def test_a_learning_rate_per_group_over_flat_shards_is_refused():
    # The head's group came out empty over the flat shards: it trained at the backbone's rate, silently
    # (3.7e-2 off one process in 3 steps, a trial); only a differing weight decay was refused.
    for strategy in ("zero1", "zero3"):
        said = run_distributed(lr_groups_worker, 1, args=(strategy,), timeout=60)[0]
        assert "lr=0.1 (the trained group's 0.001)" in said and "strategy 'ddp'" in said, said
    assert run_distributed(lr_groups_worker, 1, args=("ddp",), timeout=60) == ["built"]


def frozen_differently_worker(rank, world, strategy):
    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    model[2 * rank].weight.requires_grad_(False)  # rank 0 freezes 0.weight, rank 1 2.weight: the same size
    try:
        DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy=strategy, progress=False).close()
    except ValueError as err:
        return str(err)
    return "built"


def test_ranks_that_froze_different_parameters_are_refused_naming_them():
    # Every collective lined up: gradients of different parameters were averaged together (a frozen weight
    # moved by 0.5 under ZeRO-3, the replicas 0.54 apart in 3 steps: a trial).
    for strategy in ("ddp", "zero3"):
        for said in run_distributed(frozen_differently_worker, 2, args=(strategy,), timeout=60):
            assert "rank 0 has parameter '0.weight' shape [8, 8] dtype torch.float32 frozen" in said, said
            assert "rank 1 has parameter '0.weight' shape [8, 8] dtype torch.float32." in said, said


def groups_by_rank_worker(rank, world, empty_everywhere):
    """A param group empty on rank 1 only (a factory that reads what a rank's shards hold) loses nothing:
    rank 1 alone refused it, and rank 0 went on into its next collective. Empty on every rank: refused
    on both."""
    from distributed_training import DistributedTrainer

    def factory(params):
        params = list(params)
        mine = [] if (rank == 1 or empty_everywhere) else params[1:]
        rest = params if (rank == 1 or empty_everywhere) else params[:1]
        return torch.optim.SGD([{"params": rest, "lr": 0.001}, {"params": mine, "lr": 0.1}], lr=0.001)

    torch.manual_seed(0)
    try:
        DistributedTrainer(_MoENet(), factory, strategy="zero3", progress=False).close()
    except ValueError as err:
        return str(err)
    return "built"


def test_a_param_group_empty_on_some_ranks_only_is_not_refused_and_nothing_hangs():
    assert run_distributed(groups_by_rank_worker, 2, args=(False,), timeout=60) == ["built", "built"]
    for said in run_distributed(groups_by_rank_worker, 2, args=(True,), timeout=60):
        assert "lr=0.1 (the trained group's 0.001)" in said, said


class _Looped(torch.nn.Module):
    """A block (a unit of its own) applied a number of times each rank's data decides."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
                                           for _ in range(2)])
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x, depth=None):
        h = self.blocks[0](self.inp(x))
        for _ in range(int(x[0, 0].item() > 0) + 2 if depth is None else depth):
            h = self.blocks[1](h)
        return self.out(h)


def repeated_unit_worker(rank, world):
    import torch.nn.functional as F

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model, reference = _Looped(), _Looped()
    reference.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), strategy="zero2", progress=False)
    g, worst = torch.Generator().manual_seed(2), 0.0
    for step in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        x[0, 0], x[4, 0] = 1.0, -1.0  # rank 0 applies the block 3 times, rank 1 twice
        trainer.train_step((x[4 * rank:4 * rank + 4], y[4 * rank:4 * rank + 4]), F.mse_loss)
        ref_opt.zero_grad()
        ((F.mse_loss(reference(x[:4], 3), y[:4]) + F.mse_loss(reference(x[4:], 2), y[4:])) / 2).backward()
        ref_opt.step()
        full = trainer.full_state_dict()
        if full:
            worst = max(worst, max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items()))
    trainer.close()
    return worst


def test_zero2_calling_a_gathered_unit_more_often_on_one_rank_is_not_refused():
    # ZeRO-2 keeps a unit gathered through the step: a second call issues no collective, so the ranks'
    # collectives line up and the result is exact; the check compares gathers, not calls (a review).
    for worst in run_distributed(repeated_unit_worker, 2, timeout=90):
        assert worst < 1e-5, worst


def test_the_watch_over_gathered_units_keeps_constant_memory():
    # A wrapper that never reduces (everything frozen) never reports: the names it kept grew without bound.
    from distributed_training.strategies.fsdp_unused import NAMES_KEPT, UnusedWatch

    watch = UnusedWatch()
    for k in range(10 * NAMES_KEPT):
        watch.unit_gathered(f"blocks.{k % 4}")
    assert len(watch.gathered) == NAMES_KEPT and watch.count == 10 * NAMES_KEPT


def tensor_parallel_optimizer_object_worker(rank, world):
    from distributed_training import DistributedTrainer
    from distributed_training.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    try:
        DistributedTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), tensor_parallel_size=2,
                           progress=False).close()
    except ValueError as err:
        return str(err)
    return "built"


def test_an_optimizer_object_over_layers_tensor_parallelism_replaces_is_refused():
    # It stepped the layers' old parameters: the split layers never trained, silently (no error, loss flat).
    for said in run_distributed(tensor_parallel_optimizer_object_worker, 2, timeout=90):
        assert "were replaced when the strategy set the model up" in said and "pass a callable" in said, said


def summing_criterion_evaluation_worker(rank, world, batch_size):
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from distributed_training import DistributedTrainer

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(29, 4), torch.randint(0, 3, (29,))
    trainer = DistributedTrainer(model, lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    got = trainer.evaluate(TensorDataset(x, y), torch.nn.CrossEntropyLoss(reduction="sum"), batch_size=batch_size)
    trainer.close()
    return got["loss"], float(F.cross_entropy(model(x), y, reduction="sum")) / 29


def test_evaluate_with_a_summing_criterion_gives_the_loss_per_sample_at_any_world_and_batch():
    # Each batch's sum was weighted as a mean (by its rows): 6.3 at world 2 in batches of 4, 24.3 in one
    # batch, for a per-sample loss of 1.67 (a trial).
    for world, batch_size in ((1, 4), (2, 4), (3, 29)):
        for got, want in run_distributed(summing_criterion_evaluation_worker, world, args=(batch_size,), timeout=60):
            assert abs(got - want) < 1e-5, (world, batch_size, got, want)


class _Output(dict):
    """Like a Hugging Face ModelOutput without labels: a mapping that leaves out its None fields, and a
    ``loss`` attribute that is None."""

    loss = None


class _NoLabelsModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, input_ids, labels=None):
        return _Output(logits=self.lin(input_ids))


def no_loss_worker(rank, world):
    from distributed_training import DistributedTrainer

    trainer = DistributedTrainer(_NoLabelsModel(), lambda ps: torch.optim.SGD(ps, lr=0.1), progress=False)
    said = []
    for call in (lambda: trainer.train_step({"input_ids": torch.randn(4, 4)}),
                 lambda: trainer.evaluate([{"input_ids": torch.randn(4)}] * 4, batch_size=2)):
        try:
            call()
        except ValueError as err:
            said.append(str(err))
    trainer.close()
    return said


def test_a_model_that_returns_no_loss_is_said_plainly():
    # "'NoneType' object has no attribute 'dtype'" in train_step, "... 'detach'" in evaluate (a trial).
    said = run_distributed(no_loss_worker, 1, timeout=60)[0]
    assert len(said) == 2 and all("with loss=None" in s and "'labels'" in s for s in said), said


def data_fails_worker(rank, world, sharded, fail_after, log_dir):
    """Rank 1's dataset raises in the fourth batch; its process stays (a notebook, cleanup code): the other
    rank waited in the step's collectives until the connection closed or the collective timeout, told
    neither who failed nor what it raised (a trial). Now it names rank 1 and its error within seconds."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    from distributed_training import DistributedTrainer
    from _failures import fit_outcome

    class Data(Dataset):
        calls = 0

        def __len__(self):
            return 40

        def __getitem__(self, i):
            Data.calls += 1
            if rank == 1 and Data.calls > fail_after:
                raise OSError(f"corrupt sample {i} on rank 1")
            return torch.full((8,), float(i)), torch.tensor(i % 4)

    torch.manual_seed(0)
    trainer = DistributedTrainer(torch.nn.Linear(8, 4), lambda ps: torch.optim.SGD(ps, lr=0.01), progress=False,
                                 timeout=60, log_dir=log_dir, log_every=1)
    trainer._peer_exit_after = 30.0
    # A DataLoader of the user's own (not sharded by fit): the ranks agree on each batch first.
    data = Data() if sharded else DataLoader(Data(), batch_size=4)
    return fit_outcome(rank, trainer, lambda: trainer.fit(data, epochs=1, criterion=F.cross_entropy,
                                                         batch_size=4 if sharded else None), OSError)


def test_a_rank_whose_data_raises_is_named_to_the_others_with_its_error(tmp_path):
    # Where the peers wait: the next step (sharded), the batch agreement (the user's DataLoader), the
    # agreement before the first step, the straggler probe (a log_dir, log_every=1: before every step).
    cases = [(True, 12, None), (False, 12, None), (False, 0, None), (True, 12, str(tmp_path / "logs"))]
    for sharded, fail_after, log_dir in cases:
        (said0, seconds0), (said1, _) = run_distributed(data_fails_worker, 2, args=(sharded, fail_after, log_dir),
                                                        timeout=90)
        assert said1.startswith("own: corrupt sample"), said1
        assert said0.startswith("peer 1:") and "OSError: corrupt sample" in said0 and seconds0 < 20, \
            (sharded, fail_after, log_dir, said0, seconds0)
        assert "during loading its batch for training step" in said0, said0

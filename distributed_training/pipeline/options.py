"""The trainer's pipeline arguments (`PipelineOptions`), checked where they are given: by
`DistributedTrainer` before any rendezvous, and by a `dtrain` config when it loads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .schedules import SCHEDULES

__all__ = ["PipelineOptions"]

#: Schedules that keep at most about P microbatches in flight: fewer microbatches than stages never
#: fill the pipeline (refused, naming `microbatches`).
_ONE_F_ONE_B_FAMILY = ("1f1b", "interleaved_1f1b", "zbh1")
#: What `partition` may balance the stages by (``pipeline_balance``).
BALANCES = ("parameters", "compute", "time")


@dataclass(frozen=True)
class PipelineOptions:
    """The trainer's pipeline arguments, checked where they are given (before any rendezvous).

    Attributes:
        size: pipeline stages per model replica (``pipeline_parallel_size``); 1: no pipeline.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or ``"zbh1"`` (``pipeline_schedule``).
        microbatches: microbatches per batch (default: `size`); at least `size` for the 1F1B family,
            a multiple of it for ``"interleaved_1f1b"``.
        split_points: the layer names where stages 1, 2, ... start (``pipeline_split_points``), or None
            to cut as `balance` says.
        chunks: model chunks per rank (``pipeline_chunks``; default 2 for ``"interleaved_1f1b"``, else 1).
        init_seed: the base seed of a meta-device model's initialisation (the trainer's `seed`; see
            `meta_init`): each rank initialises only its stages' layers, from streams seeded by the
            layer's (GPT) or module's name, so the weights do not depend on the cut.
        balance: what the stages are balanced by when `split_points` is None (``pipeline_balance``):
            ``"parameters"`` (default: parameter counts) or ``"compute"`` (our GPT only: each layer's
            forward and backward cost per token, `gpt_stages.gpt_layer_costs`; for wide models whose step
            the GPU, not the host, bounds) or ``"time"`` (each layer's forward + backward measured on the
            device at setup, averaged over the ranks: `balance.measure_layer_times`). ``"compute"`` and
            ``"time"`` cut where the schedule's simulated step is shortest (`balance.schedule_cut`).
        sample_input: for ``balance="time"``, one microbatch's input to the first layer (a tensor, or a
            tuple, list or dict of tensors; ``pipeline_sample_input``); None: our GPT's default, token
            ids of shape (1, ``cfg.block_size``) (`balance.default_sample`); other models need one. For
            ``balance="compute"``, our GPT's token ids of one microbatch, (rows, sequence length): the
            compute model's sequence length and tokens a microbatch (default: one sequence of
            ``cfg.block_size``).
        mixed_precision: the trainer's ``mixed_precision`` (``"bf16"``, ``"fp16"``, ``"fp32"`` or None):
            the autocast the layers are timed under.
        half_blocks: cut our GPT's chain at half blocks (``pipeline_half_blocks``): each block is two
            layers, ``block.i.a`` (its attention) and ``block.i.m`` (its MLP), so a stage may end inside a
            block (a finer balance: at GPT-1.3B on 4 stages the heaviest stage's FLOPs go from 7.8% to
            2.3% above the mean). Split points may then name half blocks. Our GPT only; no effect
            without a pipeline.
        cuda_graphs: replay each stage's forward and backward as CUDA graphs
            (``pipeline_cuda_graphs``; `graphs.StageGraphs`): far fewer host launches, for steps the
            host bounds (``"zbh1"``: its I and W passes as graphs of their own). CUDA only; not with
            activation checkpointing, or inner strategies that gather parameters in module hooks (ZeRO-1/2/3, FSDP).
        compile_loss: run the last stage's loss through ``torch.compile`` on CUDA
            (``pipeline_compile_loss``; `compiled_loss.CompiledLoss`): one fused pass over the logits
            instead of several, so the stage holding the head carries no extra loss work (the compute
            balance then counts none). The loss as it is on CPU, and where compiling fails (a warning).
    """

    size: int = 1
    schedule: str = "1f1b"
    microbatches: int | None = None
    split_points: tuple[str, ...] | None = None
    chunks: int | None = None
    init_seed: int = 0
    balance: str = "parameters"
    sample_input: Any = field(default=None, compare=False, repr=False)
    mixed_precision: str | None = None
    half_blocks: bool = False
    cuda_graphs: bool = False
    compile_loss: bool = False

    def __post_init__(self) -> None:
        size = self.size
        if not isinstance(self.compile_loss, bool):
            raise TypeError(f"pipeline_compile_loss must be True or False, got {self.compile_loss!r}")
        if not isinstance(self.half_blocks, bool):
            raise TypeError(f"pipeline_half_blocks must be True or False, got {self.half_blocks!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"pipeline_cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.balance not in BALANCES:
            raise ValueError(f"pipeline_balance must be one of {list(BALANCES)}, got {self.balance!r}")
        if self.sample_input is not None:
            if self.balance not in ("time", "compute"):
                raise ValueError(f"pipeline_sample_input is for pipeline_balance='time' (it times the layers on "
                                 f"it) or 'compute' (its shape: the sequence length and tokens a microbatch), but "
                                 f"pipeline_balance={self.balance!r}: leave it out or balance by time or compute")
            from .balance import check_sample  # the sample's rules live with the timing

            check_sample(self.sample_input)
        if isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int):
            raise TypeError(f"seed must be an integer, got {self.init_seed!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {size!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline_schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        interleaved = self.schedule == "interleaved_1f1b"
        chunks = self.chunks if self.chunks is not None else (2 if interleaved else 1)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"pipeline_chunks must be an integer >= 1, got {chunks!r}")
        if interleaved and chunks < 2:
            raise ValueError(f"pipeline_chunks must be >= 2 for pipeline_schedule='interleaved_1f1b', got {chunks}")
        if not interleaved and chunks != 1:
            raise ValueError(f"pipeline_chunks must be 1 for pipeline_schedule={self.schedule!r} (only "
                             f"'interleaved_1f1b' runs several chunks per rank), got {chunks}")
        if self.cuda_graphs and size == 1:
            raise ValueError("pipeline_cuda_graphs=True replays pipeline stages: it needs pipeline_parallel_size > 1")
        if self.compile_loss and size == 1:
            raise ValueError("pipeline_compile_loss=True compiles the last pipeline stage's loss: it needs "
                             "pipeline_parallel_size > 1")
        microbatches = self.microbatches if self.microbatches is not None else size
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
        if size > 1 and self.schedule in _ONE_F_ONE_B_FAMILY and microbatches < size:
            raise ValueError(f"microbatches ({microbatches}) must be >= pipeline_parallel_size ({size}) for "
                             f"pipeline_schedule={self.schedule!r}: fewer never fill the pipeline")
        if size > 1 and interleaved and microbatches % size:
            raise ValueError(f"microbatches ({microbatches}) must be a multiple of pipeline_parallel_size ({size}) "
                             "for pipeline_schedule='interleaved_1f1b'")
        split = self.split_points
        if split is not None:
            if isinstance(split, str) or not all(isinstance(name, str) for name in split):
                raise TypeError(f"pipeline_split_points must be a list of layer names, got {split!r}")
            split = tuple(split)
            if len(split) != size * chunks - 1:
                raise ValueError(f"pipeline_split_points names {len(split)} boundaries, so {len(split) + 1} stages, "
                                 f"but pipeline_parallel_size x pipeline_chunks = {size * chunks} stages need "
                                 f"{size * chunks - 1}")
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "microbatches", microbatches)
        object.__setattr__(self, "split_points", split)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def num_stages(self) -> int:
        return self.size * self.chunks

    @property
    def microbatch_count(self) -> int:
        """The microbatches a batch is cut into: `microbatches`, or by default `size`."""
        return self.microbatches or self.size

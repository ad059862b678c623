"""Pipeline parallelism from scratch (issue 15; design in docs/pipeline.md).

`schedules`: what each rank does, as data (GPipe, 1F1B, interleaved 1F1B, ZB-H1), and a simulator that
checks a schedule and measures its bubble. `stages`: the model as a chain of layers (`chain`), where to
cut it (`partition`, `split_at`; `balance`: the costs it cuts by, parameters, FLOPs or measured times),
one stage's module (`Stage`), building only one's own stage of a GPT (`GPTStages`), and tied parameters
whose copies on several stages sum their gradients. `meta_init`: a model built on the meta device given
storage and initial weights for one rank's stages only. `engine`: one rank's actions run for a training
step, over `p2p`'s messages. `split_backward`: ZB-H1's split backward (`SplitBackward`: the linear
layers' weight gradients deferred from I to W). `timing`: a step's busy time by action and measured
bubble (`PipelineTiming`, `PipelineEngine.timing`). `graphs`: stages replayed as CUDA graphs.
`compiled_loss`: the last stage's loss through ``torch.compile`` (`CompiledLoss`).
"""

from .compiled_loss import CompiledLoss
from .engine import PipelineEngine
from .schedules import Action, ScheduleError, Simulation, bubble_formula, build_schedule, simulate, stage_of
from .split_backward import SplitBackward
from .timing import PipelineTiming
from .gpt_stages import GPTEmbedding, GPTHead, GPTStages, gpt_key, gpt_layer_flops, layer_seed, lm_loss
from .stages import (Chain, Stage, TiedGroup, chain, find_ties, model_keys, partition, split_at, sync_tied_grads,
                     tied_groups)

__all__ = [
    "Action", "ScheduleError", "Simulation", "bubble_formula", "build_schedule", "simulate", "stage_of",
    "Chain", "GPTEmbedding", "GPTHead", "GPTStages", "Stage", "TiedGroup", "chain", "find_ties", "gpt_key",
    "gpt_layer_flops", "layer_seed",
    "lm_loss", "model_keys", "partition", "split_at", "sync_tied_grads", "tied_groups",
    "CompiledLoss", "PipelineEngine", "PipelineTiming", "SplitBackward",
]

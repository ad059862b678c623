"""Pipeline parallelism from scratch (issue 15; design in docs/pipeline.md).

`stages`: the model as a chain of layers (`chain`), where to cut it (`partition`, `split_at`), one
stage's module (`Stage`), building only one's own stage of a GPT (`GPTStages`), and the tied
parameters whose copies on several stages sum their gradients (`tied_groups`, `sync_tied_grads`).
"""

from .stages import (GPTEmbedding, GPTHead, GPTStages, Stage, TiedGroup, chain, find_ties, gpt_key, layer_seed,
                     lm_loss, partition, split_at, sync_tied_grads, tied_groups)

__all__ = [
    "GPTEmbedding",
    "GPTHead",
    "GPTStages",
    "Stage",
    "TiedGroup",
    "chain",
    "find_ties",
    "gpt_key",
    "layer_seed",
    "lm_loss",
    "partition",
    "split_at",
    "sync_tied_grads",
    "tied_groups",
]

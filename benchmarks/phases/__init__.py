"""The suite's phases. Each module has `run(ctx, opts) -> dict` (a worker phase, run by every rank of a
torchrun job; rank 0's dict is recorded) or `run(results, opts) -> dict` (an offline phase, run by the
orchestrator on what the workers recorded). A phase that cannot run here returns `common.skipped(reason)`.

`WORLDS` says at which world sizes of the suite's run a worker phase runs:
``one`` (world 1 only: single-device measurements), ``multi`` (every world >= 2), ``all``, ``top``
(the largest world only); ``offline`` phases run once, after the workers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """A phase: its module (imported when it runs), where it runs and one line on what it measures."""

    name: str
    worlds: str
    summary: str

    def runs_at(self, world: int, top: int) -> bool:
        return {"one": world == 1, "multi": world >= 2, "all": True, "top": world == top,
                "offline": False}[self.worlds]

    def module(self):
        import importlib

        return importlib.import_module(f"phases.{self.name}")


PHASES = {p.name: p for p in (
    Phase("collectives", "multi", "NCCL's all-reduce/all-gather/reduce-scatter vs our ring/tree/hierarchical and "
          "compressed reductions over a range of sizes; all-reduce beside a matmul (overlap)"),
    Phase("training", "all", "GPT: our DDP / ZeRO-1/2/3 / compressed DDP vs torch DDP and FSDP2, interleaved in one "
          "job; the 1-GPU baseline, no_sync (compute-only) and comm-only steps"),
    Phase("models", "multi", "timm / Hugging Face models: our DDP and trainer vs torch DDP, interleaved"),
    Phase("images", "all", "our ResNet-50 and ViT-B/16, images/s per GPU: our DDP vs torch DDP on synthetic batches, "
          "and our DDP fed by the image-folder reader from JPEGs it writes (the decode rate beside it); "
          "--variants workers=N,jpegs=N,model=NAME"),
    Phase("accuracy", "all", "time to accuracy: the digits image recipe through dtrain's job until val_accuracy "
          "reaches the target, at each world size with the same global batch; --variants recipe=NAME,target=X,epochs=N"),
    Phase("precision", "top", "our trainer (DDP) in fp32, bf16 and fp16 (our loss scaler): step time, memory, loss"),
    Phase("topk", "one", "Top-K compression's selection (blockmax, exact, chunked, sampled) and PowerSGD, per "
          "bucket and per step"),
    Phase("profiling", "top", "where a DDP step's time goes: kernel (GPU) or operator (CPU) time by category"),
    Phase("monitor", "all", "the monitor's cost: the trainer with and without log_dir, interleaved, paired by round"),
    Phase("checkpoint", "all", "the cost of a checkpoint every N steps (GPT, DDP: rank 0 writes it all), synchronous "
          "vs in the background (checkpoint_async), as % of step time, paired by round; --variants every=N,zero3"),
    Phase("memory", "top", "GPT 1.3B in our trainer: activation checkpointing off/on (step time, peak memory), and "
          "fit(batch_size='auto'): the batch chosen, then steps at it without running out of memory"),
    Phase("pipeline", "multi", "GPT over a pipeline of every rank and (world >= 4) two pipelines of half the ranks "
          "(P x DP = 2): our schedules (GPipe, 1F1B, interleaved, ZB-H1) against torch.distributed.pipelining's, "
          "tokens/s and peak memory per stage, bubble measured vs formula; --variants time: stages cut by "
          "measured layer times"),
    Phase("compile", "all", "GPT tokens/s: eager vs torch.compile in both orders and per block under our DDP, "
          "torch's compiled DDP as reference"),
    Phase("pipeline_trainer", "multi", "GPT through DistributedTrainer(pipeline_parallel_size=P): GPipe, 1F1B, "
          "interleaved at P=2 (and P=4, P x DP) vs our DDP trainer on the same batches: tokens/s, memory, loss"),
    Phase("tensor", "multi", "GPT 1.3B (and ~7B) through DistributedTrainer(tensor_parallel_size=T, "
          "sequence_parallel) at T=2 x DP, T=4, T=2 x FSDP vs torch's parallelize_module with the same plan, "
          "interleaved: tokens/s per GPU, MFU, peak memory, loss"),
    Phase("ps", "multi", "the parameter server (sync, sparse tables, 1-4 servers) vs our DDP on a recommender with "
          "large embedding tables: bytes per step, step time, server load, time-to-loss; sync vs ssp vs async "
          "time-to-accuracy on the digits with one slow worker (world >= 3)"),
    Phase("imagenet_projection", "offline", "ResNet-50 / ImageNet epoch time at 8-256 GPUs: the scaling model "
          "calibrated on the images phase (a projection), checked on the worlds it measured"),
    Phase("model_check", "offline", "the scaling model calibrated and checked on this run's collectives and "
          "training, projected to 256 GPUs; and on recorded DDP runs"),
)}

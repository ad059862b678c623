"""What the pipeline trainer tests share: one trainer step against one process on the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def train_against_reference(trainer, reference, ref_opt, batch, kind: str, clip, rank: int, per_replica: int,
                            steps: int):
    """`steps` steps of `step_against_reference`, step s on this replica's `per_replica` rows of the
    global batch ``batch(kind, s, per_replica * trainer.dp_world_size)``. Returns (on rank 0 the
    largest parameter difference after each step, else []; each step's (trainer's, reference's)
    loss; each step's (trainer's, reference's) gradient norm where `clip`, else [])."""
    rows = slice(trainer.dp_rank * per_replica, (trainer.dp_rank + 1) * per_replica)
    worst, losses, norms = [], [], []
    for step in range(steps):
        x, y = batch(kind, step, per_replica * trainer.dp_world_size)
        diff, loss, norm = step_against_reference(trainer, reference, ref_opt, x, y, rows, kind, clip, rank)
        if diff is not None:
            worst.append(diff)
        losses.append(loss)
        if norm is not None:
            norms.append(norm)
    return worst, losses, norms


def step_against_reference(trainer, reference, ref_opt, x, y, rows: slice, kind: str, clip, rank: int):
    """One `trainer` step on this replica's `rows` of the global batch ``(x, y)`` and one step of
    `reference` (one process) on all of it. `kind` ``"mlp"`` uses `F.mse_loss`; ``"gpt"`` the model's own
    language-model loss. Returns (on rank 0: the largest parameter difference after the step, else
    None; (the trainer's loss, the reference's loss on the same rows before its step); with `clip`:
    (the trainer's gradient norm, the reference's), else None)."""
    mlp = kind == "mlp"
    metrics = trainer.train_step((x[rows], y[rows]), F.mse_loss if mlp else None)
    with torch.no_grad():  # this replica's batch, before the step
        mine = (F.mse_loss(reference(x[rows]), y[rows]) if mlp else reference(x[rows], y[rows])).item()
    ref_loss = F.mse_loss(reference(x), y) if mlp else reference(x, y)
    ref_loss.backward()
    norms = None
    if clip is not None:
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        norms = (float(metrics["grad_norm"]), float(ref_norm))
    ref_opt.step()
    ref_opt.zero_grad()
    state = trainer.full_state_dict()
    worst = None
    if rank == 0:
        want = reference.state_dict()
        assert list(state) == list(want), (list(state), list(want))
        worst = max((state[k] - want[k]).abs().max().item() for k in want)
    return worst, (float(metrics["loss"]), mine), norms

"""Saving and re-sharding the state of an optimizer whose parameters are flat shards.

Under ZeRO and FSDP each optimizer parameter is one rank's shard of a flat vector (a unit, or a
dtype group). Its state tensors (momentum, Adam's moments) have the shard's shape and are sharded
the same way, so they re-shard exactly like the parameters; scalars (Adam's `step`) are copied.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..comm.sharded import reshard_flat, shard_size

__all__ = ["sharded_optimizer_state", "load_sharded_optimizer_state"]


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, keys: Sequence[str]) -> dict[str, Any]:
    """This rank's optimizer state, keyed by the name of each flat vector instead of by position."""
    sd = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(keys):
        raise ValueError(f"optimizer holds {len(params)} parameters but {len(keys)} shard names were given")
    state = {}
    for index, key in enumerate(keys):
        entry = sd["state"].get(index)
        if entry is not None:
            state[key] = {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v) for k, v in entry.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} | {"keys": [keys[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_sharded_optimizer_state(
    optimizer: torch.optim.Optimizer,
    keys: Sequence[str],
    numels: Sequence[int],
    read: Callable[[int], dict[str, Any]],
    old_world: int,
    new_world: int,
    new_rank: int,
) -> None:
    """Load state saved by `sharded_optimizer_state` at `old_world` into this rank's optimizer.

    `read(k)` returns old rank k's saved dict; `numels[i]` is the unpadded length of flat vector i.
    """
    first = read(0)
    saved_keys = {k for g in first["param_groups"] for k in g["keys"]}
    if saved_keys != set(keys):
        missing, unexpected = sorted(set(keys) - saved_keys), sorted(saved_keys - set(keys))
        raise ValueError(f"optimizer state does not match this model: missing {missing}, unexpected {unexpected}")
    # Scalars (Adam's step) are the same on every rank; take them from this rank's own file if it has one.
    own = read(new_rank) if new_rank < old_world else first
    state = {}
    for index, (key, numel) in enumerate(zip(keys, numels)):
        saved = own["state"].get(key)
        if saved is None:
            continue
        old_size = shard_size(numel, old_world)
        entry = {}
        for name, value in saved.items():
            if torch.is_tensor(value) and value.dim() == 1 and value.numel() == old_size:
                # This rank's slice, assembled from the saved shards that overlap it (its own when
                # the world size is unchanged).
                entry[name] = reshard_flat(numel, old_world, lambda k, key=key, name=name: read(k)["state"][key][name],
                                           new_world, new_rank)
            else:
                entry[name] = value
        state[index] = entry
    position = {key: i for i, key in enumerate(keys)}
    groups = [{k: v for k, v in g.items() if k != "keys"} | {"params": [position[k] for k in g["keys"]]}
              for g in first["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})

"""FSDP's state dicts: the full one (the plain module's keys, on rank 0) and the sharded one (each
rank's shards, loadable at any other world size)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..checkpoint_shards import extra_state_key, load_extra_states, modules_with_extra_state, read_extra_state
from ..comm.sharded import all_gather_flat, reshard_flat

__all__ = ["FSDPStateDict"]

_FORMAT = "distributed_training.fsdp/1"


def _reader(states) -> Callable[[int], dict]:
    if isinstance(states, dict):
        return lambda k: states
    if callable(states):
        cache: dict[int, dict] = {}

        def read(k: int) -> dict:
            if k not in cache:
                cache[k] = states(k)
            return cache[k]

        return read
    seq = list(states)
    return lambda k: seq[k]


def _check_keys(got: set, expected: set, what: str) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise ValueError(
            f"{what} does not match this model: missing {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
            f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
        )


class FSDPStateDict:
    """The state-dict methods of `FSDP` (a mixin: they need its units and groups)."""

    def unit_names(self) -> list[str]:
        return [u.name for u in self._units]

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded state on rank 0 (on the CPU; other ranks get `{}` unless `rank0_only=False`),
        with the same keys as the plain module's `state_dict()`. Units are gathered one at a time, so
        peak memory grows by one unit, not by the model. Collective: call on every rank. After `release`,
        the module's own."""
        if self._released:
            main = dist.get_rank(self.process_group) == 0 or not rank0_only
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()} if main else {}
        is_main = dist.get_rank(self.process_group) == 0 or not rank0_only
        values: dict[str, torch.Tensor] = {}
        for unit in self._units:
            if unit.padded == 0:  # zero-size parameters only (nothing to gather): still the model's keys
                for info in unit.infos:
                    values.update(dict.fromkeys(info.fqns, torch.empty(info.shape, dtype=unit.shard.dtype)))
                continue
            full = torch.empty(unit.padded, dtype=unit.shard.dtype, device=self.device)
            all_gather_flat(full, unit.shard.detach().to(self.device), self.shard_group, async_op=False).wait()
            if is_main:
                cpu = full.cpu()
                for info in unit.infos:
                    t = cpu[info.offset : info.offset + info.numel].view(info.shape).clone()
                    for fqn in info.fqns:
                        values[fqn] = t
            del full
        if not is_main:
            return {}
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        extra = {extra_state_key(name): read_extra_state(name, m) for name, m in modules_with_extra_state(self.module)}
        out = {}
        for key in self._state_keys:
            if key in values:
                out[key] = values[key]
            elif key in buffers:
                out[key] = buffers[key].detach().cpu().clone()
            elif key in extra:  # a module's get_extra_state() (the module tree is the user's, whole)
                out[key] = extra[key]
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load an unsharded state dict (the plain module's keys); every rank passes the same dict."""
        if self._released:
            self.module.load_state_dict(state)
            return
        _check_keys(set(state), set(self._state_keys), "state dict")
        with torch.no_grad():
            for unit in self._units:
                if unit.padded == 0:
                    continue
                flat = torch.zeros(unit.padded, dtype=unit.shard.dtype)
                for info in unit.infos:
                    value = state[info.fqns[0]]
                    if tuple(value.shape) != tuple(info.shape):
                        raise ValueError(f"'{info.fqns[0]}': expected shape {list(info.shape)}, got {list(value.shape)}")
                    flat[info.offset : info.offset + info.numel] = value.reshape(-1).to(flat.dtype)
                size = unit.padded // self.shard_world
                unit.shard.copy_(flat[self.shard_rank * size : (self.shard_rank + 1) * size])
            buffers = dict(self.module.named_buffers(remove_duplicate=False))
            for key, buf in buffers.items():
                buf.copy_(state[key])
        load_extra_states(self.module, state)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards plus the metadata to re-shard them for another world size."""
        return {
            "format": _FORMAT,
            "world_size": self.shard_world,
            "rank": self.shard_rank,
            "units": {
                u.name: {
                    "numel": u.numel,
                    "shard": u.shard.detach().cpu().clone(),
                    "params": [(info.fqns, tuple(info.shape), info.offset) for info in u.infos],
                }
                for u in self._units
            },
            "buffers": {k: b.detach().cpu().clone() for k, b in self.module.named_buffers()},
        }

    def load_sharded_state_dict(self, states: dict | Sequence[dict] | Callable[[int], dict], *,
                                buffers: dict[str, torch.Tensor] | None = None) -> None:
        """Load shards saved by `sharded_state_dict`, at this world size or any other.

        `states` is this rank's saved dict (same world size), or every saved rank's dict in rank
        order (a list, or a function rank -> dict that is called only for the ranks needed).

        Buffers (BatchNorm's running statistics) are broadcast once at wrapping and then updated by
        each rank from its own data, so they are per-rank state: each rank loads the buffers saved by
        the rank of its own number, or rank 0's when the saved job had no such rank (it grew). Pass
        `buffers` to choose them yourself (hybrid sharding, where shard ranks repeat across nodes).
        """
        read = _reader(states)
        first = read(0)
        if first.get("format") != _FORMAT:
            raise ValueError("not an FSDP sharded state dict (missing or unknown 'format')")
        old_world = first["world_size"]
        if isinstance(states, dict) and old_world != self.shard_world:
            raise ValueError(
                f"the state was saved with {old_world} shards and this job has {self.shard_world}: pass every "
                "rank's saved state (a list or a function rank -> state) to re-shard it"
            )
        _check_keys(set(first["units"]), {u.name for u in self._units}, "FSDP units")
        with torch.no_grad():
            for unit in self._units:
                saved = first["units"][unit.name]
                mine = [(i.fqns, tuple(i.shape), i.offset) for i in unit.infos]
                for (fqns, shape, _), (_, my_shape, _) in zip(saved["params"], mine):
                    if tuple(shape) != my_shape:
                        raise ValueError(f"'{fqns[0]}': the checkpoint has shape {list(shape)}, this model "
                                         f"{list(my_shape)}")
                if saved["numel"] != unit.numel or [tuple(p[1]) for p in saved["params"]] != [p[1] for p in mine]:
                    raise ValueError(
                        f"FSDP unit '{unit.name or '<root>'}' does not match the checkpoint: saved parameters "
                        f"{[p[0][0] for p in saved['params']]} with {saved['numel']} elements, this model has "
                        f"{[p[0][0] for p in mine]} with {unit.numel}"
                    )
                if unit.padded == 0:
                    continue
                if isinstance(states, dict):
                    shard = saved["shard"]
                else:
                    shard = reshard_flat(unit.numel, old_world, lambda k, n=unit.name: read(k)["units"][n]["shard"],
                                         self.shard_world, self.shard_rank)
                unit.shard.copy_(shard)
            if buffers is None:
                buffers = read(self.shard_rank if self.shard_rank < old_world else 0)["buffers"]
            mine = dict(self.module.named_buffers())
            _check_keys(set(buffers), set(mine), "buffers")
            for key, buf in mine.items():
                buf.copy_(buffers[key])

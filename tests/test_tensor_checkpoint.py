"""Tensor-parallel parameters in the one checkpoint format (`distributed_training.tensor.state`).

(a) The composition of a data-parallel strategy's element ranges of a local tensor with the tensor
    split (`tensor_state_layout`): the strided pieces hold exactly the right elements of the full
    tensor, checked against a tensor of `arange` (each element's value is its own index).
(b) Round trips in one process, ranks simulated: each rank's layout packed, the index built from the
    summaries, files served from a dict; saved at TP = 2 x DP = 2 (whole local tensors as DDP holds
    them, or FSDP-like flat shards over several parameters), loaded at TP = 1, 2 and 4 with other
    layouts: parameters and AdamW's moments must equal the full originals exactly (loading copies).
(c) `full_tensors` on two gloo processes.
"""

from __future__ import annotations

import io
import math
import random

import pytest
import torch

from distributed_training.checkpoint_shards import (Holding, Piece, Sources, StateLayout, _local_view, build_index,
                                                    check_shapes, flat_pieces, pack, summary, unpack_optimizer,
                                                    unpack_params, whole_tensors)
from distributed_training.tensor.spec import ShardSpec, set_spec, shard, spec_of, unshard
from distributed_training.tensor.state import full_tensors, parameter_specs, tensor_state_layout
from distributed_training.testing import run_distributed


# --- (a) the composition ------------------------------------------------------------------------

def _full_indices(piece: Piece) -> torch.Tensor:
    return torch.cat([torch.arange(piece.start + i * piece.stride, piece.start + i * piece.stride + piece.length)
                      for i in range(piece.count)])


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_strided_pieces_hold_exactly_the_right_elements(chunks, parts):
    rnd = random.Random(chunks * 10 + parts)
    for _ in range(300):
        dims = rnd.randint(1, 3)
        dim = rnd.randrange(dims)
        shape = [rnd.randint(1, 5) for _ in range(dims)]
        shape[dim] = chunks * parts * rnd.randint(1, 3)
        full = torch.arange(math.prod(shape)).view(shape)
        rank = rnd.randrange(parts)
        spec = ShardSpec(tuple(shape), dim, rank, parts, chunks)
        local = shard(full, spec).reshape(-1)
        lo = rnd.randrange(local.numel())
        hi = rnd.randrange(lo + 1, local.numel() + 1)
        at = rnd.randrange(4)  # the range sits at `at` of a flat holding, other values around it
        holding = torch.full((at + hi - lo + 3,), -1)
        holding[at : at + hi - lo] = local[lo:hi]
        layout = StateLayout({"w": spec.local_shape}, [Holding(holding, [Piece("w", lo, hi - lo, at)])])

        out = tensor_state_layout(layout, {"w": spec}, rank)

        where = f"shape {shape} dim {dim} chunks {chunks} rank {rank}/{parts}, local [{lo}, {hi})"
        assert out.shapes["w"] == tuple(shape), where
        pieces = out.params[0].pieces
        assert len(pieces) <= 3 * chunks, where  # partial first, regular middle, partial last run, per block
        held = []
        for piece in pieces:
            indices = _full_indices(piece)
            assert torch.equal(_local_view(holding, piece).reshape(-1), full.view(-1)[indices]), f"{where}: {piece}"
            held += indices.tolist()
        assert sorted(held) == sorted(local[lo:hi].tolist()), f"{where}: pieces cover other elements"


def test_a_row_parallel_weight_is_one_strided_piece_and_a_column_parallel_one_a_plain_piece():
    row = ShardSpec((6, 8), 1, 1, 2)  # [out, in] split by input features: 6 runs of 4
    col = ShardSpec((6, 8), 0, 1, 2)
    layout = StateLayout({"row": (6, 4), "col": (3, 8)},
                         whole_tensors([("row", torch.zeros(6, 4)), ("col", torch.zeros(3, 8))], True))
    out = tensor_state_layout(layout, {"row": row, "col": col}, 1)
    assert out.params[0].pieces == [Piece("row", 4, 4, 0, count=6, stride=8)]
    assert out.params[1].pieces == [Piece("col", 24, 24, 0)]
    one = tensor_state_layout(StateLayout({"row": (6, 8)}, whole_tensors([("row", torch.zeros(6, 8))], True)),
                              {"row": ShardSpec((6, 8), 1, 0, 1)}, 0)
    assert one.params[0].pieces == [Piece("row", 0, 48, 0)], "TP = 1: the whole tensor, one plain piece as today"


def test_replicated_keys_are_written_by_tensor_rank_0_only_and_specs_that_do_not_fit_are_named():
    spec = ShardSpec((4, 4), 0, 1, 2)
    layout = StateLayout({"w": (2, 4), "ln": (4,)},
                         whole_tensors([("w", torch.zeros(2, 4)), ("ln", torch.zeros(4))], True))
    out = tensor_state_layout(layout, {"w": spec}, 1)
    assert out.params[1].not_saved == frozenset({"ln"}) and out.params[0].not_saved == frozenset()
    assert "ln" not in pack(out, None)["params"] and "w" in pack(out, None)["params"]
    assert tensor_state_layout(layout, {"w": ShardSpec((4, 4), 0, 0, 2)}, 0).params[1].not_saved == frozenset()
    tied = tensor_state_layout(layout, {"w": spec, "head.w": spec}, 1)  # a tied weight's second name: ignored
    assert [h.pieces for h in tied.params] == [h.pieces for h in out.params] and "head.w" not in tied.shapes
    with pytest.raises(ValueError, match="'w'.*local shape"):
        tensor_state_layout(layout, {"w": ShardSpec((4, 4), 0, 1, 4)}, 1)
    with pytest.raises(ValueError, match="'w'.*tensor rank 1's part, this is tensor rank 0"):
        tensor_state_layout(layout, {"w": spec}, 0)


def test_parameter_specs_names_the_split_parameters_of_a_module():
    module = torch.nn.Sequential(torch.nn.Linear(8, 3), torch.nn.LayerNorm(3))
    spec = ShardSpec((3, 16), 1, 0, 2)
    set_spec(module[0].weight, spec)
    assert parameter_specs(module) == {"0.weight": spec}


# --- (b) round trips between layouts --------------------------------------------------------------

H, V = 8, 16
#: key -> (full shape, split dim, chunks); dim None: replicated
MODEL = {
    "wte.weight": ((V, H), 0, 1),  # vocabulary-parallel: plain pieces
    "qkv.weight": ((3 * H, H), 0, 3),  # fused column-parallel: a plain piece per block
    "qkv.bias": ((3 * H,), 0, 3),
    "ln.weight": ((H,), None, 1),
    "proj.weight": ((H, H), 1, 1),  # row-parallel: strided
    "c_attn.weight": ((H, 3 * H), 1, 3),  # HF Conv1D's fused [in, 3 out]: strided, with gaps in the local tensor
    "down.weight": ((H, 4 * H), 1, 1),
    "down.bias": ((H,), None, 1),
}


def _originals() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    params = {key: torch.randn(shape, generator=g) for key, (shape, _, _) in MODEL.items()}
    moments = {key: torch.randn(shape, generator=g) for key, (shape, _, _) in MODEL.items()}
    return params, moments


def _specs(tensor_rank: int, parts: int) -> dict[str, ShardSpec]:
    return {key: ShardSpec(shape, dim, tensor_rank, parts, chunks)
            for key, (shape, dim, chunks) in MODEL.items() if dim is not None}


class _Rank:
    """A simulated rank at tensor rank `t` of `parts`, data-parallel rank `dp` of `replicas`, holding
    its local tensors `kind`: "whole" (as DDP: replica 0 writes) or "flat" (as FSDP: one flat vector of
    every local tensor, padded, sliced over the replicas, every rank writing its slice)."""

    def __init__(self, t: int, parts: int, dp: int, replicas: int, kind: str,
                 values: tuple[dict, dict] | None) -> None:
        self.specs = _specs(t, parts)
        self.kind, self.dp, self.replicas = kind, dp, replicas
        self.local_shapes = {key: self.specs[key].local_shape if key in self.specs else shape
                             for key, (shape, _, _) in MODEL.items()}
        params, moments = values or ({k: torch.zeros(s) for k, (s, _, _) in MODEL.items()},) * 2

        def local(full: dict) -> dict:
            return {key: shard(v, self.specs[key]) if key in self.specs else v.clone() for key, v in full.items()}

        p_local, m_local = local(params), local(moments)
        for key, spec in self.specs.items():
            set_spec(p_local[key], spec)
        assert {k: s for k, v in p_local.items() if (s := spec_of(v))} == self.specs
        if kind == "whole":
            tensors = [p_local[key].clone() for key in MODEL]
            holdings = whole_tensors(list(zip(MODEL, tensors)), dp == 0)
            moment_of = {id(t_): m_local[key] for key, t_ in zip(MODEL, tensors)}
        else:
            flat_p, flat_m, members = self._flat(p_local), self._flat(m_local), self._members()
            size = flat_p.numel() // replicas
            lo = dp * size
            tensors = [flat_p[lo : lo + size].clone()]
            holdings = [Holding(tensors[0], flat_pieces(members, lo, lo + size))]
            moment_of = {id(tensors[0]): flat_m[lo : lo + size].clone()}
        self.layout = StateLayout(dict(self.local_shapes), holdings, holdings)
        self.optimizer = torch.optim.AdamW(tensors, lr=1e-3)
        if values is not None:
            for tensor in tensors:
                self.optimizer.state[tensor] = {"step": torch.tensor(7.0), "exp_avg": moment_of[id(tensor)],
                                                "exp_avg_sq": moment_of[id(tensor)].abs()}
        self.full_layout = tensor_state_layout(self.layout, self.specs, t)

    def _members(self) -> list[tuple[str, int, int]]:
        members, offset = [], 0
        for key, shape in self.local_shapes.items():
            members.append((key, offset, math.prod(shape)))
            offset += math.prod(shape)
        return members

    def _flat(self, local: dict) -> torch.Tensor:
        flat = torch.cat([local[key].reshape(-1) for key in MODEL])
        return torch.cat([flat, flat.new_zeros(-flat.numel() % self.replicas)])

    def values(self, which: str) -> list[torch.Tensor]:
        state = self.optimizer.state
        return [h.tensor if which == "param" else state[h.tensor][which] for h in self.layout.params]


def _job(parts: int, replicas: int, kind: str, values=None) -> list[_Rank]:
    """Ranks in the mesh's order: the tensor group's ranks consecutive."""
    return [_Rank(rank % parts, parts, rank // parts, replicas, kind, values) for rank in range(parts * replicas)]


def _locals_of(ranks: list[_Rank], t: int, which: str) -> dict[str, torch.Tensor]:
    """Tensor rank `t`'s local tensors, put together from its replicas' holdings."""
    mine = [r for r in ranks if r.specs == _specs(t, len(ranks) // ranks[0].replicas)]
    first = mine[0]
    if first.kind == "whole":
        return {key: v.view(first.local_shapes[key]) for key, v in zip(MODEL, first.values(which))}
    flat = torch.cat([r.values(which)[0] for r in mine])
    return {key: flat[offset : offset + n].view(first.local_shapes[key]) for key, offset, n in first._members()}


def _full_of(ranks: list[_Rank], which: str) -> dict[str, torch.Tensor]:
    parts = len(ranks) // ranks[0].replicas
    per_rank = [_locals_of(ranks, t, which) for t in range(parts)]
    return {key: unshard([p[key] for p in per_rank], _specs(0, parts)[key]) if MODEL[key][1] is not None
            else per_rank[0][key] for key in MODEL}


def _through_a_file(value):
    """As a rank file holds it: saved, and read back weights-only (as `checkpoint.load_file` reads)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _save(ranks: list[_Rank]) -> tuple[list[dict], dict, dict]:
    files = [_through_a_file(pack(r.full_layout, r.optimizer)) for r in ranks]
    index = build_index([summary(f) for f in files], files[0]["param_groups"])
    return files, index, ranks[0].full_layout.shapes


def _load(files, index, shapes, ranks: list[_Rank]) -> list[set[int]]:
    opened = []
    for rank, r in enumerate(ranks):
        check_shapes(shapes, r.full_layout.shapes)
        sources = Sources(lambda k: files[k], rank if rank < len(files) else 0)
        unpack_params(r.full_layout, index, sources)
        unpack_optimizer(r.full_layout, r.optimizer, index, sources)
        opened.append(sources.opened)
    return opened


@pytest.mark.parametrize("saved_kind", ["whole", "flat"])
@pytest.mark.parametrize("parts, replicas, kind", [(1, 1, "whole"), (1, 3, "flat"), (2, 1, "whole"), (2, 3, "flat"),
                                                   (4, 1, "whole"), (4, 2, "flat")])
def test_saved_at_tp2_dp2_loads_at_another_tensor_parallel_size_and_layout(saved_kind, parts, replicas, kind):
    params, moments = _originals()
    files, index, shapes = _save(_job(2, 2, saved_kind, (params, moments)))
    assert any(len(span) == 5 for span in index["params"]["proj.weight"]), "a row-parallel weight is saved strided"

    loaded = _job(parts, replicas, kind)
    _load(files, index, shapes, loaded)

    for which, want in (("param", params), ("exp_avg", moments)):
        got = _full_of(loaded, which)
        for key in MODEL:
            assert torch.equal(got[key], want[key]), f"{which} of '{key}' at TP={parts} x DP={replicas} ({kind})"
    got_sq = _full_of(loaded, "exp_avg_sq")
    assert all(torch.equal(got_sq[key], moments[key].abs()) for key in MODEL)
    assert all(float(r.optimizer.state[t]["step"]) == 7.0 for r in loaded for t in r.optimizer.state)


def test_a_rank_loading_the_layout_it_saved_reads_its_own_file_and_its_tensor_rank_0_peers_only():
    params, moments = _originals()
    files, index, shapes = _save(_job(2, 2, "flat", (params, moments)))
    opened = _load(files, index, shapes, _job(2, 2, "flat"))
    assert opened == [{0}, {1, 0}, {2}, {3, 2}], "replicated keys come from the same replica's tensor rank 0"


def test_a_strided_piece_missing_from_the_checkpoint_is_an_error_naming_it():
    params, moments = _originals()
    files, index, shapes = _save(_job(2, 2, "whole", (params, moments)))
    index["params"]["proj.weight"] = [s for s in index["params"]["proj.weight"] if s[0] != 1]  # tensor rank 1's part
    with pytest.raises(ValueError, match=r"parameter 'proj.weight': 32 elements, the first element 4, are in no rank"):
        _load(files, index, shapes, _job(1, 1, "whole"))


def test_pieces_without_tensor_parallelism_are_saved_exactly_as_before():
    params, _ = _originals()
    files, index, _ = _save(_job(1, 2, "flat", (params, params)))
    assert all(len(entry) == 2 for f in files for entries in f["params"].values() for entry in entries)
    assert all(len(span) == 3 for spans in index["params"].values() for span in spans)


# --- (c) full_tensors over a tensor group ----------------------------------------------------------

def _full_tensors_worker(rank: int, world: int) -> dict[str, torch.Tensor]:
    params, _ = _originals()
    specs = _specs(rank, world)
    local = {key: shard(v, specs[key]) if key in specs else v for key, v in params.items()}
    return full_tensors(local, specs)


def test_full_tensors_gathers_each_split_tensor_over_the_tensor_group():
    params, _ = _originals()
    results = run_distributed(_full_tensors_worker, 2, timeout=120)
    for rank, got in enumerate(results):
        assert list(got) == list(params)
        for key in MODEL:
            assert torch.equal(got[key], params[key]), f"rank {rank}: '{key}'"


def _tied_full_tensors_worker(rank: int, world: int) -> tuple[int, bool]:
    """A tied weight under two keys (GPT's wte.weight / lm_head.weight): one all-gather, one tensor."""
    import torch.distributed as dist

    spec = ShardSpec((8, 3), 0, rank, world)
    weight = shard(torch.arange(24.0).view(8, 3), spec)
    calls = []
    all_gather = dist.all_gather
    dist.all_gather = lambda *args, **kwargs: (calls.append(1), all_gather(*args, **kwargs))[1]
    try:
        # As state_dict() gives them: two detached tensors viewing one parameter.
        got = full_tensors({"wte.weight": weight.detach(), "lm_head.weight": weight.detach()},
                           {"wte.weight": spec, "lm_head.weight": spec})
    finally:
        dist.all_gather = all_gather
    same = got["wte.weight"] is got["lm_head.weight"] and torch.equal(got["wte.weight"], torch.arange(24.0).view(8, 3))
    return len(calls), same


def test_full_tensors_gathers_a_tied_weight_once():
    assert run_distributed(_tied_full_tensors_worker, 2, timeout=60) == [(1, True), (1, True)]

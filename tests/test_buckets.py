"""Bucket assignment: caps, the small first bucket, one dtype per bucket, views without copies."""

from __future__ import annotations

import torch

from distributed_training.comm.bucket import MIB, allocate_buckets, assign_buckets


def _params(*specs):
    return [torch.empty(n, dtype=dtype) for n, dtype in specs]


def test_first_bucket_is_small_and_the_rest_fill_to_the_cap():
    params = _params(*[(MIB // 4, torch.float32)] * 10)  # 1 MiB each
    groups = assign_buckets(params, list(reversed(range(10))), cap_bytes=4 * MIB, first_cap_bytes=1 * MIB)
    assert groups[0] == [9]
    assert groups[1:] == [[8, 7, 6, 5], [4, 3, 2, 1], [0]]


def test_one_dtype_per_bucket_and_oversized_parameters_alone():
    params = _params((10, torch.float32), (10, torch.bfloat16), (MIB, torch.float32), (10, torch.float32))
    groups = assign_buckets(params, [0, 1, 2, 3], cap_bytes=MIB, first_cap_bytes=MIB)
    for g in groups:
        assert len({params[i].dtype for i in g}) == 1
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert [0, 2] in groups  # the 4 MiB parameter closes the float32 bucket it joined
    # Leftover buckets close in the order their last parameter arrives.
    assert groups[-2:] == [[1], [3]]


def test_views_alias_the_flat_buffer():
    params = _params((6, torch.float32), (4, torch.float32))
    params[0] = params[0].view(2, 3)
    (bucket,) = allocate_buckets(params, [[1, 0]])
    assert bucket.buffer.numel() == 10
    assert [tuple(v.shape) for v in bucket.views] == [(4,), (2, 3)]
    bucket.views[1].fill_(2.0)
    assert bucket.buffer[4:].eq(2.0).all() and bucket.buffer[:4].eq(0.0).all()
    assert bucket.views[1].data_ptr() == bucket.buffer[4:].data_ptr()

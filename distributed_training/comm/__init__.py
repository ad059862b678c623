"""Collectives, gradient buckets and bucket reducers."""

from .bucket import Bucket, allocate_buckets, assign_buckets
from .reduce import AllReduceMean, BucketReducer, CompletedWork

__all__ = ["AllReduceMean", "Bucket", "BucketReducer", "CompletedWork", "allocate_buckets", "assign_buckets"]

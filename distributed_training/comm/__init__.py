"""Collectives, gradient buckets and bucket reducers."""

from .bucket import Bucket, allocate_buckets, assign_buckets
from .optimizer import CommunicationOptimizer
from .reduce import AllReduceMean, BucketReducer, CompletedWork

__all__ = ["CommunicationOptimizer", "AllReduceMean", "Bucket", "BucketReducer", "CompletedWork", "allocate_buckets", "assign_buckets"]

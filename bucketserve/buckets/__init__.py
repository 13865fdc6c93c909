"""Sequence-length buckets and batching limits: the TOML config and the bucket arithmetic."""

from bucketserve.buckets.config import (
    POLICIES,
    BucketsConfig,
    ConfigError,
    EmbeddingConfig,
    default_buckets_path,
    load_buckets,
)
from bucketserve.buckets.spec import BucketSpec, PaddingCounter, round_up_batch_size

__all__ = [
    "POLICIES",
    "BucketSpec",
    "BucketsConfig",
    "ConfigError",
    "EmbeddingConfig",
    "PaddingCounter",
    "default_buckets_path",
    "load_buckets",
    "round_up_batch_size",
]

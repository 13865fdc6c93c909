"""Load generation, trace replay, plots and bucket tuning (`bucketserve bench`, `tune-buckets`)."""

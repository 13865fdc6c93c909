"""bucketserve: an LLM/NLP inference server built on sequence-length buckets,
iteration-level scheduling over a paged KV pool, and an OpenAI-compatible API."""

__version__ = "0.1.0"

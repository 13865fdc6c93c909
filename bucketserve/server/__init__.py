"""OpenAI-compatible HTTP server: FastAPI app, protocol models, SSE streaming, /metrics, CLI.

Files, one role each: protocol (wire models), errors (error bodies, handlers, body limit),
prompts (request -> engine jobs), generation (engine streams, aborts), streaming (SSE),
completions / chat (the two endpoints), metrics (Prometheus), context (shared state),
app (routes, auth, lifespan), cli (`bucketserve serve`).
"""

"""The OpenAI-compatible HTTP API on rank 0 of a replica.

server (Server, run_engine: the HTTP server and the engine's loop), app (App: the state request
threads share, and a validated body turned into engine requests), protocol (request bodies as
pydantic models, and the message each invalid field gets), handler (routes), streaming (a
choice's tokens to text pieces: stop strings, logprob entries; the engine thread only queues
tokens), detokenize (incremental detokenization, single tokens' bytes), responses (the answers'
JSON), metrics (the Prometheus collectors), errors (OpenAI's error shape).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights, shardwise.worker.serving
"""

"""The OpenAI-compatible HTTP API on rank 0 of a replica.

server (Server, run_engine: the HTTP server and the engine's loop), connections (accepting,
waiting on idle connections, a bounded pool of request threads, every read with a deadline),
app (App: the state request threads share, and a validated body turned into engine requests),
protocol (request bodies as pydantic models, and the message each invalid field gets), framing
(a body's length checked before it is read, its JSON's depth), auth (API keys), handler
(routes), streaming (a choice's tokens to text pieces: stop strings, logprob entries; the engine
thread only queues tokens), detokenize (incremental detokenization, single tokens' bytes),
responses (the answers' JSON), metrics (the Prometheus collectors), errors (OpenAI's error
shape, and a 500's message).

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights, shardwise.worker.serving
"""

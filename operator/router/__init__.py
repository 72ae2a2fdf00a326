"""The router: a served model's front door, speaking the same OpenAI API as its replicas.

    routing     pure: the replica table, the approximate prefix index of what was routed to each
                replica, and the choice of a replica (longest cached prefix against load, or round robin)
    migration   pure: what a stream has given so far, and the request that continues it elsewhere
    limits      pure: per-key token buckets (429 with Retry-After)
    replicas    the replica set: a list from flags or a file re-read when it changes, active health
                checks of /healthz, passive marking down on a failed connection
    metrics     the router's Prometheus metrics
    proxy       the aiohttp server: API keys, rate limits, hold while no replica is Ready, forwarding,
                and the migration of a stream whose replica fails
    cli         `shardwise router`

It runs from the operator's image: no torch, and it talks only HTTP (no kopf, no kubernetes).

May import: shardwise.crds
Never imports: torch, numpy, kopf, kubernetes
"""

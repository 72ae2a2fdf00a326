"""The worker's commands: `shardwise generate`, `serve`, `train` and `worker` (what one pod runs,
pod.py, with the /healthz and /metrics of a pod that does not serve the API in pod_health.py),
`fetch` (a model from its store into the node-local cache, fetch.py; a pod's own fetch before it
loads, pod_fetch.py; `inspect` of a remote model, inspect.py) and `push` (a model folder to a
registry as an OCI artifact, push.py); the flags they share in flags.py. Their ranks are watched by
worker/distributed/launch.py.

May import: shardwise.crds, shardwise.worker.errors, shardwise.worker.model, shardwise.worker.distributed, shardwise.worker.weights, shardwise.worker.serving, shardwise.worker.training, shardwise.worker.fetch
"""

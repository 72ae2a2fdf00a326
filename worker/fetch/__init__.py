"""Fetching a model from where it lives into the node-local cache, before any weight is loaded: the
interface every remote store answers (remote: what a store lists and how a byte range is read), the
stores behind `s3://`, `hf://` and `oci://`, the node-local cache they fill (atomic, checksummed,
least recently used under a byte budget, shared by the node's pods, filled by several streams at
once), and which files and byte ranges one rank needs of a model (a GGUF stage's ranges kept in a
partial file of the cache: gguf_fill, present).

Nothing here loads a tensor: the probe and a cache pre-pull run it without torch.

May import: shardwise.crds, shardwise.worker.errors
Never imports: torch, kopf, kubernetes
"""

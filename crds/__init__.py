"""The API and the contracts, torch-free: the ShardedModel spec (models) and status (status) on their
base (apimodel), spec.training and its layout rules (training), the ShardPlan (plan), the pod contract (contract), the names labels, annotations and
a pod's environment share (names), the pipeline-schedule rules (schedules), serving capacity
(capacity), speculative decoding's settings (speculative), who may call a served model (access), the API-key file and its
constant-time check that the pods and the router share (apikeys), the router's spec (router),
the rank layout and layer split (layout), a model's shape and size in memory (modelshape),
untrusted JSON parsed with a bound on its nesting (boundedjson), a remote model's spec fields and
rules (sourcespec), a fetching pod's download report (download), and the CRD YAML generated from the
models (schema). The operator image,
the worker image and the CLI all import it, so it needs only pydantic and pyyaml.

May import: nothing outside shardwise.crds
Never imports: torch, torchao, numpy, kopf, kubernetes
"""

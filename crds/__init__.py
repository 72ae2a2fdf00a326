"""The API and the contracts, torch-free: the ShardedModel spec and status (models), the ShardPlan
(plan), the pod contract (contract), the rank layout and layer split (layout), a model's shape and
size in memory (modelshape), and the CRD YAML generated from the models (schema). The operator image,
the worker image and the CLI all import it, so it needs only pydantic and pyyaml.

May import: nothing outside shardwise.crds
Never imports: torch, numpy, kopf, kubernetes
"""

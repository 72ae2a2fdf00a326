"""Rendering, pure: a ShardedModel and its ShardPlan -> the Kubernetes objects that run it (pods,
services, the contract ConfigMap, the disruption budget).

May import: shardwise.crds
Never imports: kopf, kubernetes, prometheus_client
"""

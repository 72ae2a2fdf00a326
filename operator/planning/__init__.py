"""Planning, pure: the topology-aware planner (spec x model facts x nodes -> ShardPlan), the node
inventory it plans on, and groups (which replica groups the operator asks the planner for).

May import: shardwise.crds
Never imports: kopf, kubernetes, prometheus_client
"""

"""What one reconcile pass does, as pure functions of the observed state (no API calls, no clock):
decisions.decide, the recovery state machine, workloads (serving vs training), elastic training
sizes, a serving roll's budgets (rollout), the status after a pass (status, conditions), and the
model-shape probe's pod and result.

May import: shardwise.crds, shardwise.operator.planning, shardwise.operator.render
Never imports: kopf, kubernetes, prometheus_client
"""

"""Observe, act and report: the only part of the operator that does I/O (the API server, kopf,
HTTP reads of pods, leader election, metrics). Each pass: observe.observe -> decide.decisions.decide
-> the applier -> decide.status.build_status (patched) and report.record_metrics. Beside it, per
model with spec.autoscaling, autoscaler.Autoscaler.run: the replicas' /metrics -> decide.autoscaling
-> the scale subresource and status.autoscaling; and inferencepool.POOLS, the model's InferencePool
when the cluster serves that API; and routers.ROUTERS, the model's router (spec.serving.router)
with its replicas file kept current.

May import: shardwise.crds, shardwise.operator.decide, shardwise.operator.planning, shardwise.operator.render
"""

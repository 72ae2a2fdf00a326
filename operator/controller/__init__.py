"""Observe, act and report: the only part of the operator that does I/O (the API server, kopf,
HTTP reads of pods, leader election, metrics). Each pass: observe.observe -> decide.decisions.decide
-> the applier -> decide.status.build_status (patched) and report.record_metrics.

May import: shardwise.crds, shardwise.operator.decide, shardwise.operator.planning, shardwise.operator.render
"""

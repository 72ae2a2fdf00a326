"""The operator: kopf handlers and a reconcile loop per ShardedModel, in four rooms.

    controller/  observe -> (decide) -> act -> report: kopf handlers, the reconciler, observe, the
                 applier (the only module that talks to the API server), report (metrics of a pass),
                 leader election, metrics
    decide/      pure: decide() for one pass, recovery, workloads, elastic training, the status
                 after a pass, the model-shape probe's pod and result
    planning/    pure: the topology-aware planner, the node inventory, the groups asked of the planner
    render/      pure: the Kubernetes objects that run a ShardedModel
    cli/         `shardwise operator run` and `shardwise plan`

May import: shardwise.crds
Never imports: torch, torchao, numpy
"""

{{/*
The operator's permissions, one rule per kind of object, each with only the verbs the operator's code
calls. Kept apart from rbac.yaml so that the test of the verbs reads one list.
*/}}

{{/* Cluster-scoped reads: the node inventory the planner places shards on. */}}
{{- define "shardwise.clusterRules" -}}
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get", "list", "watch"]
{{- end }}

{{/* What the operator reads and writes in the namespaces it watches. */}}
{{- define "shardwise.namespacedRules" -}}
# The ShardedModels themselves: watched, annotated with the operator's progress, finalized.
- apiGroups: ["shardwise.dev"]
  resources: ["shardedmodels"]
  verbs: ["get", "list", "watch", "patch"]
# Phase, conditions, plan and ready shards are written to the status subresource.
- apiGroups: ["shardwise.dev"]
  resources: ["shardedmodels/status"]
  verbs: ["get", "patch"]
# The operator reads the scale subresource's view of the replicas (HPA and `kubectl scale` write it).
- apiGroups: ["shardwise.dev"]
  resources: ["shardedmodels/scale"]
  verbs: ["get"]
# What one ShardedModel becomes: worker pods, the rendezvous and serving Services, the plan ConfigMap.
- apiGroups: [""]
  resources: ["pods", "services", "configmaps"]
  verbs: ["create", "get", "list", "watch", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "get", "list", "watch", "patch", "delete"]
# An Event on every phase transition.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* Leader election: one Lease in the release namespace. */}}
{{- define "shardwise.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch", "create", "update", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
The operator's permissions, each verb one the operator's code (or kopf on its behalf) calls; nothing
else. tests/deploy/test_chart.py compares these with the calls in operator/, and
tests/e2e/test_chart_install.py runs the operator as this ServiceAccount against a live API server.
*/}}

{{/* Cluster-scoped: the node inventory and kopf's discovery of resources (and namespaces). */}}
{{- define "shardwise.clusterRules" -}}
# The planner's inventory: GPUs, GPU memory, topology labels, readiness (a watch feeds it).
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
# kopf finds the ShardedModel resource, and notices CRD upgrades, by watching CRDs (read-only).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.operator.watchNamespaces }}
# kopf serves the listed namespaces as they come and go.
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/* What the operator reads and writes in the namespaces it watches. */}}
{{- define "shardwise.namespacedRules" -}}
# The ShardedModels: watched, and read at the start of each reconcile. No finalizer and no
# annotations of the operator's: deleting a model never waits for the operator.
- apiGroups: ["shardwise.dev"]
  resources: ["shardedmodels"]
  verbs: ["get", "list", "watch"]
# Phase, conditions, plan, groups and ready shards: merge-patched into the status subresource.
- apiGroups: ["shardwise.dev"]
  resources: ["shardedmodels/status"]
  verbs: ["patch"]
# The autoscaler (spec.autoscaling) sets replicas through the scale subresource, as kubectl scale does.
- apiGroups: ["shardwise.dev"]
  resources: ["shardedmodels/scale"]
  verbs: ["patch"]
# A serving model's InferencePool, when the cluster has the Gateway API Inference Extension's CRD:
# applied and read back like the Services (whether the API is served is asked of discovery, which
# needs no rule).
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "create", "patch"]
# Worker pods: watched (failures, readiness, GPUs in use), created per replica group, torn down as a
# group (the pods with its labels that the model owns, one by one) or when their node is lost. A
# router pod's one annotation is patched when its replicas file changes (its kubelet then mounts the
# new file at once).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "patch", "delete"]
# The rendezvous and serving Services, the plan ConfigMap and the PodDisruptionBudget: server-side
# apply: a patch, which the API server also authorizes as a create when the object is missing. Each
# is read first: one that exists without the model's ownerReference is not taken over. The plan
# ConfigMap is also where the plan is stored: each pass reads it back.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The plan ConfigMap, and a router's replicas file (spec.serving.router), deleted with the router
# when it is turned off.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch", "delete"]
# A model's router (spec.serving.router): its Deployment applied, read back and deleted when turned off.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch"]
# Each model's NetworkPolicy (operator.networkPolicy), applied and read back the same way (a
# router's deleted when it is turned off).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
# An Event on every phase transition (kopf posts core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* Leader election between operator replicas: read, take and renew one Lease. */}}
{{- define "shardwise.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "create", "update"]
{{- end }}

"""The names objects and pods carry between the operator and the worker: labels, annotations, the
pod contract's file, the environment a worker pod is started with. One definition each, torch-free,
so the operator, the worker and the local cluster can all import it.
"""
from __future__ import annotations

# --- labels of the objects the operator makes (pods, services, the contract's ConfigMap) ---------
LABEL_MODEL = "shardwise.dev/model"            # the ShardedModel's name: every object of the model
LABEL_REPLICA = "shardwise.dev/replica"        # a worker pod's replica group
LABEL_STAGE = "shardwise.dev/stage"            # a worker pod's pipeline stage
LABEL_ATTEMPT = "shardwise.dev/attempt"        # the incarnation of the pod's replica group
LABEL_PLAN_HASH = "shardwise.dev/plan-hash"    # hash of the replica's placements
LABEL_SPEC_HASH = "shardwise.dev/spec-hash"    # hash of what the pod was made from
LABEL_ROLE = "shardwise.dev/role"              # a pod that is not a worker (the model-shape probe)
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_APP_NAME = "app.kubernetes.io/name"
LABEL_APP_INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "shardwise"

# --- annotations -----------------------------------------------------------------------------------
ANNOTATION_PLANNED_NODE = "shardwise.dev/planned-node"   # where the plan put a pod not bound yet
ANNOTATION_LAYERS = "shardwise.dev/layers"               # a worker pod's decoder layers, first-end
ANNOTATION_PLAN_HASH = "shardwise.dev/plan-hash"         # the contract ConfigMap's whole plan
# prefix of kopf's own bookkeeping annotations on a ShardedModel
KOPF_ANNOTATION_PREFIX = "operator.shardwise.dev"

# --- node labels -----------------------------------------------------------------------------------
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"     # MiB, as GPU feature discovery writes it
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
RACK_LABEL = "topology.shardwise.dev/rack"
ZONE_LABEL = "topology.kubernetes.io/zone"

# --- the pod contract (crds/contract.py), as a worker pod sees it ---------------------------------
CONTRACT_FILE = "contract.json"     # the ConfigMap's key, and the file name in the pod
CONTRACT_MOUNT = "/etc/shardwise"   # where the ConfigMap is mounted
CONTRACT_PATH = f"{CONTRACT_MOUNT}/{CONTRACT_FILE}"

# --- a worker pod's environment: all that differs between the pods sharing one contract -----------
ENV_REPLICA = "SHARDWISE_REPLICA"
ENV_STAGE = "SHARDWISE_STAGE"
ENV_MASTER_ADDR = "MASTER_ADDR"     # the torch.distributed rendezvous (the world's stage-0 pod)
ENV_MASTER_PORT = "MASTER_PORT"
ENV_POD_IP = "POD_IP"
ENV_NODE_NAME = "NODE_NAME"

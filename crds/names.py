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
LABEL_ROUTER = "shardwise.dev/router"          # a router pod of the model named (not LABEL_MODEL: not a worker)
LABEL_ROLE = "shardwise.dev/role"              # a pod that is not a worker (the model-shape probe)
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_APP_NAME = "app.kubernetes.io/name"
LABEL_APP_INSTANCE = "app.kubernetes.io/instance"
MANAGED_BY = "shardwise"

# --- annotations -----------------------------------------------------------------------------------
ANNOTATION_PLANNED_NODE = "shardwise.dev/planned-node"   # where the plan put a pod not bound yet
ANNOTATION_LAYERS = "shardwise.dev/layers"               # a worker pod's decoder layers, first-end
ANNOTATION_PLAN_HASH = "shardwise.dev/plan-hash"         # the contract ConfigMap's whole plan
# on a router pod: the digest of its replicas file as the operator last wrote it (a pod update makes
# the kubelet refresh the pod's ConfigMap volumes at once, not at its next periodic sync)
ANNOTATION_ROUTER_REPLICAS = "shardwise.dev/router-replicas"
# prefix of kopf's own bookkeeping annotations on a ShardedModel
KOPF_ANNOTATION_PREFIX = "operator.shardwise.dev"

# --- node labels -----------------------------------------------------------------------------------
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"     # MiB, as GPU feature discovery writes it
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
RACK_LABEL = "topology.shardwise.dev/rack"
ZONE_LABEL = "topology.kubernetes.io/zone"

# --- the pod contract (crds/contract.py), as a worker pod sees it ---------------------------------
# The ConfigMap's binaryData key, and the file name in the pod: the contract as gzip-compressed
# compact JSON. Compressed because the plan inside lists every placement, and a ConfigMap holds at
# most 1 MiB: 10,000 replicas of 4 stages are 5.8 MB of compact JSON, about 0.2 MB gzipped.
CONTRACT_FILE = "contract.json.gz"
CONTRACT_MOUNT = "/etc/shardwise"   # where the ConfigMap is mounted
CONTRACT_PATH = f"{CONTRACT_MOUNT}/{CONTRACT_FILE}"
# spec.serving.auth.secretRef's key, mounted read-only in a serving pod and passed as --api-key-file
API_KEYS_MOUNT = "/var/run/shardwise/api-keys"
API_KEYS_PATH = f"{API_KEYS_MOUNT}/keys"
DEFAULT_API_KEYS_KEY = "api-keys"   # the Secret's key when secretRef names none

# --- the local checkpoint tier (spec.checkpoint.local) ---------------------------------------------
# The node directory the operator allows by default (`operator run --local-checkpoint-root`), and
# spec.checkpoint.local.hostPath's default.
LOCAL_CHECKPOINT_ROOT = "/var/lib/shardwise/checkpoints"
# The worker image's group (docker/worker.Dockerfile): a supplemental group of pods with a local tier,
# which the tier's directory is handed to, so a worker of any non-root uid can write it.
WORKER_GID = 10001

# --- the serving metrics the operator's autoscaler reads (worker/serving/http/metrics.py exports) --
# The Gateway API Inference Extension's model-server protocol (kubernetes-sigs/
# gateway-api-inference-extension, docs/proposals/003-model-server-protocol/README.md): the metrics an
# endpoint picker scrapes, named as vLLM names them (the reference picker's defaults). KV-cache use is
# a 0-1 ratio under both names vLLM has used for it (gpu_cache_usage_perc, later kv_cache_usage_perc).
METRIC_QUEUED = "vllm:num_requests_waiting"
METRIC_RUNNING = "vllm:num_requests_running"
METRIC_KV_CACHE = ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")
METRIC_LORA = "vllm:lora_requests_info"
METRIC_TTFT = "shardwise_time_to_first_token_seconds"     # a histogram, by endpoint
# a router's requests waiting now for a Ready replica (the autoscaler's signal to scale from zero)
METRIC_ROUTER_HELD = "shardwise_router_held_requests"

# --- a worker pod's environment: all that differs between the pods sharing one contract -----------
ENV_REPLICA = "SHARDWISE_REPLICA"
ENV_STAGE = "SHARDWISE_STAGE"
ENV_MASTER_ADDR = "MASTER_ADDR"     # the torch.distributed rendezvous (the world's stage-0 pod)
ENV_MASTER_PORT = "MASTER_PORT"
ENV_POD_IP = "POD_IP"
ENV_NODE_NAME = "NODE_NAME"

# --- the names of the objects a ShardedModel makes ------------------------------------------------
# Every object the operator makes is named from the model's name; the API server refuses a model
# whose name would make any of them invalid (MAX_MODEL_NAME, MODEL_NAME_PATTERN: CEL rules on the
# CRD's root), so a bad name ends in a refusal at `kubectl apply`, not in a pass that fails forever.
MAX_REPLICAS = 10000         # spec.parallelism.replicas at most: replica numbers 0..9999
MAX_PIPELINE = 512           # pipeline stages at most (spec.parallelism.pipeline, or the planner's)
MAX_ATTEMPTS = 10**9         # a group's incarnations: far more than any pod will ever reach
DNS_LABEL_MAX = 63           # a Service's name, a pod's hostname, a label's value
DNS_SUBDOMAIN_MAX = 253      # a pod's or a ConfigMap's name
# DNS-1035 label: a Service's name must be one, and the model's name is its serving Service's name
MODEL_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


def hostname(model: str, replica: int, stage: int) -> str:
    """A worker pod's hostname (its DNS name under the headless Service): a DNS label."""
    return f"{model}-r{replica}-s{stage}"


def pod_name(model: str, replica: int, stage: int, attempt: int) -> str:
    return f"{hostname(model, replica, stage)}-a{attempt}"


def headless_service_name(model: str) -> str:
    return f"{model}-ranks"


def serving_service_name(model: str) -> str:
    return model


def configmap_name(model: str) -> str:
    return f"{model}-plan"


def pdb_name(model: str) -> str:
    return model


def network_policy_name(model: str) -> str:
    return model


def router_name(model: str) -> str:
    """The router's Deployment, its replicas-file ConfigMap and its NetworkPolicy."""
    return f"{model}-router"


def probe_pod_name(model: str, digest: str) -> str:
    """The model-shape probe's pod; `digest` is 8 hex digits of its uri."""
    return f"{model}-probe-{digest}"


def prepull_pod_name(model: str, replica: int, digest: str) -> str:
    """A pre-pull pod (spec.model.prePull): one per replica group's node; `digest` is 8 hex digits
    of the node's name and the group's attempt."""
    return f"{model}-r{replica}-pull-{digest}"


def _longest_model_name() -> int:
    """The longest model name whose every derived name stays within its limit: each name pattern
    applied to "" with the largest replica, stage and attempt gives what it adds to the name."""
    last_replica, last_stage = MAX_REPLICAS - 1, MAX_PIPELINE - 1
    added = [  # (characters a pattern adds, the limit of the name it makes)
        (len(hostname("", last_replica, last_stage)), DNS_LABEL_MAX),
        (len(pod_name("", last_replica, last_stage, MAX_ATTEMPTS)), DNS_SUBDOMAIN_MAX),
        (len(headless_service_name("")), DNS_LABEL_MAX),
        (len(serving_service_name("")), DNS_LABEL_MAX),
        (len(configmap_name("")), DNS_SUBDOMAIN_MAX),
        (len(pdb_name("")), DNS_SUBDOMAIN_MAX),
        (len(network_policy_name("")), DNS_SUBDOMAIN_MAX),
        (len(probe_pod_name("", "0" * 8)), DNS_SUBDOMAIN_MAX),
        (len(prepull_pod_name("", last_replica, "0" * 8)), DNS_SUBDOMAIN_MAX),
        (0, DNS_LABEL_MAX),  # the model's label (LABEL_MODEL, LABEL_APP_INSTANCE) carries the name
    ]
    return min(limit - extra for extra, limit in added)


MAX_MODEL_NAME = _longest_model_name()


# --- models fetched from where they live (spec.model.uri hf://, s3://, oci://) ---------------------
# The Secret spec.model.credentialsRef names is given to the pods key by key, each key as the
# environment variable of the same name, and only these keys (valueFrom.secretKeyRef, optional):
# never envFrom, whose keys would be whatever the Secret holds (LD_PRELOAD, PATH). The stores read
# exactly these variables; the operator never reads the Secret.
ENV_AWS_ACCESS_KEY_ID = "AWS_ACCESS_KEY_ID"
ENV_AWS_SECRET_ACCESS_KEY = "AWS_SECRET_ACCESS_KEY"
ENV_AWS_SESSION_TOKEN = "AWS_SESSION_TOKEN"
ENV_HF_TOKEN = "HF_TOKEN"
ENV_OCI_USERNAME = "OCI_USERNAME"
ENV_OCI_PASSWORD = "OCI_PASSWORD"
# `shardwise inspect` (the model-shape probe) exits with this status when the store could not be
# reached or was busy (sysexits' EX_TEMPFAIL), and with 2 when its answer is final (refused, not
# found, not a model): the operator probes again later after the first, and fails the spec after the
# second.
EXIT_UNREACHABLE = 75
# scheme (the uri's prefix before "://") -> the Secret keys its pods get
CREDENTIAL_ENV: dict[str, tuple[str, ...]] = {
    "s3": (ENV_AWS_ACCESS_KEY_ID, ENV_AWS_SECRET_ACCESS_KEY, ENV_AWS_SESSION_TOKEN),
    "hf": (ENV_HF_TOKEN,),
    "oci": (ENV_OCI_USERNAME, ENV_OCI_PASSWORD),
}
# spec.checkpoint.credentialsRef's keys (the s3 ones) reach a training pod under this prefix
# (CHECKPOINT_AWS_ACCESS_KEY_ID, ...), so that a model fetched from one S3 store and checkpoints
# kept in another each get their own credentials in one pod.
CHECKPOINT_CREDENTIAL_PREFIX = "CHECKPOINT_"
# The node-local model cache: the node directory the chart names by default (`operator run
# --model-cache-host-path`, the chart's operator.modelCache.hostPath), and where a pod sees its
# namespace's part of it (the contract's source.cache_dir).
MODEL_CACHE_ROOT = "/var/lib/shardwise/model-cache"
MODEL_CACHE_MOUNT = "/var/cache/shardwise/models"
MODEL_CACHE_BUDGET = 200 << 30   # bytes the cache keeps on a node by default (least recently used out)
# Reads in flight at once while a pod fetches its files (spec.model.fetchStreams, `shardwise fetch
# --streams`): the default, and the most a spec or a command may ask (each store's client keeps that
# many connections).
FETCH_STREAMS = 8
MAX_FETCH_STREAMS = 32
# A fetching pod's download progress (crds/download.py DownloadReport): served as JSON on its http
# port at this path while it fetches.
DOWNLOAD_PROGRESS_PATH = "/download"

# --- gradient compression between replicate groups (spec.training.gradientCompression, --compression) ---
COMPRESSION_METHODS = ("none", "int8", "int4", "topk", "topk-int4", "powersgd")
POWERSGD_DEFAULT_RANK = 8      # rank of each gradient matrix's approximation: the smallest that kept the loss (docs/training.md)
POWERSGD_MAX_RANK = 256


# --- where a pod's server listens (the worker's and the router's) ----------------------------------
def bind_address(pod_ip: str) -> str:
    """The address a pod's server listens on. A pod in its own network namespace listens on every
    address: the Service reaches it on its IP and `kubectl port-forward` on localhost inside the pod.
    Pods of local nodes share the host's network, each with a loopback address of its own, so they
    bind that one."""
    return pod_ip if pod_ip.startswith("127.") else "0.0.0.0"

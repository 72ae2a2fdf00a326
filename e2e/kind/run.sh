#!/usr/bin/env bash
# End-to-end on kind: build and load the images, install the chart, run the SmolLM2 demo ShardedModel
# (TP=3 x PP=2 on fake GPUs, ranks on CPU), ask it for a completion, stop the Docker container of a node
# that holds a shard, and check that the model is Ready and answering again on the other nodes.
#
#   e2e/kind/run.sh                 # everything, then delete the cluster
#   KEEP_CLUSTER=1 e2e/kind/run.sh  # leave the cluster up afterwards (reused by the next run)
#   SKIP_BUILD=1 e2e/kind/run.sh    # reuse images built earlier
#
# Needs: docker, kind (>= 0.20), kubectl, helm, curl, python3. Takes about 10 minutes, most of it the worker image.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CLUSTER="${CLUSTER:-shardwise}"
NAMESPACE="${NAMESPACE:-shardwise-system}"
MODEL_NS="${MODEL_NS:-default}"
TAG="${TAG:-e2e}"
OPERATOR_IMAGE="shardwise/operator:${TAG}"
WORKER_IMAGE="shardwise/worker:${TAG}-cpu"
FAKE_GPUS="${FAKE_GPUS:-4}"
MODEL="smollm2-demo"
MANIFEST="$ROOT/examples/smollm2-demo.yaml"
READY_TIMEOUT="${READY_TIMEOUT:-900}"
KCTX="kind-$CLUSTER"

say() { printf '\n== %s\n' "$*"; }
die() { printf 'e2e/kind: %s\n' "$*" >&2; exit 1; }
k() { kubectl --context "$KCTX" "$@"; }

for tool in docker kind kubectl helm curl python3; do
  command -v "$tool" >/dev/null || die "$tool: not found on PATH"
done

PF_PID=""
cleanup() {
  rc=$?
  [ -n "$PF_PID" ] && kill "$PF_PID" 2>/dev/null || true
  if [ "$rc" -ne 0 ]; then
    printf '\n== failed (exit %s); state of the cluster:\n' "$rc" >&2
    k get nodes -o wide >&2 || true
    k -n "$MODEL_NS" get sm,pods,svc -o wide >&2 || true
    k -n "$MODEL_NS" describe sm "$MODEL" >&2 || true
    k -n "$NAMESPACE" logs deployment/shardwise --tail=100 >&2 || true
  fi
  if [ -z "${KEEP_CLUSTER:-}" ]; then
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  exit "$rc"
}
trap cleanup EXIT

# --- cluster ----------------------------------------------------------------------------------------
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  say "reusing kind cluster $CLUSTER"
else
  say "creating kind cluster $CLUSTER (1 control plane, 4 GPU-like workers in 2 racks)"
  kind create cluster --name "$CLUSTER" --config "$ROOT/e2e/kind/kind-config.yaml" --wait 180s
fi

# kind has no GPUs and no device plugin: advertise fake nvidia.com/gpu capacity on every worker, so the
# scheduler places GPU-asking pods exactly as on a GPU cluster. The kubelet keeps extended resources it
# did not register itself; re-run after a node is recreated.
advertise_gpus() {
  local node
  for node in $(k get nodes -l nvidia.com/gpu.present=true -o name); do
    k patch "$node" --subresource=status --type=json \
      -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$FAKE_GPUS\"}]" >/dev/null
  done
}
say "advertising $FAKE_GPUS fake nvidia.com/gpu per worker"
advertise_gpus
k get nodes -L topology.shardwise.dev/rack,nvidia.com/gpu.clique \
  -o custom-columns='NODE:.metadata.name,GPUS:.status.allocatable.nvidia\.com/gpu,RACK:.metadata.labels.topology\.shardwise\.dev/rack,CLIQUE:.metadata.labels.nvidia\.com/gpu\.clique'

# --- images -----------------------------------------------------------------------------------------
if [ -z "${SKIP_BUILD:-}" ]; then
  say "building $OPERATOR_IMAGE"
  docker build -f "$ROOT/docker/operator.Dockerfile" -t "$OPERATOR_IMAGE" "$ROOT"
  say "building $WORKER_IMAGE (CPU torch, SmolLM2 baked in)"
  docker build -f "$ROOT/docker/worker.Dockerfile" --build-arg VARIANT=cpu --build-arg DEMO_MODEL=true \
    -t "$WORKER_IMAGE" "$ROOT"
fi
say "loading images into the kind nodes"
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$WORKER_IMAGE"

# --- chart ------------------------------------------------------------------------------------------
say "installing the chart into $NAMESPACE"
helm --kube-context "$KCTX" upgrade --install shardwise "$ROOT/charts/shardwise" \
  --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="$TAG" --set image.pullPolicy=Never \
  --set operator.workerImage="$WORKER_IMAGE" \
  --wait --timeout 5m
k wait --for=condition=Established crd/shardedmodels.shardwise.dev --timeout=60s
k -n "$NAMESPACE" rollout status deployment/shardwise --timeout=180s

# --- the model --------------------------------------------------------------------------------------
phase() { k -n "$MODEL_NS" get sm "$MODEL" -o jsonpath='{.status.phase}' 2>/dev/null || true; }

wait_ready() {  # wait_ready <what> : polls the phase and prints each change
  local start=$SECONDS last="" now
  while :; do
    now="$(phase)"
    if [ "$now" != "$last" ]; then
      printf '  %4ss  phase=%s\n' "$((SECONDS - start))" "${now:-<none>}"
      last="$now"
    fi
    [ "$now" = Ready ] && return 0
    [ "$now" = Failed ] && die "$MODEL went Failed while waiting for $1"
    [ $((SECONDS - start)) -ge "$READY_TIMEOUT" ] && die "$MODEL not Ready after ${READY_TIMEOUT}s ($1)"
    sleep 5
  done
}

complete() {  # asks the serving Service for a completion through a port-forward, prints the text
  local port=18000 out
  k -n "$MODEL_NS" port-forward "svc/$MODEL" "$port:8000" >/dev/null 2>&1 &
  PF_PID=$!
  for _ in $(seq 30); do curl -fs "localhost:$port/healthz" >/dev/null 2>&1 && break; sleep 1; done
  out="$(curl -fsS "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}')" \
    || die "the completion request failed"
  kill "$PF_PID" 2>/dev/null || true; wait "$PF_PID" 2>/dev/null || true; PF_PID=""
  printf '%s\n' "$out"
  printf '%s' "$out" | grep -q '"text"' || die "the answer has no completion text"
}

say "applying $MANIFEST"
k -n "$MODEL_NS" apply -f "$MANIFEST"
wait_ready "first start"
k -n "$MODEL_NS" get sm "$MODEL"
k -n "$MODEL_NS" get pods -l "shardwise.dev/model=$MODEL" -o wide
say "completion"
complete

# --- chaos: lose a node -----------------------------------------------------------------------------
victim="$(k -n "$MODEL_NS" get pods -l "shardwise.dev/model=$MODEL,shardwise.dev/stage=1" \
  -o jsonpath='{.items[0].spec.nodeName}')"
[ -n "$victim" ] || die "no pod of stage 1 found to take down"
restarts_before="$(k -n "$MODEL_NS" get sm "$MODEL" -o jsonpath='{.status.restarts}')"
say "stopping node $victim (docker stop), which holds stage 1"
docker stop "$victim" >/dev/null
start=$SECONDS
# The node goes NotReady after the node-monitor grace period (about 40-50 s); the operator then marks
# the replica Recovering and re-plans it on the nodes left.
while [ "$(phase)" = Ready ] && [ $((SECONDS - start)) -lt 180 ]; do sleep 2; done
[ "$(phase)" != Ready ] || die "$MODEL still Ready 180 s after its node stopped"
printf '  %ss  phase=%s\n' "$((SECONDS - start))" "$(phase)"
wait_ready "recovery"
printf '  recovered %ss after the node stopped\n' "$((SECONDS - start))"
k -n "$MODEL_NS" get pods -l "shardwise.dev/model=$MODEL" -o wide
on_victim="$(k -n "$MODEL_NS" get pods -l "shardwise.dev/model=$MODEL" \
  --field-selector "spec.nodeName=$victim,status.phase!=Failed" -o name | grep -c . || true)"
restarts_after="$(k -n "$MODEL_NS" get sm "$MODEL" -o jsonpath='{.status.restarts}')"
# Pods on the stopped node may linger as Terminating until it returns; the live group must be elsewhere.
ready_elsewhere="$(k -n "$MODEL_NS" get pods -l "shardwise.dev/model=$MODEL" -o json \
  | python3 -c "import json,sys; v=sys.argv[1]; print(sum(1 for p in json.load(sys.stdin)['items'] if p['spec'].get('nodeName')!=v and any(c['type']=='Ready' and c['status']=='True' for c in p['status'].get('conditions',[]))))" "$victim")"
[ "$ready_elsewhere" -ge 2 ] || die "expected the recovered group's 2 stages Ready on other nodes, found $ready_elsewhere"
[ "${restarts_after:-0}" -gt "${restarts_before:-0}" ] || die "status.restarts did not grow ($restarts_before -> $restarts_after)"
echo "  pods still bound to $victim (terminating): $on_victim; restarts $restarts_before -> $restarts_after"
say "completion after recovery"
complete

say "bringing $victim back"
docker start "$victim" >/dev/null
advertise_gpus
say "kind e2e passed"

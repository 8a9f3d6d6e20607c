#!/usr/bin/env bash
# End to end on a real Kubernetes cluster (kind, in Docker): from nothing to a self-healing PD
# deployment, then a wedge on purpose and the operator's answer to it.
#
#   1. create a kind cluster (or reuse one), build both images, load them into the nodes;
#   2. `helm install` the chart (CRD + operator), `kubectl apply` tests/e2e/tiny-cpu.yaml
#      (the tiny model on CPU: one prefill, one decode, one router);
#   3. wait for Available, send a completion through the router;
#   4. wedge it: disable the PD deadlines on both engines and stall the next KV transfer on
#      prefill (fault injection), send a request that now hangs in prefill's inflight queue;
#   5. assert the operator captured evidence (a ConfigMap labelled serving.dsv4.dev/evidence=true),
#      posted Events, and restarted the wedged prefill pod; then that traffic recovers.
#
# Needs: docker (with a daemon), kind, and helm/kubectl (scripts/get-tools.sh fetches those two).
# Run from anywhere:  bash tests/e2e/kind.sh      (or: python -m pytest -m e2e tests/e2e)
# Environment:
#   DSV4_E2E_CLUSTER=dsv4-e2e   kind cluster name (created if missing)
#   DSV4_E2E_KEEP=1             keep the cluster afterwards (default: delete it if we created it)
#   DSV4_E2E_SKIP_BUILD=1       use images already built (dsv4-operator:e2e, dsv4-engine:e2e-tiny)
#   DSV4_E2E_READY_TIMEOUT=900s how long the engines may take to become ready
#   DSV4_E2E_NODE_IMAGE=        kind node image, to pick the Kubernetes release (supported: 1.29 to
#                               1.33, e.g. kindest/node:v1.29.14); default: kind's own
# Exit status: 0 passed, 1 failed (cluster state is printed), 2 a prerequisite is missing.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
export PATH="$REPO/.tools/bin:$PATH"

CLUSTER="${DSV4_E2E_CLUSTER:-dsv4-e2e}"
CONTEXT="kind-$CLUSTER"
KEEP="${DSV4_E2E_KEEP:-0}"
READY_TIMEOUT="${DSV4_E2E_READY_TIMEOUT:-900s}"
OP_NS=dsv4-system
NS=dsv4-e2e
NAME=tiny  # metadata.name in tests/e2e/tiny-cpu.yaml
OP_IMAGE=dsv4-operator:e2e
ENGINE_IMAGE=dsv4-engine:e2e-tiny
ROUTER_PORT=18000
PREFILL_PORT=18100
DECODE_PORT=18101
WORK="$(mktemp -d)"
CREATED_CLUSTER=0
PF_PIDS=()

log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
k() { kubectl --context "$CONTEXT" "$@"; }

missing() { echo "kind.sh: $*" >&2; exit 2; }
command -v docker >/dev/null || missing "docker is not on PATH"
docker info >/dev/null 2>&1 || missing "no Docker daemon answers (docker info failed)"
command -v kind >/dev/null || missing "kind is not on PATH (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
if ! command -v helm >/dev/null || ! command -v kubectl >/dev/null; then
  bash scripts/get-tools.sh >/dev/null || true
fi
command -v helm >/dev/null || missing "helm is not on PATH and scripts/get-tools.sh could not fetch it"
command -v kubectl >/dev/null || missing "kubectl is not on PATH and scripts/get-tools.sh could not fetch it"

dump_state() {
  log "cluster state for the post-mortem:"
  k get dsv4d,all,configmaps -A -o wide 2>&1 | grep -v "^kube-system" || true
  k -n "$NS" get events --sort-by=.lastTimestamp 2>&1 | tail -40 || true
  k -n "$NS" describe dsv4d "$NAME" 2>&1 | tail -40 || true
  k -n "$OP_NS" logs deployment/dsv4-operator --tail=80 2>&1 || true
  for pod in $(k -n "$NS" get pods -o name 2>/dev/null); do
    echo "--- $pod"; k -n "$NS" logs "$pod" --tail=30 2>&1 || true
  done
}

cleanup() {
  local rc=$?
  for pid in "${PF_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 2 ]; then dump_state; fi
  if [ "$CREATED_CLUSTER" = 1 ] && [ "$KEEP" != 1 ]; then
    log "deleting kind cluster $CLUSTER"
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  rm -rf "$WORK"
  exit "$rc"
}
trap cleanup EXIT

fail() { log "FAIL: $*"; exit 1; }

# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 2 s until it succeeds.
wait_for() {
  local limit=$1 what=$2 start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ $((SECONDS - start)) -lt "$limit" ] || fail "timed out after ${limit}s waiting for $what"
    sleep 2
  done
  log "ok: $what ($((SECONDS - start))s)"
}

# port_forward TARGET LOCAL REMOTE: a kubectl port-forward in the background, ready when it returns.
port_forward() {
  k -n "$NS" port-forward "$1" "$2:$3" >"$WORK/pf-$2.log" 2>&1 &
  PF_PIDS+=($!)
  wait_for 30 "port-forward to $1 on 127.0.0.1:$2" curl -sf "http://127.0.0.1:$2/health"
}

# completion PORT [NAME]: one greedy completion; succeeds when the answer is 200 with a choice in it.
completion() {
  local code out="$WORK/completion-${2:-last}.json"
  code="$(curl -sS --max-time 120 -o "$out" -w '%{http_code}' \
    -H 'Content-Type: application/json' "http://127.0.0.1:$1/v1/completions" \
    -d "{\"model\": \"$NAME\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 8, \"temperature\": 0}")" || return 1
  [ "$code" = 200 ] && grep -q '"choices"' "$out"
}

arm() {  # arm PORT FAULT COUNT
  curl -sf -X POST "http://127.0.0.1:$1/admin/faults" -H 'Content-Type: application/json' \
    -d "{\"fault\": \"$2\", \"count\": $3}" >/dev/null || fail "could not arm $2 on 127.0.0.1:$1"
}

evidence_captured() { [ -n "$(k -n "$NS" get configmaps -l serving.dsv4.dev/evidence=true -o name)" ]; }
pod_uid() { k -n "$NS" get pod "$1" -o jsonpath='{.metadata.uid}' 2>/dev/null; }
replaced() { local uid; uid="$(pod_uid "$1")"; [ -n "$uid" ] && [ "$uid" != "$2" ]; }
available() {
  [ "$(k -n "$NS" get dsv4d "$NAME" -o jsonpath='{.status.conditions[?(@.type=="Available")].status}')" = True ]
}
event_posted() {  # event_posted REASON
  k -n "$NS" get events -o jsonpath='{range .items[*]}{.reason}{"\n"}{end}' | grep -qx "$1"
}

# ---- 1. cluster and images ------------------------------------------------------------------------
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "reusing kind cluster $CLUSTER"
else
  log "creating kind cluster $CLUSTER"
  kind create cluster --name "$CLUSTER" --wait 180s ${DSV4_E2E_NODE_IMAGE:+--image "$DSV4_E2E_NODE_IMAGE"}
  CREATED_CLUSTER=1
fi

if [ "${DSV4_E2E_SKIP_BUILD:-0}" != 1 ]; then
  log "building $OP_IMAGE"
  docker build -f images/operator.Dockerfile -t "$OP_IMAGE" .
  log "building $ENGINE_IMAGE (CPU torch, tiny model baked in)"
  docker build -f images/engine.Dockerfile --target tiny \
    --build-arg BASE_IMAGE=ubuntu:24.04 \
    --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    -t "$ENGINE_IMAGE" .
fi
log "loading images into the kind nodes"
kind load docker-image --name "$CLUSTER" "$OP_IMAGE" "$ENGINE_IMAGE"

# ---- 2. the chart, then a DSV4Deployment -------------------------------------------------------------
log "helm install dsv4-operator"
# Namespace scope (the chart's default) over the test namespace: a Role there, nothing cluster-wide.
k create namespace "$NS" --dry-run=client -o yaml | k apply -f - >/dev/null
helm upgrade --install dsv4-operator charts/dsv4-operator --kube-context "$CONTEXT" \
  --namespace "$OP_NS" --create-namespace \
  --set image.repository=dsv4-operator --set image.tag=e2e --set image.pullPolicy=Never \
  --set "watch.namespaces={$NS}" \
  --wait --timeout 5m
# Helm installs crds/ only on the first install: keep a reused cluster's CRD current.
k apply --server-side --force-conflicts -f crds/dsv4deployment.yaml >/dev/null
k create namespace "$NS" --dry-run=client -o yaml | k apply -f - >/dev/null
# The tiny deployment asks for nothing beyond Pod Security `restricted` (no hostPath, no IPC_LOCK,
# the builtin image runs as non-root): enforce it, so a pod that needs more fails here.
k label namespace "$NS" --overwrite pod-security.kubernetes.io/enforce=restricted >/dev/null
k -n "$NS" apply -f tests/e2e/tiny-cpu.yaml

# ---- 3. Available, and a completion through the router -----------------------------------------------
log "waiting for $NAME to become Available (timeout $READY_TIMEOUT)"
k -n "$NS" wait "dsv4d/$NAME" --for=condition=Available --timeout="$READY_TIMEOUT"
k -n "$NS" get dsv4d "$NAME"
port_forward "svc/$NAME-router" "$ROUTER_PORT" 8000
wait_for 120 "a completion through the router" completion "$ROUTER_PORT"

# ---- 4. the wedge ---------------------------------------------------------------------------------------
PREFILL_POD="$NAME-prefill-0"
DECODE_POD="$NAME-decode-0"
OLD_PREFILL_UID="$(pod_uid "$PREFILL_POD")"
port_forward "pod/$PREFILL_POD" "$PREFILL_PORT" 8100
port_forward "pod/$DECODE_POD" "$DECODE_PORT" 8100
arm "$PREFILL_PORT" disable_deadlines -1
arm "$DECODE_PORT" disable_deadlines -1
arm "$PREFILL_PORT" stall_transfer 1
log "sending the request that wedges (it hangs in prefill's inflight queue)"
( completion "$ROUTER_PORT" wedged && echo ok >"$WORK/wedged-request" || echo failed >"$WORK/wedged-request" ) &
PF_PIDS+=($!)
wait_for 60 "the request to sit in prefill's inflight queue" \
  bash -c "curl -sf http://127.0.0.1:$PREFILL_PORT/v1/loads | grep -Eq '\"inflight\": *[1-9]'"
# Decode told prefill where to reach it: its pod IP (--advertise-host $(POD_IP)), never 0.0.0.0.
DECODE_IP="$(k -n "$NS" get pod "$DECODE_POD" -o jsonpath='{.status.podIP}')"
if ! curl -sf "http://127.0.0.1:$PREFILL_PORT/v1/loads" | grep -q "\"peer\": *\"http://$DECODE_IP:"; then
  log "FAIL: prefill does not reach decode at its pod IP $DECODE_IP: $(curl -sf http://127.0.0.1:$PREFILL_PORT/v1/loads)"
  dump_state
  exit 1
fi

# ---- 5. the operator's answer --------------------------------------------------------------------------
wait_for 240 "an evidence ConfigMap" evidence_captured
wait_for 240 "the wedged prefill pod to be replaced" replaced "$PREFILL_POD" "$OLD_PREFILL_UID"
wait_for 60 "a WedgeDetected Event" event_posted WedgeDetected
wait_for 60 "a Restarted Event" event_posted Restarted
k -n "$NS" get configmaps -l serving.dsv4.dev/evidence=true
k -n "$NS" get dsv4d "$NAME" -o jsonpath='{.status.lastRemediation}{"\n"}'
wait_for 600 "$NAME to be Available again" available
wait_for 120 "a completion through the router after the restart" completion "$ROUTER_PORT"
log "the request that wedged ended: $(cat "$WORK/wedged-request" 2>/dev/null || echo 'still open')"
log "PASS: evidence captured, wedged pod restarted, traffic recovered"

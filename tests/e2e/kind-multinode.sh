#!/usr/bin/env bash
# End to end on a real Kubernetes cluster (kind, in Docker): a decode engine that spans two pods
# (nodesPerReplica: 2), made by LeaderWorkerSet (installed here from its release) or, with
# DSV4_E2E_FORM=pair, by the operator's StatefulSet pair; then one of its pods deleted and the
# whole group made anew.
#
#   1. a kind cluster with two workers labelled as one rack, both images built and loaded;
#   2. LeaderWorkerSet v0.10.0 installed (its release manifests), then the chart and
#      tests/e2e/tiny-cpu-multinode.yaml;
#   3. Available; the group is one LeaderWorkerSet (or the leader StatefulSet and the group's
#      worker StatefulSet), its two pods in the rack, the worker's node agent reports the group
#      ready; a completion through the router;
#   4. the worker pod deleted: the group's leader is made anew (a new uid), the group serves again.
#
# Needs: docker (with a daemon), kind, and helm/kubectl (scripts/get-tools.sh fetches those two);
# network access for the LeaderWorkerSet release manifests (DSV4_E2E_LWS_MANIFESTS to use a file).
# Run:  bash tests/e2e/kind-multinode.sh      (or: python -m pytest -m e2e tests/e2e)
# Environment:
#   DSV4_E2E_CLUSTER=dsv4-e2e-multinode  kind cluster name (created if missing)
#   DSV4_E2E_FORM=lws                    lws | pair (pair: LeaderWorkerSet not installed)
#   DSV4_E2E_LWS_VERSION=v0.10.0         the LeaderWorkerSet release to install
#   DSV4_E2E_LWS_MANIFESTS=              a local copy of its manifests.yaml (no download)
#   DSV4_E2E_KEEP=1                      keep the cluster afterwards
#   DSV4_E2E_SKIP_BUILD=1                use images already built (dsv4-operator:e2e, dsv4-engine:e2e-tiny)
#   DSV4_E2E_READY_TIMEOUT=900s          how long the engines may take to become ready
# Exit status: 0 passed, 1 failed (cluster state is printed), 2 a prerequisite is missing.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
export PATH="$REPO/.tools/bin:$PATH"

CLUSTER="${DSV4_E2E_CLUSTER:-dsv4-e2e-multinode}"
CONTEXT="kind-$CLUSTER"
FORM="${DSV4_E2E_FORM:-lws}"
LWS_VERSION="${DSV4_E2E_LWS_VERSION:-v0.10.0}"
LWS_MANIFESTS="${DSV4_E2E_LWS_MANIFESTS:-https://github.com/kubernetes-sigs/lws/releases/download/$LWS_VERSION/manifests.yaml}"
KEEP="${DSV4_E2E_KEEP:-0}"
READY_TIMEOUT="${DSV4_E2E_READY_TIMEOUT:-900s}"
OP_NS=dsv4-system
NS=dsv4-e2e
NAME=tiny  # metadata.name in tests/e2e/tiny-cpu-multinode.yaml
RACK_LABEL=dsv4.dev/e2e-rack
OP_IMAGE=dsv4-operator:e2e
ENGINE_IMAGE=dsv4-engine:e2e-tiny
ROUTER_PORT=18010
WORK="$(mktemp -d)"
CREATED_CLUSTER=0
PF_PIDS=()

log() { printf '[kind-multinode %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
k() { kubectl --context "$CONTEXT" "$@"; }

missing() { echo "kind-multinode.sh: $*" >&2; exit 2; }
case "$FORM" in lws|pair) ;; *) missing "DSV4_E2E_FORM must be lws or pair, not $FORM" ;; esac
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
  k get dsv4d,leaderworkersets,statefulsets,pods -A -o wide 2>&1 | grep -v "^kube-system" || true
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

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
  local limit=$1 what=$2 start=$SECONDS
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ $((SECONDS - start)) -lt "$limit" ] || fail "timed out after ${limit}s waiting for $what"
    sleep 2
  done
  log "ok: $what ($((SECONDS - start))s)"
}

completion() {
  local code out="$WORK/completion-${1}.json"
  code="$(curl -sS --max-time 120 -o "$out" -w '%{http_code}' \
    -H 'Content-Type: application/json' "http://127.0.0.1:$ROUTER_PORT/v1/completions" \
    -d "{\"model\": \"$NAME\", \"prompt\": \"The quick brown fox\", \"max_tokens\": 8, \"temperature\": 0}")" || return 1
  [ "$code" = 200 ] && grep -q '"choices"' "$out"
}
pod_uid() { k -n "$NS" get pod "$1" -o jsonpath='{.metadata.uid}' 2>/dev/null; }
replaced() { local uid; uid="$(pod_uid "$1")"; [ -n "$uid" ] && [ "$uid" != "$2" ]; }
pod_ready() {
  [ "$(k -n "$NS" get pod "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}
available() {
  [ "$(k -n "$NS" get dsv4d "$NAME" -o jsonpath='{.status.conditions[?(@.type=="Available")].status}')" = True ]
}
group_ready_in_status() {
  k -n "$NS" get dsv4d "$NAME" -o jsonpath='{.status.groups[0].nodes}' | grep -qx "2/2"
}

# ---- 1. a cluster with a rack of two workers, the images ----------------------------------------------------
if kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  log "reusing kind cluster $CLUSTER"
else
  log "creating kind cluster $CLUSTER (a control plane and two workers)"
  cat >"$WORK/kind.yaml" <<KIND
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
  - role: worker
    labels: {"$RACK_LABEL": rack-a}
  - role: worker
    labels: {"$RACK_LABEL": rack-a}
KIND
  kind create cluster --name "$CLUSTER" --config "$WORK/kind.yaml" --wait 180s ${DSV4_E2E_NODE_IMAGE:+--image "$DSV4_E2E_NODE_IMAGE"}
  CREATED_CLUSTER=1
fi
if [ "${DSV4_E2E_SKIP_BUILD:-0}" != 1 ]; then
  docker build -f images/operator.Dockerfile -t "$OP_IMAGE" .
  docker build -f images/engine.Dockerfile --target tiny \
    --build-arg BASE_IMAGE=ubuntu:24.04 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
    -t "$ENGINE_IMAGE" .
fi
kind load docker-image --name "$CLUSTER" "$OP_IMAGE" "$ENGINE_IMAGE"

# ---- 2. LeaderWorkerSet, the chart, the deployment -------------------------------------------------------------
if [ "$FORM" = lws ]; then
  log "installing LeaderWorkerSet $LWS_VERSION"
  k apply --server-side -f "$LWS_MANIFESTS"
  k -n lws-system rollout status deployment/lws-controller-manager --timeout=300s
  wait_for 120 "the LeaderWorkerSet API" k get --raw /apis/leaderworkerset.x-k8s.io/v1
else
  k get --raw /apis/leaderworkerset.x-k8s.io/v1 >/dev/null 2>&1 && fail "DSV4_E2E_FORM=pair on a cluster with LeaderWorkerSet installed"
fi
k create namespace "$NS" --dry-run=client -o yaml | k apply -f - >/dev/null
helm upgrade --install dsv4-operator charts/dsv4-operator --kube-context "$CONTEXT" \
  --namespace "$OP_NS" --create-namespace \
  --set image.repository=dsv4-operator --set image.tag=e2e --set image.pullPolicy=Never \
  --set "watch.namespaces={$NS}" --wait --timeout 5m
k apply --server-side --force-conflicts -f crds/dsv4deployment.yaml >/dev/null
k label namespace "$NS" --overwrite pod-security.kubernetes.io/enforce=restricted >/dev/null
k -n "$NS" apply -f tests/e2e/tiny-cpu-multinode.yaml

# ---- 3. the group serves ----------------------------------------------------------------------------------------
LEADER="$NAME-decode-0"
WORKER="$NAME-decode-0-1"
log "waiting for $NAME to become Available (timeout $READY_TIMEOUT)"
k -n "$NS" wait "dsv4d/$NAME" --for=condition=Available --timeout="$READY_TIMEOUT"
if [ "$FORM" = lws ]; then
  [ "$(k -n "$NS" get leaderworkerset "$NAME-decode" -o jsonpath='{.spec.leaderWorkerTemplate.size}')" = 2 ] \
    || fail "no LeaderWorkerSet $NAME-decode of size 2"
else
  k -n "$NS" get statefulset "$LEADER" >/dev/null || fail "no worker StatefulSet $LEADER"
fi
wait_for 600 "the worker pod $WORKER to be Ready (its node agent: the group serves)" pod_ready "$WORKER"
wait_for 120 "status.groups to show the group 2/2" group_ready_in_status
RACKS="$(for p in "$LEADER" "$WORKER"; do
  k get node "$(k -n "$NS" get pod "$p" -o jsonpath='{.spec.nodeName}')" -o jsonpath="{.metadata.labels.dsv4\.dev/e2e-rack}{'\n'}"
done | sort -u)"
[ "$RACKS" = rack-a ] || fail "the group's pods are not in one rack: $RACKS"
k -n "$NS" port-forward "svc/$NAME-router" "$ROUTER_PORT:8000" >"$WORK/pf.log" 2>&1 &
PF_PIDS+=($!)
wait_for 120 "a completion through the router" completion before

# ---- 4. a worker pod deleted: the whole group made anew ----------------------------------------------------------
OLD_LEADER_UID="$(pod_uid "$LEADER")"
log "deleting the worker pod $WORKER"
k -n "$NS" delete pod "$WORKER" --wait=false
wait_for 300 "the group's leader to be made anew" replaced "$LEADER" "$OLD_LEADER_UID"
wait_for 900 "$NAME to be Available again" available
wait_for 600 "the new worker pod to be Ready" pod_ready "$WORKER"
wait_for 180 "a completion through the router after the group restart" completion after
log "PASS: a two-node group served, lost a pod, was made anew whole and served again ($FORM)"

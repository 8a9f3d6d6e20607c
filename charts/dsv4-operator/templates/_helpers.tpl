{{/* Names and labels shared by the chart's templates. */}}

{{- define "dsv4-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* <release>-dsv4-operator, or the release name alone when it already says dsv4-operator. */}}
{{- define "dsv4-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dsv4-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dsv4-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dsv4-operator.labels" -}}
{{ include "dsv4-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dsv4
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dsv4-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dsv4-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image: by digest when image.digest is set (what runs can then not change under
the same tag), else by tag. */}}
{{- define "dsv4-operator.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding the operator key (deployments' tokens are derived from it). */}}
{{- define "dsv4-operator.keySecretName" -}}
{{- default (printf "%s-key" (include "dsv4-operator.fullname" .)) .Values.operatorKey.existingSecret -}}
{{- end -}}

{{/* The namespaces a namespaced operator watches: the list given, else the release namespace. */}}
{{- define "dsv4-operator.watchedNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson (uniq .Values.watch.namespaces) -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/*
The operator's API access: exactly what it calls, no wildcards. tests/integration/test_rbac.py
records the operator's calls against an API server and checks this list against them.
*/}}
{{- define "dsv4-operator.rules" -}}
# DSV4Deployments: kopf lists and watches them and keeps its bookkeeping in annotations (patch);
# the handlers read one before writing its status; the watchdog patches the spec for rollback.
- apiGroups: ["serving.dsv4.dev"]
  resources: ["dsv4deployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.dsv4.dev"]
  resources: ["dsv4deployments/status"]
  verbs: ["patch"]
# Every child and the auth Secret carry an ownerReference with blockOwnerDeletion (a foreground
# delete of the resource waits for them). Where OwnerReferencesPermissionEnforcement is on
# (OpenShift, OKD, hardened clusters) setting it needs update on the owner's finalizers.
- apiGroups: ["serving.dsv4.dev"]
  resources: ["dsv4deployments/finalizers"]
  verbs: ["update"]
# The children, by server-side apply (create when absent, patch otherwise); kopf watches the
# workloads to keep the owner's status current.
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["list", "watch", "create", "patch"]
# PD-aware rollouts read the prefill and decode StatefulSets (has prefill rolled out; is decode
# to take a new template). Multi-node roles without LeaderWorkerSet (nodesPerReplica > 1): the
# operator makes each group's worker StatefulSet (create), and deletes one an earlier leader left
# behind, or the role's StatefulSet when a LeaderWorkerSet replaces it.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "delete"]
# Multi-node roles where the cluster serves LeaderWorkerSet (sigs.k8s.io/lws): the role's
# LeaderWorkerSet by server-side apply, read by the PD-aware rollout, deleted when the role goes
# back to one node per replica. (Discovery of the API group needs no grant.)
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "create", "patch", "delete"]
# Every other kind of child is watched too (list, watch), so a hand-deleted or hand-edited one
# is re-applied at once rather than at the next change of the resource.
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["list", "watch", "create", "patch"]
# The deployment's auth Secret (admin token, PD secret, router admin token): created with values
# derived from the operator key and the deployment's uid; an existing one is read (get) to check
# it is the operator's (label or owner reference) and for the operator's own calls to its
# engines. Never patched, listed or watched. RBAC cannot name Secrets that do not exist yet.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# A PodDisruptionBudget per engine role and the optional engine NetworkPolicy, by server-side
# apply; read and deleted when the spec turns them off.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The router's own Role and RoleBinding (it lists engine pods to find them). The API server
# lets the operator grant only what it holds itself: pods get/list/watch, below.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "watch", "create", "patch"]
# The wedge watchdog: lists and watches engine pods (kopf's pod index), labels one draining,
# restarts it through the Eviction API (PodDisruptionBudgets apply), and keeps its last log lines
# as evidence. get it never calls: the router's Role grants it.
# A multi-node group of the StatefulSet pair is made anew by deleting its leader pod (as
# LeaderWorkerSet's RecreateGroupOnPodRestart does), its uid as precondition.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods/eviction"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Evidence ConfigMaps (label serving.dsv4.dev/evidence=true): written, then listed by label and
# the oldest deleted past retention; never read back one by one.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["list", "create", "delete"]
# Events: kopf posts core/v1 Events, the watchdog's included (through kopf.event); one watch
# (list, watch) of the StatefulSet controllers' FailedCreate Events, selected by the API server,
# tells why pods cannot be made (Pod Security admission) in the resource's Degraded condition.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list", "watch"]
{{- end -}}

{{/*
The ValidatingAdmissionPolicy API this cluster serves (empty: none): v1 from Kubernetes 1.30,
else v1beta1 where discovery lists it (1.28-1.29 with the feature gate on).
*/}}
{{- define "dsv4-operator.admissionPolicyVersion" -}}
{{- if semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}
admissionregistration.k8s.io/v1
{{- else if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1beta1/ValidatingAdmissionPolicy" -}}
admissionregistration.k8s.io/v1beta1
{{- end -}}
{{- end }}

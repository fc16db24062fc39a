{{/*
Helpers shared by every template. Each takes either the root context (.) or a dict
with "root" (the root context) and the named arguments documented on it.
*/}}

{{/*
cachepoint.name: the chart name, or .Values.nameOverride. Used as app.kubernetes.io/name.
Takes: the root context.
*/}}
{{- define "cachepoint.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
cachepoint.fullname: the prefix of every object name: <release>-<chart>, or the release
name alone when it already contains the chart name, or .Values.fullnameOverride.
Truncated to 40 characters so that "<fullname>-otel-collector" stays a valid name.
Takes: the root context.
*/}}
{{- define "cachepoint.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
cachepoint.componentName: "<fullname>-<component>", the name of a component's objects.
Takes: dict "root" and "component" (e.g. "gateway").
*/}}
{{- define "cachepoint.componentName" -}}
{{- printf "%s-%s" (include "cachepoint.fullname" .root) .component }}
{{- end }}

{{/*
cachepoint.chart: "<chart>-<version>" for the helm.sh/chart label.
Takes: the root context.
*/}}
{{- define "cachepoint.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
cachepoint.selectorLabels: the immutable labels that select a component's pods
(Deployment/StatefulSet selectors, Services, the PodDisruptionBudget).
Takes: dict "root" and "component".
*/}}
{{- define "cachepoint.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cachepoint.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
cachepoint.labels: the full app.kubernetes.io/* label set for any object of a component,
plus helm.sh/chart and .Values.commonLabels.
Takes: dict "root" and "component".
*/}}
{{- define "cachepoint.labels" -}}
helm.sh/chart: {{ include "cachepoint.chart" .root }}
{{ include "cachepoint.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: cachepoint
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
cachepoint.image: "<registry>/<repository>:<tag>" for one of Cachepoint's own images;
the tag defaults to the chart's appVersion and the registry to global.imageRegistry.
NOTE: a repository whose first path part is a registry host (it has a "." or ":", or is
"localhost", as Docker reads a reference) is already fully qualified, e.g. skaffold's
IMAGE_REPO under --default-repo: prefixing it again would name an image nobody pushed.
Takes: dict "root" and "image" (a values block with repository and tag).
*/}}
{{- define "cachepoint.image" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion }}
{{- $first := splitList "/" .image.repository | first }}
{{- $qualified := and (contains "/" .image.repository) (or (contains "." $first) (contains ":" $first) (eq $first "localhost")) }}
{{- $registry := trimSuffix "/" (.root.Values.global.imageRegistry | default "") }}
{{- if and $registry (not $qualified) }}
{{- printf "%s/%s:%s" $registry .image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .image.repository $tag }}
{{- end }}
{{- end }}

{{/*
cachepoint.thirdPartyImage: "<repository>:<tag>" for NATS, PostgreSQL, the collector and
Jaeger: pinned upstream images, never prefixed with global.imageRegistry.
Takes: a values block with repository and tag.
*/}}
{{- define "cachepoint.thirdPartyImage" -}}
{{- printf "%s:%s" .repository .tag }}
{{- end }}

{{/*
cachepoint.imagePullSecrets: the imagePullSecrets block for a pod spec (or nothing).
Takes: the root context.
*/}}
{{- define "cachepoint.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
cachepoint.serviceAccountName: the ServiceAccount a component runs as.
Takes: dict "root", "component" and "serviceAccount" (the component's values block).
*/}}
{{- define "cachepoint.serviceAccountName" -}}
{{- if .serviceAccount.create }}
{{- default (include "cachepoint.componentName" .) .serviceAccount.name }}
{{- else }}
{{- default "default" .serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
cachepoint.natsUrl: where every component finds NATS: the builtin server's Service, or
nats.url in external mode (required there).
Takes: the root context.
*/}}
{{- define "cachepoint.natsUrl" -}}
{{- if eq .Values.nats.mode "external" }}
{{- required "nats.url is required when nats.mode is external" .Values.nats.url }}
{{- else }}
{{- /* Fully qualified: member pods live in other namespaces than the release's. */}}
{{- printf "nats://%s.%s.svc.cluster.local:4222" (include "cachepoint.componentName" (dict "root" . "component" "nats")) .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
cachepoint.authSecretName: the Secret with the gateway's NATS password
(nats-gateway-password) and the replicas' internal token (internal-token):
auth.existingSecret when given, else the chart's own.
Takes: the root context.
*/}}
{{- define "cachepoint.authSecretName" -}}
{{- .Values.auth.existingSecret | default (include "cachepoint.componentName" (dict "root" . "component" "auth")) }}
{{- end }}

{{/*
cachepoint.natsUsersSecretName: the NATS users include (users.conf) that the operator
rebuilds from every CacheReplica's members.
Takes: the root context.
*/}}
{{- define "cachepoint.natsUsersSecretName" -}}
{{- include "cachepoint.componentName" (dict "root" . "component" "nats-users") }}
{{- end }}

{{/*
cachepoint.keptSecret: one key of a chart Secret, generated once and then kept: the
value already stored in the live Secret (so upgrades keep it), else a new random one.
Fails with "instead" as the fix when secrets.generate is false: where lookup cannot see
the cluster (Argo CD, helm template) a random value would change on every render.
Takes: dict "root", "name" (the Secret), "key" and "instead" (what to set instead).
*/}}
{{- define "cachepoint.keptSecret" -}}
{{- if not .root.Values.secrets.generate }}
{{- fail (printf "secrets.generate is false, so the chart makes no %s: %s" .key .instead) }}
{{- end }}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name }}
{{- if and $existing $existing.data (hasKey $existing.data .key) }}
{{- index $existing.data .key | b64dec }}
{{- else }}
{{- randAlphaNum 40 }}
{{- end }}
{{- end }}

{{/*
cachepoint.keepAnnotation: on a Secret the chart generates: `helm uninstall` leaves it,
so a reinstall under the same release name reads the same values back (lookup) and
matches what was already made with them (the database volume keeps its password).
Takes: nothing.
*/}}
{{- define "cachepoint.keepAnnotation" -}}
helm.sh/resource-policy: keep
{{- end }}

{{/*
cachepoint.otlpEndpoint: the OTLP/gRPC endpoint components export traces to: the chart's
collector when tracing.enabled, else tracing.otlpEndpoint (possibly empty: no tracing).
NOTE: fully qualified, like cachepoint.natsUrl: the operator hands it to member pods,
which run in their CacheReplica's namespace, where a short name resolves to nothing.
Takes: the root context.
*/}}
{{- define "cachepoint.otlpEndpoint" -}}
{{- if .Values.tracing.enabled }}
{{- printf "http://%s.%s.svc.cluster.local:4317" (include "cachepoint.componentName" (dict "root" . "component" "otel-collector")) .Release.Namespace }}
{{- else }}
{{- .Values.tracing.otlpEndpoint }}
{{- end }}
{{- end }}

{{/*
cachepoint.otelEnv: the OTEL_* environment of a container, when there is an endpoint.
Takes: dict "root" and "component" (used as the service name suffix).
*/}}
{{- define "cachepoint.otelEnv" -}}
{{- $endpoint := include "cachepoint.otlpEndpoint" .root }}
{{- if $endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $endpoint | quote }}
- name: OTEL_SERVICE_NAME
  value: {{ printf "cachepoint-%s" .component | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "service.namespace=%s,deployment.environment=%s" .root.Release.Namespace .root.Release.Name | quote }}
{{- end }}
{{- end }}

{{/*
cachepoint.databaseSecretName / cachepoint.databaseSecretKey: where the gateway reads its
SQLAlchemy URL: postgresql.external.existingSecret (external mode) or
postgresql.existingSecret (builtin mode) when given, else the chart's Secret.
Takes: the root context.
*/}}
{{- define "cachepoint.databaseSecretName" -}}
{{- if and (eq .Values.postgresql.mode "external") .Values.postgresql.external.existingSecret }}
{{- .Values.postgresql.external.existingSecret }}
{{- else }}
{{- include "cachepoint.postgresqlSecretName" . }}
{{- end }}
{{- end }}

{{/*
cachepoint.postgresqlSecretName: the Secret with the builtin database's POSTGRES_PASSWORD
(and DATABASE_URL): postgresql.existingSecret, else the chart's own.
Takes: the root context.
*/}}
{{- define "cachepoint.postgresqlSecretName" -}}
{{- .Values.postgresql.existingSecret | default (include "cachepoint.componentName" (dict "root" . "component" "gateway-db")) }}
{{- end }}

{{- define "cachepoint.databaseSecretKey" -}}
{{- if and (eq .Values.postgresql.mode "external") .Values.postgresql.external.existingSecret }}
{{- .Values.postgresql.external.existingSecretKey }}
{{- else }}
{{- "DATABASE_URL" }}
{{- end }}
{{- end }}

{{/*
cachepoint.postgresqlPassword: the builtin database's password: postgresql.password, else
one generated once and kept (cachepoint.keptSecret). Called once per render, from
secret-gateway-db.yaml only, so both keys agree.
Takes: the root context.
*/}}
{{- define "cachepoint.postgresqlPassword" -}}
{{- if .Values.postgresql.password }}
{{- .Values.postgresql.password }}
{{- else }}
{{- $name := include "cachepoint.componentName" (dict "root" . "component" "gateway-db") }}
{{- include "cachepoint.keptSecret" (dict "root" . "name" $name "key" "POSTGRES_PASSWORD" "instead" "set postgresql.existingSecret (a Secret with keys POSTGRES_PASSWORD and DATABASE_URL) or postgresql.password") }}
{{- end }}
{{- end }}

{{/*
cachepoint.podSecurityContext / cachepoint.containerSecurityContext: the restricted Pod
Security Standard for Cachepoint's own containers (images run as uid 10001).
Takes: nothing (the root context is ignored).
*/}}
{{- define "cachepoint.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "cachepoint.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end }}

{{/*
cachepoint.replicaImage: the default image of a CacheReplica entry: the vLLM image for
engine vllm, else the CPU image when it asks for no GPUs (gpusPerPod: 0), the CUDA
image otherwise.
Takes: dict "root" and "replica" (one entry of .Values.replicas).
*/}}
{{- define "cachepoint.replicaImage" -}}
{{- if eq (toString .replica.engine) "vllm" }}
{{- include "cachepoint.image" (dict "root" .root "image" .root.Values.replicaImages.vllm) }}
{{- else if and (hasKey .replica "gpusPerPod") (eq (int .replica.gpusPerPod) 0) }}
{{- include "cachepoint.image" (dict "root" .root "image" .root.Values.replicaImages.cpu) }}
{{- else }}
{{- include "cachepoint.image" (dict "root" .root "image" .root.Values.replicaImages.cuda) }}
{{- end }}
{{- end }}

{{/*
cachepoint.operatorRules: the operator's permissions, least privilege. It reads and
watches CacheReplicas and patches them (finalizer, kopf's progress annotations) and
their status; updates cachereplicas/finalizers (where OwnerReferencesPermissionEnforcement
is on, e.g. OpenShift, blockOwnerDeletion in its children's owner references needs it);
lists and watches member pods (its pod index), creates and deletes them; reads, creates,
patches and deletes the headless Service and the PodDisruptionBudget; posts Events;
reads, creates, patches and deletes each CacheReplica's credentials Secret (no list or
watch: it never reads other Secrets in bulk); with networkPolicy.enabled reads, creates
and patches each CacheReplica's NetworkPolicy (no delete: the garbage collector removes
it with its CacheReplica). Nothing cluster-wide beyond these
resources: kopf's CRD and namespace scanning is disabled (operator/handlers.py).
Shared by the ClusterRole (all namespaces) and the per-namespace Roles; with several
operator pods also kopf's peering rules (cachepoint.operatorPeeringRules).
Takes: the root context.
*/}}
{{- define "cachepoint.operatorRules" -}}
- apiGroups: [cachepoint.dev]
  resources: [cachereplicas]
  verbs: [get, list, watch, patch]
- apiGroups: [cachepoint.dev]
  resources: [cachereplicas/status]
  verbs: [get, patch]
- apiGroups: [cachepoint.dev]
  resources: [cachereplicas/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch, delete]
{{- if .Values.networkPolicy.enabled }}
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
{{- end }}
{{- with include "cachepoint.operatorPeeringRules" . }}
{{ . }}
{{- end }}
{{- end }}

{{/*
cachepoint.operatorPeeringName: the kopf peering object the operator pods share
(<fullname>-operator), or nothing when one standalone pod runs (operator.replicas 1).
Takes: the root context.
*/}}
{{- define "cachepoint.operatorPeeringName" -}}
{{- if gt (int .Values.operator.replicas) 1 }}
{{- include "cachepoint.componentName" (dict "root" . "component" "operator") }}
{{- end }}
{{- end }}

{{/*
cachepoint.operatorPeeringRules: what kopf's peering needs (kopf's docs/deployment-rbac.yaml):
get, list, watch and patch on ClusterKopfPeerings when the operator watches every
namespace, on KopfPeerings in each watched namespace otherwise. Nothing without peering.
Takes: the root context.
*/}}
{{- define "cachepoint.operatorPeeringRules" -}}
{{- if include "cachepoint.operatorPeeringName" . -}}
- apiGroups: [kopf.dev]
  resources: [{{ ternary "kopfpeerings" "clusterkopfpeerings" (not (empty .Values.operator.watchNamespaces)) }}]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}

{{/*
cachepoint.replicaPodLabels: labels every CacheReplica member pod carries, whatever its
CacheReplica (set by the operator, operator/naming.py common_labels), for selectors.
Takes: nothing (the root context is ignored).
*/}}
{{- define "cachepoint.replicaPodLabels" -}}
app.kubernetes.io/name: cachepoint-replica
app.kubernetes.io/component: replica
app.kubernetes.io/managed-by: cachepoint-operator
{{- end }}

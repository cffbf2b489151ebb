{{/* Chart name, truncated to the 63 characters Kubernetes allows in names. */}}
{{- define "epdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name: release-chart unless the release already contains it. */}}
{{- define "epdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "epdserve.name" .) .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-operator" .Release.Name (include "epdserve.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Common labels. */}}
{{- define "epdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "epdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels (immutable once deployed). */}}
{{- define "epdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epdserve.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "epdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "epdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules the operator needs in every namespace it manages (least privilege). */}}
{{- define "epdserve.namespacedRules" -}}
- apiGroups: ["epdserve.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["epdserve.io"]
  resources: ["inferencepools/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
# Held so the operator may grant exactly these to each pool's router (no escalate/bind).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
# Autoscaled roles: engine hpa / keda (the operator engine patches deployments, above).
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "list", "create", "patch", "update", "delete"]
{{- end -}}

{{/* Secrets, granted apart so the grant is easy to audit. The operator never reads a Secret:
pods reference them (the kubelet reads them), and it creates the ones it generates (managed
Redis password, KV-event Curve keys) once, taking AlreadyExists as done. `create` cannot be
narrowed by resourceNames, so it is granted alone. Reads are opt-in: `get` on the Secrets
named in secrets.readNames, or get/list/watch on all of them with secrets.readAll. */}}
{{- define "epdserve.secretRules" -}}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
{{- with .Values.secrets.readNames }}
- apiGroups: [""]
  resources: ["secrets"]
  resourceNames: {{ toJson . }}
  verbs: ["get"]
{{- end }}
{{- if .Values.secrets.readAll }}
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "watch"]
{{- end }}
{{- end -}}

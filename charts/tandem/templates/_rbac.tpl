{{/*
RBAC rules, written out resource by resource: no wildcards, only the verbs the operator uses.
Kept in one place so the cluster-wide and the per-namespace modes grant the same things.
*/}}

{{/*
What kopf itself reads cluster-wide, in either mode: it lists and watches CRDs to notice
resources appearing and disappearing.
*/}}
{{- define "tandem.rbac.frameworkClusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
Only when watching named namespaces: kopf lists and watches namespaces to notice them being
created or deleted (cluster-wide it watches objects across all namespaces instead).
*/}}
{{- define "tandem.rbac.namespaceObserverRules" -}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{/*
What the operator does to HybridModels and their children, in the namespaces it watches.
*/}}
{{- define "tandem.rbac.operatorRules" -}}
# HybridModels: watched; patched for kopf's bookkeeping annotations (and to remove the
# finalizer older operator versions added), and for spec.replicas by the autoscaler.
- apiGroups: ["tandem.dev"]
  resources: ["hybridmodels"]
  verbs: ["get", "list", "watch", "patch"]
# Phase, replicas, conditions and the measured latency go to the status subresource.
- apiGroups: ["tandem.dev"]
  resources: ["hybridmodels/status"]
  verbs: ["patch"]
# Children's owner references set blockOwnerDeletion, which the OwnerReferencesPermissionEnforcement
# admission plugin (on by default in OpenShift) allows only to whoever may update the owner's
# finalizers. No finalizer is ever written.
- apiGroups: ["tandem.dev"]
  resources: ["hybridmodels/finalizers"]
  verbs: ["update"]
# Children: watched for drift, created, and patched back when they drift. The garbage collector
# deletes them with their HybridModel; `delete` is what the OwnerReferencesPermissionEnforcement
# admission plugin asks of whoever sets a child's owner references.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Model-server pods are listed for readiness and their addresses, to scrape decode latency.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# The CA and credentials of a Prometheus the autoscaler queries (metrics.prometheus.tls and .auth),
# read one by name at each step, and the certificate and client CA of spec.tls and the key of
# spec.apiKeySecret, checked by name at each reconcile before the pods take them: never listed or
# watched, so no Secret is read unless a HybridModel names it.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# A CA bundle (metrics.prometheus.tls.caConfigMap, spec.tls.clientCAConfigMap), read the same way.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get"]
# Warnings, repairs and scaling decisions are reported as Events on the HybridModel.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
Leader election, in the release namespace only: the Lease is read, created once, and renewed by
merge patches that carry its resourceVersion (an update's optimistic concurrency; the operator
never uses `update`). `create` cannot be limited to a name: a create request names no object for
resourceNames to match.
*/}}
{{- define "tandem.rbac.leaderElectionRules" -}}
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  resourceNames: [{{ include "tandem.leaseName" . | quote }}]
  verbs: ["get", "patch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["create"]
{{- end }}

{{/*
For people, not the operator: what Kubernetes' built-in view and edit/admin roles gain through
aggregation, so that whoever may edit Deployments in a namespace may also run HybridModels there.
*/}}
{{- define "tandem.rbac.viewRules" -}}
- apiGroups: ["tandem.dev"]
  resources: ["hybridmodels", "hybridmodels/status", "hybridmodels/scale"]
  verbs: ["get", "list", "watch"]
{{- end }}

{{- define "tandem.rbac.editRules" -}}
- apiGroups: ["tandem.dev"]
  resources: ["hybridmodels"]
  verbs: ["create", "update", "patch", "delete", "deletecollection"]
# `kubectl scale hybridmodel` (the replicas the autoscaler would otherwise set).
- apiGroups: ["tandem.dev"]
  resources: ["hybridmodels/scale"]
  verbs: ["update", "patch"]
{{- end }}

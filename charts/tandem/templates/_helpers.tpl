{{/*
The chart name, or nameOverride. Names are DNS labels: at most 63 characters.
*/}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: fullnameOverride, else "<release>-<chart>", else just the
release name when it already contains the chart name (so "tandem" does not become
"tandem-tandem").
*/}}
{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
"<full name>-<suffix>" for one object, given (list $ "suffix"); at most 63 characters. The full
name is shortened rather than the suffix, so that objects of one release never share a name.
*/}}
{{- define "tandem.componentName" -}}
{{- $root := index . 0 }}
{{- $suffix := index . 1 }}
{{- $prefix := include "tandem.fullname" $root | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix $suffix }}
{{- end }}

{{/*
The operator's Deployment, and its (Cluster)Roles and bindings.
*/}}
{{- define "tandem.operatorName" -}}
{{- include "tandem.componentName" (list . "operator") }}
{{- end }}

{{/*
"<chart>-<version>" for the helm.sh/chart label; "+" is not allowed in label values.
*/}}
{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels on every object the chart creates.
*/}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ include "tandem.chart" . }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tandem
{{- end }}

{{/*
Labels that select the operator's pods. They must never change between releases: a
Deployment's selector is immutable.
*/}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The ServiceAccount the operator runs as.
*/}}
{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tandem.operatorName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image reference: a digest wins over a tag; the tag defaults to appVersion.
*/}}
{{- define "tandem.operatorImage" -}}
{{- $image := .Values.operator.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) }}
{{- end }}
{{- end }}

{{/*
"true" when the operator watches every namespace (no watchNamespaces given), else "".
*/}}
{{- define "tandem.clusterWide" -}}
{{- if not .Values.operator.watchNamespaces }}true{{ end }}
{{- end }}

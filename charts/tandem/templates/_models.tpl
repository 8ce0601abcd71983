{{/*
How the operator labels and names what it renders for a HybridModel. These must match
tandem_operator's builders; tests/chart checks them against the operator's own output.
*/}}

{{/*
Labels on every Service the operator creates for a HybridModel.
*/}}
{{- define "tandem.modelServiceSelector" -}}
app.kubernetes.io/managed-by: tandem-operator
{{- end }}

{{/*
The Service label carrying the HybridModel's name.
*/}}
{{- define "tandem.modelNameLabel" -}}
app.kubernetes.io/instance
{{- end }}

{{/*
The name of the Service port that serves Prometheus metrics.
*/}}
{{- define "tandem.metricsPortName" -}}
metrics
{{- end }}

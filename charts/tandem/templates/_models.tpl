{{/*
How the operator labels and names what it renders for a HybridModel. These must match
tandem_operator.names and its Service builder; tests/chart checks them against the
operator's own output.
*/}}

{{/*
Labels on every Service the operator creates for a HybridModel (names.common_labels).
*/}}
{{- define "tandem.modelServiceSelector" -}}
app.kubernetes.io/managed-by: tandem-operator
app.kubernetes.io/component: hybridmodel
{{- end }}

{{/*
The Service label carrying the HybridModel's name (names.MODEL_LABEL).
*/}}
{{- define "tandem.modelNameLabel" -}}
tandem.dev/hybridmodel
{{- end }}

{{/*
The name of the Service port that serves the attention (inference) server's Prometheus metrics.
*/}}
{{- define "tandem.metricsPortName" -}}
metrics
{{- end }}

{{/*
The name of the Service port that serves the experts process's Prometheus metrics
(containers.EXPERTS_METRICS_PORT_NAME): the `tandem_experts_*` series.
*/}}
{{- define "tandem.expertsMetricsPortName" -}}
expert-metrics
{{- end }}

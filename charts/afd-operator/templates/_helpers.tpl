{{/* Name of the chart, overridable. */}}
{{- define "afd-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: <release>-afd-operator, or the release name when it contains the chart name. */}}
{{- define "afd-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "afd-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "afd-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: afd
{{- end }}

{{/* Labels that select the operator pods. */}}
{{- define "afd-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "afd-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "afd-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "afd-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference: repository@digest, else repository:tag (tag defaults to appVersion). */}}
{{- define "afd-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The operator's RBAC rules, read from files/rbac.yaml (a copy of operator/afd_operator/rbac.yaml,
kept equal by scripts/sync_chart.py). Argument: the ClusterRole name in that file. Returns
YAML {rules: [...]}.
*/}}
{{- define "afd-operator.sourceRules" -}}
{{- $root := index . 0 }}
{{- $want := index . 1 }}
{{- $found := dict }}
{{- range $doc := regexSplit "(?m)^---\\s*$" ($root.Files.Get "files/rbac.yaml") -1 }}
{{- $obj := fromYaml $doc }}
{{- if and $obj (eq (dig "metadata" "name" "" $obj) $want) }}
{{- $_ := set $found "rules" $obj.rules }}
{{- end }}
{{- end }}
{{- if not $found.rules }}
{{- fail (printf "files/rbac.yaml has no ClusterRole %s: run scripts/sync_chart.py" $want) }}
{{- end }}
{{- toYaml $found }}
{{- end }}

{{/*
Split rules into cluster-scoped and namespaced parts (for the namespaced mode). Argument:
a list of rules. Returns YAML {cluster: [...], namespaced: [...]}. A rule's resources are
split by scope; the verbs and API groups stay as they are.
*/}}
{{- define "afd-operator.splitRules" -}}
{{- $clusterScoped := list "customresourcedefinitions" "namespaces" "clusterkopfpeerings" "nodes" "persistentvolumes" "clusterroles" "clusterrolebindings" }}
{{- $out := dict "cluster" (list) "namespaced" (list) }}
{{- range $rule := . }}
{{- $c := list }}
{{- $n := list }}
{{- range $r := $rule.resources }}
{{- if has (first (splitList "/" $r)) $clusterScoped }}
{{- $c = append $c $r }}
{{- else }}
{{- $n = append $n $r }}
{{- end }}
{{- end }}
{{- if $c }}
{{- $_ := set $out "cluster" (append $out.cluster (merge (dict "resources" $c) (omit $rule "resources"))) }}
{{- end }}
{{- if $n }}
{{- $_ := set $out "namespaced" (append $out.namespaced (merge (dict "resources" $n) (omit $rule "resources"))) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

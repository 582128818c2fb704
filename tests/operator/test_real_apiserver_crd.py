"""The CRD and custom resources against a real kube-apiserver (issue 14): the CRD's own validation (CEL rules
against defaults, cost estimates), OpenAPI and CEL validation of custom resources, defaulting, and what the
API server keeps of the rendered pods. Needs the kit's control plane: see apiserver_kit.py.
"""

from __future__ import annotations

import time

import pytest
import yaml

from apiserver_kit import CRD_NAME, cluster, crd, namespace, new_namespace  # noqa: F401  (fixtures)
from op_testkit import (
    CEL_REFUSED, CRD_PATH, SAMPLES, SCHEMA_REFUSED, apply_defaults, crd_schema, make_cr, walk_validations,
)
from real_cluster import CHART, ApiError, eventually

pytestmark = pytest.mark.timeout(300)


# --- the CRD ---------------------------------------------------------------------------------


def test_the_crd_applies_server_side_and_is_established(cluster):
    started = time.monotonic()
    for path in (CRD_PATH, CHART / "crds" / CRD_PATH.name):
        stored = cluster.apply(yaml.safe_load(path.read_text()))
        assert stored["metadata"]["name"] == CRD_NAME
    established = cluster.wait_established(CRD_NAME)
    print(f"CRD applied and Established in {time.monotonic() - started:.2f}s")
    names = established["status"]["acceptedNames"]
    assert (names["kind"], names["shortNames"]) == ("AFDDeployment", ["afd"])
    version = established["spec"]["versions"][0]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    stored_rules = [rule["rule"] for _, rule in walk_validations(version["schema"]["openAPIV3Schema"])]
    assert sorted(stored_rules) == sorted(rule["rule"] for _, rule in walk_validations(crd_schema()))
    assert len(stored_rules) == 14  # 8, spec.ratio's bounds, spec.autoscaling's bounds, target, positive targets, frozen replicas, spec.router's ports


def _variant(change):
    """The CRD under another group (so a dry-run create gets the full create-time validation)."""
    body = yaml.safe_load(CRD_PATH.read_text())
    body["metadata"]["name"] = "afddeployments.guard.afd.io"
    body["spec"]["group"] = "guard.afd.io"
    spec = body["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    change(spec)
    return body


def _set(node, key, value):
    node[key] = value


@pytest.mark.parametrize("change, refusal", [
    (lambda s: _set(s["restartPolicy"], "default", {}), "no such key: maxBackoffSeconds"),
    (lambda s: _set(s["podSecurity"], "default", {}), "no such key: runAsUser"),
    (lambda s: _set(s["restartPolicy"]["x-kubernetes-validations"][0], "messageExpression",
                    "'maxBackoffSeconds (' + string(self.maxBackoffSeconds) + ') is too low'"),
     "estimated messageExpression cost exceeds budget by factor of more than 100x"),
], ids=["empty-default", "empty-default-2", "string-concatenation"])
def test_the_api_server_refuses_what_the_guard_refuses(cluster, change, refusal):
    """The premises of scripts/check_crd.py, checked on the real thing; the unchanged CRD
    under the same group passes the same dry run."""
    cluster.create(_variant(lambda s: None), dry_run=True)
    with pytest.raises(ApiError) as err:
        cluster.create(_variant(change), dry_run=True)
    assert err.value.status == 422 and refusal in err.value.message, err.value.message


def test_bounded_integers_do_not_bound_string_of_an_integer(cluster):
    """Why the CRD's messages use format(): `maximum` does not make '+ string(int)' affordable."""
    def change(spec):
        rule = spec["restartPolicy"]["x-kubernetes-validations"][0]
        rule["messageExpression"] = "'maxBackoffSeconds (' + string(self.maxBackoffSeconds) + ') is too low'"
        assert spec["restartPolicy"]["properties"]["maxBackoffSeconds"]["maximum"] == 86400

    with pytest.raises(ApiError, match="more than 100x"):
        cluster.create(_variant(change), dry_run=True)


# --- custom resources ------------------------------------------------------------------------


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_every_sample_is_accepted_and_defaulted_like_the_offline_defaulting(cluster, namespace, path):
    body = yaml.safe_load(path.read_text())
    body["metadata"]["namespace"] = namespace
    stored = cluster.create(body)
    assert stored["spec"] == apply_defaults(crd_schema(), body)["spec"]
    assert stored["spec"]["restartPolicy"]["maxBackoffSeconds"] == 600


def test_api_servers_are_stored_as_given_and_default_to_the_engines_process(cluster, namespace):
    stored = cluster.create(_cr(namespace, "api-servers", afd={"apiServers": 4}))
    assert stored["spec"]["afd"]["apiServers"] == 4
    assert cluster.create(_cr(namespace, "api-default"))["spec"]["afd"]["apiServers"] == 0


def test_prefix_caching_is_stored_as_given_and_defaults_on(cluster, namespace):
    assert cluster.create(_cr(namespace, "prefix-off", afd={"prefixCaching": False}))["spec"]["afd"]["prefixCaching"] is False
    assert cluster.create(_cr(namespace, "prefix-default"))["spec"]["afd"]["prefixCaching"] is True


def test_the_kv_cache_dtype_is_stored_as_given_defaults_to_auto_and_refuses_others(cluster, namespace):
    assert cluster.create(_cr(namespace, "kv-fp8", afd={"kvCacheDtype": "fp8"}))["spec"]["afd"]["kvCacheDtype"] == "fp8"
    assert cluster.create(_cr(namespace, "kv-default"))["spec"]["afd"]["kvCacheDtype"] == "auto"
    with pytest.raises(ApiError, match="kvCacheDtype"):
        cluster.create(_cr(namespace, "kv-int8", afd={"kvCacheDtype": "int8"}))


def test_the_api_key_secret_ref_is_stored_defaulted_and_the_attention_pods_read_the_key_from_it(cluster, namespace):
    """Issue 52: `spec.api.apiKeySecretRef` kept (its key defaulted); the rendered attention StatefulSet, as the API
    server keeps it, takes AFD_API_KEY from the Secret, and no literal value of it is anywhere."""
    from afd_operator.model.spec import parse_owner, parse_spec
    from afd_operator.rendering.children import render_group

    stored = cluster.create(_cr(namespace, "keyed", api={"apiKeySecretRef": {"name": "clients"}}))
    assert stored["spec"]["api"]["apiKeySecretRef"] == {"name": "clients", "key": "api-key"}
    body = make_cr(name="keyed", namespace=namespace, api=stored["spec"]["api"])
    for sts in (o for o in render_group(parse_spec(body["spec"]), parse_owner(body), 0, "r1") if o["kind"] == "StatefulSet"):
        sts["metadata"].pop("ownerReferences")
        env = cluster.create(sts, dry_run=True)["spec"]["template"]["spec"]["containers"][0]["env"]
        keys = [e for e in env if e["name"] == "AFD_API_KEY"]
        role = sts["spec"]["template"]["metadata"]["labels"]["afd.io/role"]
        assert keys == ([{"name": "AFD_API_KEY", "valueFrom": {"secretKeyRef": {"name": "clients", "key": "api-key"}}}]
                        if role == "attention" else []), role


@pytest.mark.parametrize("afd", [{}, {"attentionEngine": "vllm", "attentionImage": "registry.example/afd-vllm:0.1.0"}],
                         ids=["afd-engine", "vllm-engine"])
def test_the_rendered_probes_and_prestop_drain_are_kept_by_the_api_server(cluster, namespace, afd):
    """Issue 22: 1 s readiness, /live liveness, the preStop drain (httpGet, or the kubelet's sleep
    for vLLM) and the grace period: a server that did not know a field would drop it silently."""
    from afd_operator.model.spec import parse_owner, parse_spec
    from afd_operator.rendering.children import render_group

    body = make_cr(name="drain", namespace=namespace, afd=afd)
    for sts in (o for o in render_group(parse_spec(body["spec"]), parse_owner(body), 0, "r1") if o["kind"] == "StatefulSet"):
        sts["metadata"].pop("ownerReferences")  # the owner does not exist: no garbage collection in a dry run
        stored = cluster.create(sts, dry_run=True)["spec"]["template"]["spec"]
        rendered = sts["spec"]["template"]["spec"]
        assert stored["terminationGracePeriodSeconds"] == rendered["terminationGracePeriodSeconds"]
        for key in ("lifecycle", "readinessProbe", "livenessProbe", "startupProbe"):
            want = rendered["containers"][0].get(key)
            got = stored["containers"][0].get(key)
            if want is None:
                assert got is None, key
                continue
            assert _subset(want, got), f"{sts['metadata']['name']} {key}: rendered {want}, stored {got}"


def test_a_namespace_whose_quota_requires_requests_and_limits_admits_the_role_pods(cluster, namespace):
    """Issue 35: a ResourceQuota on requests and memory limits refuses a pod any of whose containers
    lacks them; the hf:// download init container has them now, so the rendered pods are admitted
    (dry run), and they carry no service-account token."""
    from afd_operator.model.spec import parse_owner, parse_spec
    from afd_operator.rendering.children import render_group

    cluster.create({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "needs-resources", "namespace": namespace},
                    "spec": {"hard": {"requests.cpu": "64", "requests.memory": "256Gi", "limits.memory": "512Gi"}}})
    eventually(lambda: (cluster.get("ResourceQuota", "needs-resources", namespace).get("status") or {}).get("hard"), 30,
               "the quota controller to compute the quota")
    own = {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    body = make_cr(name="quota", namespace=namespace, model={"uri": "hf://org/name"}, attention={"resources": own},
                   ffn={"resources": own})
    for sts in (o for o in render_group(parse_spec(body["spec"]), parse_owner(body), 0, "r1") if o["kind"] == "StatefulSet"):
        template = sts["spec"]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{sts['metadata']['name']}-0", "namespace": namespace,
                                                               "labels": template["metadata"]["labels"]},
               "spec": template["spec"]}
        stored = cluster.create(pod, dry_run=True)["spec"]
        assert [c["name"] for c in stored["initContainers"]] == ["model-download"]
        assert stored["automountServiceAccountToken"] is False
        assert not [m for c in stored["containers"] + stored["initContainers"] for m in c.get("volumeMounts", [])
                    if m["mountPath"].startswith("/var/run/secrets/kubernetes.io")]


def _subset(want, got) -> bool:
    """`want` is in `got` (the API server adds defaults such as scheme: HTTP)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _subset(v, got[k]) for k, v in want.items())
    return want == got


def _cr(namespace, name="demo", **change):
    body = make_cr(name=name, namespace=namespace, **change)
    del body["metadata"]["uid"], body["metadata"]["generation"]  # the API server sets these
    return body


@pytest.mark.parametrize("name, change, message", CEL_REFUSED, ids=lambda v: str(v)[:40])
def test_the_api_server_refuses_what_the_cel_rules_refuse(cluster, namespace, name, change, message):
    with pytest.raises(ApiError) as err:
        cluster.create(_cr(namespace, name, **change))
    assert err.value.status == 422 and message in err.value.message, err.value.message


@pytest.mark.parametrize("change, where", SCHEMA_REFUSED, ids=lambda v: str(v)[:40])
def test_the_api_server_refuses_what_the_schema_refuses(cluster, namespace, change, where):
    with pytest.raises(ApiError) as err:
        cluster.create(_cr(namespace, **change))
    assert err.value.status == 422 and where in err.value.message, err.value.message


def test_replicas_cannot_change_while_autoscaling_not_even_through_scale(cluster, namespace):
    """spec.autoscaling owns the group count: a /scale write (kubectl scale) and an edit of
    spec.replicas are refused with the rule's message; other edits, and turning it off, are not."""
    from afd_operator.model.autoscaling import REPLICAS_MANAGED_MESSAGE

    autoscaling = {"enabled": True, "maxGroups": 3, "targets": {"ttftP90Seconds": 2.0}}
    cluster.create(_cr(namespace, "scaled", autoscaling=autoscaling))
    for attempt in (lambda: cluster.merge_patch("AFDDeployment", "scaled", namespace, {"spec": {"replicas": 2}}, "scale"),
                    lambda: cluster.merge_patch("AFDDeployment", "scaled", namespace, {"spec": {"replicas": 2}})):
        with pytest.raises(ApiError) as err:
            attempt()
        assert err.value.status == 422 and REPLICAS_MANAGED_MESSAGE in err.value.message, err.value.message
    kept = cluster.merge_patch("AFDDeployment", "scaled", namespace, {"spec": {"autoscaling": {"maxGroups": 4}}})
    assert (kept["spec"]["replicas"], kept["spec"]["autoscaling"]["maxGroups"]) == (1, 4)
    off = cluster.merge_patch("AFDDeployment", "scaled", namespace,
                              {"spec": {"replicas": 3, "autoscaling": {"enabled": False}}})
    assert off["spec"]["replicas"] == 3
    scaled = cluster.merge_patch("AFDDeployment", "scaled", namespace, {"spec": {"replicas": 2}}, "scale")
    assert scaled["spec"]["replicas"] == 2  # off: /scale works again


def test_missing_required_fields_are_all_refused(cluster, namespace):
    body = _cr(namespace)
    body["spec"] = {"replicas": 1}
    with pytest.raises(ApiError) as err:
        cluster.create(body)
    assert "spec.image: Required value" in err.value.message and "spec.model: Required value" in err.value.message


def test_unknown_fields_are_refused_with_strict_field_validation(cluster, namespace):
    """What the operator's typed model says as "Extra inputs are not permitted"."""
    with pytest.raises(ApiError) as err:
        cluster.create(_cr(namespace, attention={"rank": 2}))
    assert 'unknown field "spec.attention.rank"' in err.value.message, err.value.message


def test_the_api_parsers_are_stored_and_reach_the_attention_pods(cluster, namespace):
    """Issue 52: `spec.api.toolCallParser` / `reasoningParser` kept by the API server (unknown names refused), and the
    rendered attention StatefulSet, as the server keeps it, carries them as AFD_TOOL_CALL_PARSER / AFD_REASONING_PARSER."""
    from afd_operator.model.spec import parse_owner, parse_spec
    from afd_operator.rendering.children import render_group

    api = {"toolCallParser": "deepseek_v31", "reasoningParser": "deepseek_v3"}
    stored = cluster.create(_cr(namespace, "parsers", api=api))
    assert stored["spec"]["api"] == api
    with pytest.raises(Exception):
        cluster.create(_cr(namespace, "bad-parser", api={"toolCallParser": "hermes2"}))
    body = make_cr(name="parsers", namespace=namespace, api=stored["spec"]["api"])
    for sts in (o for o in render_group(parse_spec(body["spec"]), parse_owner(body), 0, "r1") if o["kind"] == "StatefulSet"):
        sts["metadata"].pop("ownerReferences")
        env = cluster.create(sts, dry_run=True)["spec"]["template"]["spec"]["containers"][0]["env"]
        named = {e["name"]: e.get("value") for e in env if e["name"] in ("AFD_TOOL_CALL_PARSER", "AFD_REASONING_PARSER")}
        role = sts["spec"]["template"]["metadata"]["labels"]["afd.io/role"]
        assert named == ({"AFD_TOOL_CALL_PARSER": "deepseek_v31", "AFD_REASONING_PARSER": "deepseek_v3"}
                         if role == "attention" else {}), role

"""Hardening of what the operator renders: restricted pods, the group Secret in every role
pod, and per-group NetworkPolicies judged by what they admit."""

from __future__ import annotations

import base64

import kubernetes_validate
import pytest

from afd import config as afd_config
from afd.runners.handshake import token_digest
from afd_operator.model import labels as L
from afd_operator.model.spec import parse_owner, parse_spec
from afd_operator.rendering.children import render_all
from afd_operator.rendering.security import SECRET_KEY, render_group_secret
from op_testkit import make_cr
from test_render import CASES

NEWEST = kubernetes_validate.utils.latest_version()


def _render(body):
    return render_all(parse_spec(body["spec"]), parse_owner(body))


def _templates(body):
    for obj in _render(body):
        if obj["kind"] == "StatefulSet":
            yield obj, obj["spec"]["template"]["spec"]


# --- restricted pods ------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_container_runs_restricted(case):
    """The Pod Security Standards' "restricted" profile, for role and init containers alike."""
    spec = parse_spec(CASES[case]["spec"])
    for _, pod in _templates(CASES[case]):
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == spec.pod_security.run_as_user != 0
        assert (sc["runAsGroup"], sc["fsGroup"]) == (spec.pod_security.run_as_group, spec.pod_security.fs_group)
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC")
        for container in pod["containers"] + pod.get("initContainers", []):
            csc = container["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False, container["name"]
            assert csc["readOnlyRootFilesystem"] is True, container["name"]
            assert csc["capabilities"] == {"drop": ["ALL"]}, container["name"]
            assert not csc.get("privileged") and csc.get("runAsUser", 1) != 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_the_runtime_writes_lands_on_writable_volumes(case):
    """With a read-only root, /tmp, $HOME and every cache directory must be writable mounts."""
    for _, pod in _templates(CASES[case]):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in pod["containers"] + pod.get("initContainers", []):
            writable = [m["mountPath"] for m in container["volumeMounts"]
                        if not m.get("readOnly") and ("emptyDir" in volumes[m["name"]]
                                                      or "persistentVolumeClaim" in volumes[m["name"]])]
            env = {e["name"]: e.get("value") for e in container["env"]}
            needs = ["/tmp", env["HOME"], env["XDG_CACHE_HOME"], env["HF_HOME"]]
            for path in needs:
                assert any(path == w or path.startswith(w + "/") for w in writable), (container["name"], path)
            if container["name"] == "model-download":  # the init container writes the checkpoint
                assert "/models" in writable
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"


def test_the_uid_is_configurable_and_root_is_refused():
    body = CASES["1g-2a1f-zmq-netpol-uid"]
    for _, pod in _templates(body):
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["fsGroup"]) == (2000, 4000)
    with pytest.raises(ValueError, match="runAsUser must not be 0"):
        parse_spec(make_cr(podSecurity={"runAsUser": 0})["spec"])


# --- the group Secret -----------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_role_pod_reads_the_group_secret_and_nothing_renders_its_value(case):
    body = CASES[case]
    objs = _render(body)
    assert "Secret" not in {o["kind"] for o in objs}  # `afd render` and render_all never hold the value
    expected = {"name": L.secret_name(body["metadata"]["name"]), "key": SECRET_KEY}
    for _, pod in _templates(body):
        [role] = pod["containers"]
        [ref] = [e for e in role["env"] if e["name"] == "AFD_GROUP_SECRET"]
        assert ref["valueFrom"]["secretKeyRef"] == expected
        for init in pod.get("initContainers", []):  # the downloader has no business with it
            assert "AFD_GROUP_SECRET" not in {e["name"] for e in init.get("env", [])}


def test_the_runtime_folds_the_secret_into_the_handshake():
    """The contract on the runtime side: a pod without the Secret presents another digest."""
    assert afd_config.ENV_VARS["AFD_GROUP_SECRET"] == "group_secret"
    assert token_digest("demo-g0-r1", "s3cret") != token_digest("demo-g0-r1", "")


@pytest.mark.parametrize("version", ["1.30", NEWEST])
def test_the_secret_render_is_pure_valid_and_owned(version):
    owner = parse_owner(make_cr())
    secret = render_group_secret(owner, "ab" * 32)
    assert secret == render_group_secret(owner, "ab" * 32)
    kubernetes_validate.validate(secret, version, strict=True)
    assert secret["immutable"] is True and secret["metadata"]["ownerReferences"] == [owner.reference()]
    assert base64.b64decode(secret["data"][SECRET_KEY]).decode() == "ab" * 32


# --- NetworkPolicies ------------------------------------------------------------------------


def _matches(selector, labels):
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def admits(policies, target, source, port, source_namespace="ns"):
    """Whether a TCP connection from a pod labelled `source` in `source_namespace` to a pod
    labelled `target` (namespace ns) on `port` is admitted, by NetworkPolicy semantics."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], target)]
    if not selecting:
        return True
    ns_labels = {"kubernetes.io/metadata.name": source_namespace}
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in {p["port"] for p in rule["ports"]}:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                pods_ok = "podSelector" not in peer or _matches(peer["podSelector"], source)
                if "namespaceSelector" in peer:
                    if _matches(peer["namespaceSelector"], ns_labels) and pods_ok:
                        return True
                elif source_namespace == "ns" and pods_ok:
                    return True
    return False


def _policies(**spec):
    return [o for o in _render(make_cr(replicas=2, **spec)) if o["kind"] == "NetworkPolicy"]


def pod(group, role, name="demo"):
    return {L.NAME: name, L.GROUP: str(group), L.ROLE: role, L.REVISION: "r1"}


def test_zmq_connector_ports_admit_only_the_same_group():
    policies = _policies(networkPolicy={"enabled": True})
    assert len(policies) == 4  # two roles × two groups
    ffn0, attn0 = pod(0, "ffn"), pod(0, "attention")
    for port in (25500, 25501):
        assert admits(policies, ffn0, attn0, port)
        assert not admits(policies, ffn0, pod(1, "attention"), port)  # another group
        assert not admits(policies, ffn0, pod(0, "attention", name="other"), port)  # another deployment
        assert not admits(policies, ffn0, {"app": "intruder"}, port)
    assert not admits(policies, ffn0, attn0, 8000)  # nothing else is open on FFN pods
    assert not admits(policies, attn0, ffn0, 25500)  # zmq: attention dials, FFN never does
    assert admits(policies, attn0, {"app": "client"}, 8000)  # the API, from anywhere
    assert admits(policies, attn0, {"app": "client"}, 8000, source_namespace="elsewhere")
    for target in (ffn0, attn0):
        assert admits(policies, target, {"app": "prometheus"}, 9090)  # metrics: this namespace
        assert not admits(policies, target, {"app": "prometheus"}, 9090, source_namespace="monitoring")


def test_nccl_admits_every_port_within_the_group_only():
    policies = _policies(networkPolicy={"enabled": True}, afd={"connector": "nccl"})
    ffn0, attn0 = pod(0, "ffn"), pod(0, "attention")
    assert admits(policies, ffn0, attn0, 41234) and admits(policies, attn0, ffn0, 41234)  # NCCL's own ports
    assert not admits(policies, ffn0, pod(1, "attention"), 41234)
    assert not admits(policies, ffn0, pod(1, "attention"), 25500)
    assert not admits(policies, ffn0, {"app": "intruder"}, 25501)


def test_metrics_namespace_selector_opens_metrics_to_the_selected_namespaces_only():
    selector = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    policies = _policies(networkPolicy={"enabled": True, "metricsNamespaceSelector": selector})
    ffn0 = pod(0, "ffn")
    assert admits(policies, ffn0, {"app": "prometheus"}, 9090, source_namespace="monitoring")
    assert not admits(policies, ffn0, {"app": "prometheus"}, 9090, source_namespace="other")
    assert not admits(policies, ffn0, {"app": "prometheus"}, 25500, source_namespace="monitoring")
    everywhere = _policies(networkPolicy={"enabled": True, "metricsNamespaceSelector": {}})
    assert admits(everywhere, ffn0, {"app": "prometheus"}, 9090, source_namespace="any")


def test_network_policies_are_opt_in_and_do_not_start_a_rollout():
    assert _policies() == []
    with_policy = parse_spec(make_cr(networkPolicy={"enabled": True})["spec"])
    assert with_policy.revision == parse_spec(make_cr()["spec"]).revision


@pytest.mark.parametrize("version", ["1.30", NEWEST])
@pytest.mark.parametrize("connector", ["zmq", "nccl"])
def test_network_policies_are_valid_kubernetes(version, connector):
    selector = {"matchLabels": {"team": "observability"}}
    for policy in _policies(networkPolicy={"enabled": True, "metricsNamespaceSelector": selector},
                            afd={"connector": connector}):
        kubernetes_validate.validate(policy, version, strict=True)
        assert policy["metadata"]["ownerReferences"][0]["kind"] == "AFDDeployment"

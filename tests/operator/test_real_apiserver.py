"""The CRD, the chart and the operator against a real kube-apiserver (issue 14).

kmock validates nothing; these tests run what only a real API server does: the CRD's own
validation (CEL rules against defaults, cost estimates), OpenAPI and CEL validation of custom
resources, defaulting, server-side apply, RBAC, the StatefulSet and garbage collectors.

They need the kit's control plane (../shared/tools/kube-local/up.sh) and AFD_KUBECONFIG
pointing at its kubeconfig; without it they skip (see real_cluster.py).

`helm install` is emulated (helm-python-sdk renders; it cannot install): see HelmRelease in
real_cluster.py for what is and is not done as Helm would.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from op_testkit import (
    CEL_REFUSED, CRD_PATH, ROOT, SAMPLES, SCHEMA_REFUSED, apply_defaults, crd_schema, make_cr, walk_validations,
)
from real_cluster import HOOK, INSTALL_ORDER, ApiError, Cluster, HelmRelease, eventually, kubeconfig_or_skip

pytestmark = pytest.mark.timeout(300)

CHART = ROOT / "charts" / "afd-operator"
CRD_NAME = "afddeployments.afd.io"


@pytest.fixture(scope="module")
def cluster():
    return Cluster(kubeconfig_or_skip())


@pytest.fixture(scope="module")
def crd(cluster):
    """The canonical CRD, applied server-side (the chart's copy is the same file)."""
    cluster.apply(yaml.safe_load(CRD_PATH.read_text()))
    return cluster.wait_established(CRD_NAME)


@pytest.fixture
def new_namespace(cluster):
    """Make namespaces (name prefix → name) that are deleted after the test, passed or not."""
    made = []

    def make(prefix):
        made.append(cluster.new_namespace(prefix))
        return made[-1]

    yield make
    for name in made:
        cluster.delete("Namespace", name)


@pytest.fixture
def namespace(crd, new_namespace):
    return new_namespace("afd-test")


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
    assert len(stored_rules) == 13  # 8, spec.ratio's bounds, spec.autoscaling's bounds, target, positive targets, frozen replicas


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


@pytest.mark.parametrize("afd", [{}, {"attentionEngine": "vllm", "attentionImage": "registry.example/afd-vllm:0.1.0"}],
                         ids=["afd-engine", "vllm-engine"])
def test_the_rendered_probes_and_prestop_drain_are_kept_by_the_api_server(cluster, namespace, afd):
    """Issue 22: 1 s readiness, /live liveness, the preStop drain (httpGet, or the kubelet's sleep
    for vLLM) and the grace period: a server that did not know a field would drop it silently."""
    from afd_operator.model import parse_owner, parse_spec
    from afd_operator.render import render_group

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
    from afd_operator.model import parse_owner, parse_spec
    from afd_operator.render import render_group

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
    from afd_operator.autoscaling_spec import REPLICAS_MANAGED_MESSAGE

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


# --- the chart -------------------------------------------------------------------------------


def test_helm_install_creates_the_crd_and_the_operator_and_uninstall_removes_it(cluster, crd, new_namespace):
    release = HelmRelease(cluster, "afd-install", new_namespace("afd-system"))
    kinds = sorted(f"{o['kind']}" for o in release.objects)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "Deployment", "ServiceAccount"]
    # A first install: no CRD yet (deleting it also deletes every AFDDeployment).
    cluster.delete("CustomResourceDefinition", CRD_NAME)
    eventually(lambda: cluster.get("CustomResourceDefinition", CRD_NAME) is None, 60, "the CRD to go")
    started = time.monotonic()
    release.install()
    installed = time.monotonic() - started
    created = cluster.wait_established(CRD_NAME)
    assert created["metadata"]["uid"] != crd["metadata"]["uid"]  # the install made it afresh
    assert len(release.present()) == len(release.objects) == 4
    deployment = cluster.get("Deployment", "afd-install-afd-operator", release.namespace)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "afd-install-afd-operator"
    # The Deployment controller makes the ReplicaSet and the Pod (Pending: no kubelet here).
    pods = eventually(lambda: cluster.list("Pod", release.namespace), 30, "the operator's Pod")
    assert pods[0]["status"]["phase"] == "Pending"
    binding = cluster.get("ClusterRoleBinding", "afd-install-afd-operator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "afd-install-afd-operator",
                                    "namespace": release.namespace}]

    started = time.monotonic()
    release.uninstall()
    eventually(lambda: not release.present(), 30, "uninstall")
    eventually(lambda: not cluster.list("Pod", release.namespace), 60, "the GC to remove the operator's Pod")
    print(f"install {installed:.2f}s, uninstall (with GC) {time.monotonic() - started:.2f}s")
    assert cluster.get("CustomResourceDefinition", CRD_NAME) is not None  # Helm never deletes crds/


def test_the_operators_network_policy_is_kept_and_selects_only_the_operator_pod(cluster, crd, new_namespace):
    """Issue 35: the chart's opt-in NetworkPolicy (metrics on, scrapes from a monitoring namespace,
    egress rules) is stored as rendered, and its selector finds the operator's Pod and nothing else."""
    values = {"metrics": {"enabled": True}, "networkPolicy": {
        "enabled": True, "metricsFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        "egress": [{"ports": [{"protocol": "UDP", "port": 53}]}, {"to": [{"ipBlock": {"cidr": "10.96.0.1/32"}}]}]}}
    release = HelmRelease(cluster, "afd-netpol", new_namespace("afd-system"), values)
    rendered = next(o for o in release.objects if o["kind"] == "NetworkPolicy")
    release.install()
    try:
        stored = cluster.get("NetworkPolicy", rendered["metadata"]["name"], release.namespace)
        assert stored["spec"]["ingress"] == rendered["spec"]["ingress"]
        assert stored["spec"]["egress"] == rendered["spec"]["egress"]
        assert stored["spec"]["policyTypes"] == ["Ingress", "Egress"]
        selector = ",".join(f"{k}={v}" for k, v in stored["spec"]["podSelector"]["matchLabels"].items())
        pods = eventually(lambda: cluster.list("Pod", release.namespace, selector=selector), 30, "the operator's Pod")
        assert [p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods] == ["operator"]
    finally:
        release.uninstall()
    eventually(lambda: cluster.get("NetworkPolicy", rendered["metadata"]["name"], release.namespace) is None, 30,
               "uninstall to remove the NetworkPolicy")


def test_the_crd_upgrade_hook_objects_are_accepted(cluster, crd, new_namespace):
    """The pre-install/pre-upgrade hook (ServiceAccount, ClusterRole, binding, ConfigMap with the
    CRDs, Job): accepted by the API server (dry run; its Job needs a kubelet to run)."""
    import helm_python

    namespace = new_namespace("afd-hook")
    chart = helm_python.Chart.load(str(CHART))
    try:
        rendered = chart.render(None, name="afd", namespace=namespace)
    finally:
        chart.close()
    hooks = [d for name, text in rendered.items() if not name.endswith("NOTES.txt")
             for d in yaml.safe_load_all(text) if d and HOOK in (d["metadata"].get("annotations") or {})]
    assert sorted(h["kind"] for h in hooks) == ["ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job",
                                                 "ServiceAccount"]
    for hook in sorted(hooks, key=lambda d: INSTALL_ORDER.index(d["kind"])):
        cluster.apply(hook, dry_run=True)


# --- the operator, under its own ServiceAccount ---------------------------------------------


@pytest.fixture(scope="module")
def operator(cluster, crd, tmp_path_factory):
    """The chart installed, and `afd operator` run with a token of the chart's ServiceAccount
    (TokenRequest API), not the admin's credentials. Yields (cluster as the operator, log path)."""
    release = HelmRelease(cluster, "afd", cluster.new_namespace("afd-system"))
    process = None
    try:
        release.install()
        tmp = tmp_path_factory.mktemp("operator")
        kubeconfig = cluster.token_kubeconfig("afd-afd-operator", release.namespace, tmp / "kubeconfig")
        log = tmp / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as out:
            process = subprocess.Popen([sys.executable, "-m", "afd_operator", "run", "--resync-seconds", "2"],
                                       env=env, stdout=out, stderr=subprocess.STDOUT)
        yield Cluster(kubeconfig), log
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            print(f"operator log: {log}")
        release.uninstall()
        cluster.delete("Namespace", release.namespace)


def test_the_operator_runs_as_its_service_account_not_as_admin(cluster, operator):
    as_operator, _ = operator
    assert cluster.whoami() != as_operator.whoami()
    namespace = operator_namespace(as_operator)
    assert as_operator.whoami() == f"system:serviceaccount:{namespace}:afd-afd-operator"
    with pytest.raises(ApiError) as err:  # e.g. it cannot list Secrets, nor touch Deployments
        as_operator.list("Deployment", namespace)
    assert err.value.status == 403


def operator_namespace(as_operator: Cluster) -> str:
    return as_operator.whoami().split(":")[2]


@pytest.fixture(scope="module")
def deployment(cluster, operator):
    """The CPU sample, created by the admin in its own namespace for the operator to reconcile."""
    namespace = cluster.new_namespace("afd-app")
    try:
        body = yaml.safe_load(next(p for p in SAMPLES if p.name == "cpu-zmq-tiny.yaml").read_text())
        body["metadata"]["namespace"] = namespace
        yield namespace, cluster.create(body)
    finally:
        cluster.delete("Namespace", namespace)


def _children(cluster, namespace, kind, name="tiny-cpu"):
    return cluster.list(kind, namespace, selector=f"afd.io/name={name}")


def _condition(cr, type_):
    return next((c for c in (cr.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def test_the_operator_reconciles_a_sample_into_owned_children(cluster, deployment):
    namespace, created = deployment
    started = time.monotonic()
    sts = eventually(lambda: len(_children(cluster, namespace, "StatefulSet")) == 2
                     and _children(cluster, namespace, "StatefulSet"), 60, "two StatefulSets")
    print(f"StatefulSets {time.monotonic() - started:.2f}s after the CR was created")
    assert sorted(s["metadata"]["name"] for s in sts) == ["tiny-cpu-g0-attn", "tiny-cpu-g0-ffn"]
    services = eventually(lambda: len(_children(cluster, namespace, "Service")) == 3
                          and _children(cluster, namespace, "Service"), 30, "three Services")
    assert sorted(s["metadata"]["name"] for s in services) == ["tiny-cpu", "tiny-cpu-g0-attn", "tiny-cpu-g0-ffn"]
    config_maps = _children(cluster, namespace, "ConfigMap")
    assert config_maps
    attention = next(s for s in sts if s["metadata"]["name"] == "tiny-cpu-g0-attn")
    env = {e["name"]: e.get("value") for e in attention["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AFD_SERVED_MODEL_NAME"] == "afd-test/tiny-qwen3-moe"  # the hub id, not "models"
    owned = sts + services + config_maps + _children(cluster, namespace, "Secret")
    for obj in owned:
        [ref] = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "AFDDeployment", "tiny-cpu", created["metadata"]["uid"], True), obj["metadata"]["name"]

    # The StatefulSet controller creates every rank's Pod (Parallel); no kubelet runs them.
    pods = eventually(lambda: len(_children(cluster, namespace, "Pod")) == 3
                      and _children(cluster, namespace, "Pod"), 60, "three Pods")
    assert sorted(p["metadata"]["name"] for p in pods) == ["tiny-cpu-g0-attn-0", "tiny-cpu-g0-attn-1",
                                                           "tiny-cpu-g0-ffn-0"]
    assert {p["status"]["phase"] for p in pods} == {"Pending"}
    print(f"3 Pods {time.monotonic() - started:.2f}s after the CR was created")

    cr = eventually(lambda: (c := cluster.get("AFDDeployment", "tiny-cpu", namespace)).get("status", {})
                    .get("conditions") and c, 30, "status conditions")
    assert _condition(cr, "Ready")["status"] == "False"
    assert _condition(cr, "Ready")["reason"] == "GroupsNotReady"
    assert (cr["status"]["topology"], cr["status"]["groupsReady"]) == ("2A1F", "0/1")
    assert cr["status"]["observedGeneration"] == cr["metadata"]["generation"]


def _kubectl(cluster, *args):
    kubectl = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl is not on the PATH (or KUBECTL)")
    return subprocess.run([kubectl, "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=60, check=True).stdout


def test_kubectl_scale_adds_and_removes_groups(cluster, deployment):
    namespace, _ = deployment
    assert "scaled" in _kubectl(cluster, "-n", namespace, "scale", "afd/tiny-cpu", "--replicas=2")
    sts = eventually(lambda: len(_children(cluster, namespace, "StatefulSet")) == 4
                     and _children(cluster, namespace, "StatefulSet"), 60, "four StatefulSets")
    assert {s["metadata"]["labels"]["afd.io/group"] for s in sts} == {"0", "1"}
    eventually(lambda: len(_children(cluster, namespace, "Pod")) == 6, 60, "six Pods")
    eventually(lambda: (cluster.get("AFDDeployment", "tiny-cpu", namespace)["status"].get("replicas") == 2),
               30, "status.replicas 2")
    scale = cluster.call("GET", f"/apis/afd.io/v1alpha1/namespaces/{namespace}/afddeployments/tiny-cpu/scale")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (2, 2)
    assert scale["status"]["selector"] == "afd.io/name=tiny-cpu,afd.io/role=attention"

    _kubectl(cluster, "-n", namespace, "scale", "afd/tiny-cpu", "--replicas=1")
    eventually(lambda: len(_children(cluster, namespace, "StatefulSet")) == 2, 60, "back to two StatefulSets")
    eventually(lambda: len(_children(cluster, namespace, "Pod")) == 3, 60, "the GC to remove group 1's Pods")


def test_a_spec_change_rolls_the_group(cluster, deployment):
    namespace, _ = deployment
    before = cluster.get("AFDDeployment", "tiny-cpu", namespace)["status"]["updateRevision"]
    new_image = "registry.example/afd-runtime:0.2.0"
    cluster.merge_patch("AFDDeployment", "tiny-cpu", namespace, {"spec": {"image": new_image}})

    def rolled():
        cr = cluster.get("AFDDeployment", "tiny-cpu", namespace)
        revision = cr["status"].get("updateRevision")
        pods = _children(cluster, namespace, "Pod")
        return (revision != before and len(pods) == 3
                and {p["metadata"]["labels"]["afd.io/revision"] for p in pods} == {revision}
                and {c["image"] for p in pods for c in p["spec"]["containers"]} == {new_image} and revision)

    revision = eventually(rolled, 90, "every Pod at the new revision and image")
    for sts in _children(cluster, namespace, "StatefulSet"):
        assert sts["spec"]["template"]["metadata"]["labels"]["afd.io/revision"] == revision


def test_deleting_the_resource_lets_the_garbage_collector_remove_everything(cluster, deployment):
    namespace, _ = deployment
    started = time.monotonic()
    cluster.delete("AFDDeployment", "tiny-cpu", namespace)

    def gone():
        return not any(_children(cluster, namespace, kind)
                       for kind in ("StatefulSet", "Service", "ConfigMap", "Secret", "Pod"))

    eventually(gone, 90, "the GC to remove every child")
    print(f"everything gone {time.monotonic() - started:.2f}s after the delete")


def test_the_operator_was_never_forbidden(operator, deployment):
    """Its RBAC covers all it did. (Other 403s can appear: CRs of the sample tests whose
    namespaces are still terminating, "unable to create new content in namespace".)"""
    namespace, _ = deployment
    _, log = operator
    text = log.read_text()
    denied = [line for line in text.splitlines() if "cannot " in line and "system:serviceaccount:" in line]
    assert denied == [], "\n".join(denied[:20])
    ours = [line for line in text.splitlines() if namespace in line and (" WARNING " in line or " ERROR " in line)]
    assert ours == [], "\n".join(ours[:20])
    # it did the work: the create, then the scales and the image change (kopf may merge the
    # last two into one update when they come close together)
    assert text.count("Handler 'build_registry.<locals>.on_change' succeeded") == 1, text[-3000:]
    assert text.count("Handler 'build_registry.<locals>.on_change/spec' succeeded") >= 2, text[-3000:]


def test_an_autoscaled_sample_starts_at_min_groups_and_its_status_is_kept(cluster, operator, new_namespace):
    """The operator's status.autoscaling and kubectl scale's refusal against the real API server
    (fields the CRD did not declare would be pruned silently). No pod runs: no metrics to judge.
    Last in the file: test_the_operator_was_never_forbidden counts the creates it saw."""
    namespace = new_namespace("afd-scaled")
    body = yaml.safe_load(next(p for p in SAMPLES if p.name == "cpu-zmq-tiny-autoscaling.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"]["autoscaling"]["minGroups"] = 2
    cluster.create(body)
    name = body["metadata"]["name"]
    eventually(lambda: len(_children(cluster, namespace, "StatefulSet", name)) == 4, 60, "two groups (minGroups)")
    state = eventually(lambda: ((s := cluster.get("AFDDeployment", name, namespace).get("status", {}).get("autoscaling"))
                                and s["currentGroups"] == 2 and s), 30, "status.autoscaling with both groups")
    assert state["desiredGroups"] == 2
    assert state["reason"] == "holding: 2 group(s) warming up" and "observed" not in state  # no pod runs: nothing read
    with pytest.raises(subprocess.CalledProcessError) as err:
        _kubectl(cluster, "-n", namespace, "scale", f"afd/{name}", "--replicas=3")
    assert "spec.replicas cannot change while spec.autoscaling.enabled is true" in err.value.stderr

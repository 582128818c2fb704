"""Rendering: golden files, the pod contract with the runtime, Kubernetes validity."""

from __future__ import annotations

import os
from urllib.parse import parse_qs

import kubernetes_validate
import pytest
import yaml

from afd import config as afd_config
from afd_operator.model import labels as L
from afd_operator.model.spec import DEFAULT_SHUTDOWN_GRACE_S, SpecError, parse_owner, parse_spec
from afd_operator.rendering.children import dump_yaml, render_all, render_group
from afd_operator.rendering.pod import DRAIN_SECONDS, termination_grace_seconds
from op_testkit import GOLDEN, ROOT, make_cr

NEWEST = kubernetes_validate.utils.latest_version()
# Kinds from other projects' CRDs: kubernetes-validate has no schema for them.
FOREIGN_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("scheduling.volcano.sh/v1beta1", "PodGroup"),
                 ("scheduling.x-k8s.io/v1alpha1", "PodGroup")}


def _sample(name):
    body = yaml.safe_load((ROOT / "crds" / "samples" / name).read_text())
    body["metadata"].update(namespace="ns", uid="uid-" + body["metadata"]["name"])
    return body


CASES = {
    "1g-4a2f-nccl": _sample("gpu-nccl-dsv2-lite.yaml"),
    "1g-2a1f-zmq-hf-cpu": _sample("cpu-zmq-tiny.yaml"),
    "3g-3a2f-nccl-volcano-pdb-podmonitor": _sample("gpu-production.yaml"),
    "2g-3a2f-zmq-coscheduling-hostpath": make_cr(
        name="canary", replicas=2, ffn={"ranks": 2}, model={"uri": "/mnt/models/qwen3-moe"},
        attention={"ranks": 3, "env": [{"name": "AFD_PEER_TIMEOUT_S", "value": "30"}]},
        gangScheduling={"enabled": True, "scheduler": "scheduler-plugins", "timeoutSeconds": 120},
        placement={"topologyKey": "kubernetes.io/hostname"},
    ),
    "1g-2a1f-zmq-vllm": make_cr(
        name="vllm", afd={"attentionEngine": "vllm", "attentionImage": "registry.example/afd-vllm:0.1.0",
                          "vllmArgs": ["--enforce-eager", "--max-num-seqs", "32"]},
    ),
    "1g-3a2f-nccl-ep2-gang": make_cr(
        name="ep", attention={"ranks": 3}, ffn={"ranks": 2, "expertParallel": 2}, afd={"connector": "nccl"},
        gangScheduling={"enabled": True, "scheduler": "volcano"},
    ),
    "1g-2a1f-zmq-netpol-uid": make_cr(
        name="locked", networkPolicy={"enabled": True}, podSecurity={"runAsUser": 2000, "runAsGroup": 3000,
                                                                      "fsGroup": 4000},
    ),
}


def _render(body):
    return render_all(parse_spec(body["spec"]), parse_owner(body))


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden(case):
    text = dump_yaml(_render(CASES[case]))
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("AFD_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}: run with AFD_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"{path.name} differs: if intended, regenerate with AFD_UPDATE_GOLDEN=1"


@pytest.mark.parametrize("version", ["1.30", NEWEST])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_manifest_is_valid_kubernetes(case, version):
    for obj in _render(CASES[case]):
        if (obj["apiVersion"], obj["kind"]) in FOREIGN_KINDS:
            assert obj["metadata"]["ownerReferences"] and obj["spec"]
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} invalid for {version}: {err.message}")


def test_an_expert_parallel_ffn_rank_is_one_pod_per_shard():
    """3A2F with 2 shards per FFN rank: 4 FFN pods (ordinal rank·2 + shard), all in the gang."""
    objs = {(o["kind"], o["metadata"]["name"]): o for o in _render(CASES["1g-3a2f-nccl-ep2-gang"])}
    assert objs[("StatefulSet", "ep-g0-ffn")]["spec"]["replicas"] == 4
    assert objs[("StatefulSet", "ep-g0-attn")]["spec"]["replicas"] == 3
    assert objs[("PodGroup", "ep-g0")]["spec"]["minMember"] == 7
    env = {e["name"]: e.get("value") for e in
           objs[("StatefulSet", "ep-g0-ffn")]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["AFD_FFN_EXPERT_PARALLEL"] == "2" and env["AFD_NUM_FFN_RANKS"] == "2"


def test_children_count_and_names():
    objs = _render(CASES["3g-3a2f-nccl-volcano-pdb-podmonitor"])
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    per_group = lambda g: [("ConfigMap", f"qwen3-moe-g{g}-config"), ("PodGroup", f"qwen3-moe-g{g}"),
                           ("NetworkPolicy", f"qwen3-moe-g{g}-attn"), ("NetworkPolicy", f"qwen3-moe-g{g}-ffn"),
                           ("Service", f"qwen3-moe-g{g}-attn"), ("Service", f"qwen3-moe-g{g}-ffn"),
                           ("StatefulSet", f"qwen3-moe-g{g}-attn"), ("StatefulSet", f"qwen3-moe-g{g}-ffn")]
    expected = [x for g in range(3) for x in per_group(g)]
    expected += [("PodDisruptionBudget", "qwen3-moe"), ("PodMonitor", "qwen3-moe"), ("Service", "qwen3-moe")]
    expected += [("Service", "qwen3-moe-ranks"), ("Deployment", "qwen3-moe-router"),  # spec.router
                 ("PodDisruptionBudget", "qwen3-moe-router"), ("PodMonitor", "qwen3-moe-router")]
    assert kinds == sorted(expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_child_is_owned_and_labelled(case):
    body = CASES[case]
    for obj in _render(body):
        meta = obj["metadata"]
        assert meta["namespace"] == "ns"
        [ref] = meta["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "AFDDeployment", body["metadata"]["name"], body["metadata"]["uid"], True)
        assert meta["labels"][L.NAME] == body["metadata"]["name"]
        if obj["kind"] in ("StatefulSet", "ConfigMap") or meta["name"].endswith(("-attn", "-ffn")):
            assert {L.GROUP, L.REVISION} <= set(meta["labels"])


def test_group_objects_are_ordered_for_rendezvous():
    """ConfigMap and headless Services exist before any pod; FFN listeners before attention."""
    body = CASES["1g-4a2f-nccl"]
    kinds = [(o["kind"], o["metadata"]["name"].rsplit("-", 1)[-1])
             for o in render_group(parse_spec(body["spec"]), parse_owner(body), 0, "r1")]
    assert kinds == [("ConfigMap", "config"), ("Service", "attn"), ("Service", "ffn"),
                     ("StatefulSet", "ffn"), ("StatefulSet", "attn")]


def test_statefulsets_and_services_fit_together():
    for obj in _render(CASES["1g-4a2f-nccl"]):
        if obj["kind"] != "StatefulSet":
            continue
        spec = obj["spec"]
        assert spec["podManagementPolicy"] == "Parallel"
        assert spec["updateStrategy"] == {"type": "OnDelete"}  # never roll one rank alone
        template_labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= template_labels.items()
        assert L.REVISION not in spec["selector"]["matchLabels"]  # selectors are immutable
    services = {o["metadata"]["name"]: o for o in _render(CASES["1g-4a2f-nccl"]) if o["kind"] == "Service"}
    assert services["dsv2-lite-g0-ffn"]["spec"]["publishNotReadyAddresses"] is True
    assert services["dsv2-lite-g0-ffn"]["spec"]["clusterIP"] == "None"
    client = services["dsv2-lite"]["spec"]
    assert client["selector"] == {L.ROUTER: "dsv2-lite"}  # the sample's router takes the clients
    assert services["dsv2-lite-ranks"]["spec"]["selector"] == {L.NAME: "dsv2-lite", L.ROLE: "attention"}


def _pods(body):
    for obj in _render(body):
        if obj["kind"] == "StatefulSet":
            yield obj, obj["spec"]["template"]["spec"]["containers"][0]


def _engine(case) -> str:
    return CASES[case]["spec"].get("afd", {}).get("attentionEngine", "afd")


@pytest.mark.parametrize("case", sorted(CASES))
def test_probes_use_the_runtime_health_ports(case):
    for sts, container in _pods(CASES[case]):
        role = sts["metadata"]["labels"][L.ROLE]
        port = "http" if role == "attention" and _engine(case) == "vllm" else "metrics"
        assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": port}
        assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": port}
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
        assert port in {p["name"] for p in container["ports"]}


@pytest.mark.parametrize("case", sorted(c for c in CASES if _engine(c) == "afd"))
def test_a_degraded_attention_rank_is_unready_within_a_second_but_stays_alive(case):
    """Issue 22: readiness follows the FFN link (probed every second, one failure is enough);
    liveness is another endpoint, so a rank waiting for its FFN is never restarted."""
    for sts, container in _pods(CASES[case]):
        if sts["metadata"]["labels"][L.ROLE] != "attention":
            continue
        ready, live = container["readinessProbe"], container["livenessProbe"]
        assert ready["periodSeconds"] == 1 and ready["failureThreshold"] == 1
        assert live["httpGet"] == {"path": "/live", "port": "metrics"}
        assert live["httpGet"]["path"] != ready["httpGet"]["path"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 15  # tolerant: a stuck engine, not a blip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wedged_ffn_rank_is_restarted(case):
    """Issue 35: FFN pods are probed on /live (503 once the worker loop stops coming round), as
    tolerant as the attention pods' probe; readiness stays on /health."""
    ffn = [container for sts, container in _pods(CASES[case]) if sts["metadata"]["labels"][L.ROLE] == "ffn"]
    assert ffn
    for container in ffn:
        live = container["livenessProbe"]
        assert live["httpGet"] == {"path": "/live", "port": "metrics"}
        assert live["periodSeconds"] * live["failureThreshold"] >= 15 and live["timeoutSeconds"] >= 5
        assert container["readinessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("case", sorted(CASES))
def test_role_pods_mount_no_service_account_token(case):
    """Issue 35: no role container talks to the Kubernetes API, so no pod carries a token, even
    with a spec.serviceAccountName (workload identity injects its own projected token)."""
    for obj in _render(CASES[case]):
        if obj["kind"] == "StatefulSet":
            assert obj["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def _containers(body):
    for obj in _render(body):
        if obj["kind"] == "StatefulSet":
            pod = obj["spec"]["template"]["spec"]
            yield from pod.get("initContainers", []) + pod["containers"]


def test_the_model_download_container_has_requests_and_limits():
    """Issue 35: a namespace whose ResourceQuota requires requests and limits refuses a pod any of
    whose containers lacks them, the hf:// download init container included; the spec may set them."""
    downloads = [c for c in _containers(CASES["1g-2a1f-zmq-hf-cpu"]) if c["name"] == "model-download"]
    assert len(downloads) == 2  # the pod templates of both roles
    for container in downloads:
        assert set(container["resources"]["requests"]) >= {"cpu", "memory"}
        assert set(container["resources"]["limits"]) >= {"cpu", "memory"}
    own = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": 4, "memory": "8Gi"}}
    body = make_cr(model={"uri": "hf://org/name", "downloadResources": own})
    downloads = [c for c in _containers(body) if c["name"] == "model-download"]
    assert downloads and all(c["resources"] == {"requests": {"cpu": "1", "memory": "1Gi"},
                                                 "limits": {"cpu": "4", "memory": "8Gi"}} for c in downloads)


@pytest.mark.parametrize("path", sorted((ROOT / "crds" / "samples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_sample_pod_requests_cpu_and_memory_and_limits_memory(path):
    """Issue 35: the GPU samples requested no memory, so the scheduler placed their pods by GPUs
    alone; every container of every sample now requests CPU and memory and has a memory limit."""
    for container in _containers(_sample(path.name)):
        resources = container.get("resources", {})
        assert set(resources.get("requests", {})) >= {"cpu", "memory"}, (path.name, container["name"])
        assert "memory" in resources.get("limits", {}), (path.name, container["name"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods_drain_before_they_stop(case):
    """preStop: the pod leaves the Service (readiness 503) and serves on; the grace period covers
    the drain plus the runtime's shutdown grace; the FFN outlives its attention ranks."""
    graces = {}
    for sts, container in _pods(CASES[case]):
        role = sts["metadata"]["labels"][L.ROLE]
        pre_stop = container["lifecycle"]["preStop"]
        grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        graces[role] = grace
        if role == "attention" and _engine(case) == "vllm":
            assert pre_stop == {"sleep": {"seconds": DRAIN_SECONDS}}
            drain = DRAIN_SECONDS
        else:
            assert pre_stop["httpGet"]["port"] == "metrics"
            path, _, query = pre_stop["httpGet"]["path"].partition("?")
            assert path == "/drain"
            drain = float(parse_qs(query)["seconds"][0])
            assert drain >= DRAIN_SECONDS
        assert grace >= drain
        if role == "attention":
            assert grace >= drain + afd_config.AFDConfig().process.shutdown_grace_s
    assert graces["ffn"] > graces["attention"]


def test_the_grace_period_follows_the_attention_shutdown_grace():
    spec = parse_spec(make_cr(attention={"env": [{"name": "AFD_SHUTDOWN_GRACE_S", "value": "120"}]})["spec"])
    assert termination_grace_seconds(spec, "attention") >= DRAIN_SECONDS + 120
    assert termination_grace_seconds(parse_spec(make_cr()["spec"]), "attention") < DRAIN_SECONDS + 120
    assert DEFAULT_SHUTDOWN_GRACE_S == afd_config.AFDConfig().process.shutdown_grace_s  # the operator knows the default
    with pytest.raises(SpecError, match="AFD_SHUTDOWN_GRACE_S='soon': not a number"):
        parse_spec(make_cr(attention={"env": [{"name": "AFD_SHUTDOWN_GRACE_S", "value": "soon"}]})["spec"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_pods_configure_the_runtime_through_afd_config(case, tmp_path):
    """The contract, end to end: the runtime's own loader reads what the operator renders."""
    body = CASES[case]
    spec = parse_spec(body["spec"])
    objs = _render(body)
    config_maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    for sts, container in _pods(body):
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        unknown = {k for k in env if k.startswith("AFD_")} - set(afd_config.ENV_VARS)
        assert unknown == {"AFD_CONFIG_FILE"}
        group = sts["metadata"]["labels"][L.GROUP]
        config_file = tmp_path / f"g{group}.yaml"
        config_file.write_text(config_maps[f"{body['metadata']['name']}-g{group}-config"]["data"]["afd.yaml"])
        role = sts["metadata"]["labels"][L.ROLE]
        for ordinal in range(sts["spec"]["replicas"]):
            env.update(HOSTNAME=f"{sts['metadata']['name']}-{ordinal}", AFD_CONFIG_FILE=str(config_file))
            cfg = afd_config.load_config(env=env)
            g = cfg.group
            shards = spec.ffn.expert_parallel
            rank, shard = divmod(ordinal, shards) if role == "ffn" else (ordinal, 0)
            assert (g.role, g.rank, g.ffn_shard, g.ffn_expert_parallel) == (role, rank, shard, shards)
            if role == "ffn":  # attention finds this pod as shard `shard` of FFN rank `rank`
                assert g.own_endpoint == ordinal
            assert g.topology == spec.topology
            assert cfg.link.connector == spec.afd.connector and cfg.split.stages == spec.afd.stages
            ffn = f"{body['metadata']['name']}-g{group}-ffn"
            assert cfg.link.ffn_host(1) == f"{ffn}-1.{ffn}.ns.svc"  # the FFN pod's DNS via its headless Service
            assert cfg.load.dtype == spec.afd.dtype and cfg.scheduler.max_num_seqs == spec.afd.max_num_seqs
            assert cfg.split.dbo_min_tokens == spec.afd.dbo_min_tokens
            assert (cfg.scheduler.max_num_batched_tokens, cfg.kv.kv_cache_bytes, cfg.kv.gpu_memory_utilization) == (
                spec.afd.max_num_batched_tokens, spec.afd.kv_cache_bytes, spec.afd.gpu_memory_utilization)
            assert cfg.scheduler.prefill_itl_ratio == spec.afd.prefill_itl_ratio
            assert g.group_token.startswith(f"{body['metadata']['name']}-g{group}-")
            assert cfg.api.served_model_name == (spec.served_model_name or spec.model.default_served_name)


def test_model_sources_become_volumes():
    def pod(uri, **model):
        body = make_cr(model={"uri": uri, **model})
        sts = next(o for o in _render(body) if o["kind"] == "StatefulSet")
        return sts["spec"]["template"]["spec"]

    spec = pod("pvc://models/DeepSeek-V2-Lite")
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in spec["volumes"]
    assert {"name": "AFD_MODEL", "value": "/models/DeepSeek-V2-Lite"} in spec["containers"][0]["env"]
    spec = pod("hf://org/name@v2", secretRef={"name": "hub"})
    [init] = spec["initContainers"]
    assert init["command"] == ["hf", "download", "org/name", "--local-dir", "/models/org/name", "--revision", "v2"]
    hf_token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert hf_token["valueFrom"]["secretKeyRef"] == {"name": "hub", "key": "HF_TOKEN"}
    spec = pod("/data/ckpt")
    assert {"name": "model", "hostPath": {"path": "/data/ckpt", "type": "Directory"}} in spec["volumes"]


@pytest.mark.parametrize("change, served", [
    ({"model": {"uri": "pvc://models/DeepSeek-V2-Lite"}}, "DeepSeek-V2-Lite"),
    ({"model": {"uri": "pvc://tiny"}}, "tiny"),
    ({"model": {"uri": "hf://Qwen/Qwen3-30B-A3B@main"}}, "Qwen/Qwen3-30B-A3B"),
    ({"model": {"uri": "/data/ckpt/"}}, "ckpt"),
    ({"model": {"uri": "pvc://models/x"}, "servedModelName": "deepseek-ai/DeepSeek-V2-Lite"},
     "deepseek-ai/DeepSeek-V2-Lite"),
])
def test_the_served_model_name_is_the_models_name_not_the_mount(change, served):
    """Clients ask for the model by name; the mount's basename ("models") is no name (issue 22)."""
    for _, container in _pods(make_cr(**change)):
        assert {"name": "AFD_SERVED_MODEL_NAME", "value": served} in container["env"]


def test_naming_the_served_model_starts_a_rollout():
    named = parse_spec(make_cr(servedModelName="tiny")["spec"])
    assert named.revision != parse_spec(make_cr()["spec"]).revision


def test_gang_scheduling_and_placement():
    body = CASES["2g-3a2f-zmq-coscheduling-hostpath"]
    objs = _render(body)
    group = next(o for o in objs if o["kind"] == "PodGroup" and o["metadata"]["name"] == "canary-g1")
    assert group["spec"] == {"minMember": 5, "scheduleTimeoutSeconds": 120}
    sts = next(o for o in objs if o["metadata"]["name"] == "canary-g1-ffn" and o["kind"] == "StatefulSet")
    template = sts["spec"]["template"]
    assert template["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"] == "canary-g1"
    assert template["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    term = template["spec"]["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == {L.NAME: "canary", L.GROUP: "1"}


def _millicpu(quantity) -> int:
    text = str(quantity)
    return int(text[:-1]) if text.endswith("m") else int(float(text) * 1000)


def _pod_cpu_request(pod) -> int:
    """The scheduler's view: max(sum of containers, largest init container)."""
    def request(c):
        return _millicpu(c.get("resources", {}).get("requests", {}).get("cpu", "0"))

    return max([sum(request(c) for c in pod["containers"])] + [request(c) for c in pod.get("initContainers", [])])


def test_the_cpu_sample_fits_a_2_cpu_node():
    """Issue 22: the sample asked for 3 CPUs. Its pods plus the operator's (100m) must fit 2 CPUs,
    with room for the node's own daemons."""
    objs = _render(_sample("cpu-zmq-tiny.yaml"))
    total = sum(sts["spec"]["replicas"] * _pod_cpu_request(sts["spec"]["template"]["spec"])
                for sts in objs if sts["kind"] == "StatefulSet")
    assert total + 100 <= 1700, f"{total}m"


def test_the_prefill_itl_ratio_reaches_the_runtime_only_when_set():
    def runtime_of(afd):
        config_map = next(o for o in _render(make_cr(afd=afd)) if o["kind"] == "ConfigMap")
        return yaml.safe_load(config_map["data"]["afd.yaml"])

    assert "prefill_itl_ratio" not in runtime_of({})  # existing groups' config and revision stay as they were
    runtime = runtime_of({"prefillItlRatio": 2})  # the default is 0 (off): a ratio turns the pacer on
    assert runtime["prefill_itl_ratio"] == 2
    assert afd_config.AFDConfig(**runtime).scheduler.prefill_itl_ratio == 2


def test_prefix_caching_off_reaches_the_runtime_only_when_set():
    def runtime_of(afd):
        config_map = next(o for o in _render(make_cr(afd=afd)) if o["kind"] == "ConfigMap")
        return yaml.safe_load(config_map["data"]["afd.yaml"])

    assert "prefix_caching" not in runtime_of({}) and afd_config.AFDConfig().kv.prefix_caching  # on by default
    runtime = runtime_of({"prefixCaching": False})
    assert runtime["prefix_caching"] is False and not afd_config.AFDConfig(**runtime).kv.prefix_caching


def test_api_servers_reach_the_runtime_as_api_processes_only_when_set():
    def runtime_of(afd):
        config_map = next(o for o in _render(make_cr(afd=afd)) if o["kind"] == "ConfigMap")
        return yaml.safe_load(config_map["data"]["afd.yaml"])

    assert "api_process" not in runtime_of({}) and "api_servers" not in runtime_of({})  # revision unchanged
    runtime = runtime_of({"apiServers": 3})
    assert (runtime["api_process"], runtime["api_servers"]) == (True, 3)
    config = afd_config.AFDConfig(**runtime)
    assert config.api.api_children == 3

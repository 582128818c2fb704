"""What the chart copies from elsewhere stays equal to its source: CRDs, the operator's RBAC,
the CRD upgrade path; and the dashboards mechanism renders every JSON file it is given."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from chartkit import (
    ALL_FEATURES, CHART_DIR, FULLNAME, NAMESPACE, ROOT, by_kind, load_chart, one, permissions, render,
    render_objects, source_rbac,
)

helm_python = pytest.importorskip("helm_python", reason="helm-python-sdk (dev extra) is not installed")

CRD_FILES = sorted((ROOT / "crds").glob("*.yaml"))


# --- CRDs -------------------------------------------------------------------------------------

def test_sync_script_reports_the_chart_copies_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "sync_chart.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, f"{result.stderr}(run: python scripts/sync_chart.py)"


def test_sync_script_detects_and_repairs_a_stale_copy(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import sync_chart
    finally:
        sys.path.pop(0)
    fake_root = tmp_path / "repo"
    for rel in ("crds", "operator/afd_operator", "charts/afd-operator"):
        (fake_root / rel).mkdir(parents=True)
    shutil.copy(ROOT / "operator/afd_operator/rbac.yaml", fake_root / "operator/afd_operator/rbac.yaml")
    for src in CRD_FILES:
        shutil.copy(src, fake_root / "crds" / src.name)
    monkeypatch.setattr(sync_chart, "ROOT", fake_root)
    monkeypatch.setattr(sync_chart, "CHART", fake_root / "charts/afd-operator")
    assert len(sync_chart.stale()) == len(CRD_FILES) + 1  # nothing copied yet
    sync_chart.sync()
    assert sync_chart.stale() == []
    crd = fake_root / "crds" / CRD_FILES[0].name
    crd.write_text(crd.read_text() + "# changed\n")
    (fake_root / "charts/afd-operator/crds/old.yaml").write_text("{}\n")
    assert sorted(sync_chart.stale()) == sorted([
        f"charts/afd-operator/crds/{crd.name} differs from crds/{crd.name}",
        "charts/afd-operator/crds/old.yaml has no source in crds/",
    ])
    sync_chart.sync()
    assert sync_chart.stale() == [] and not (fake_root / "charts/afd-operator/crds/old.yaml").exists()


def test_helm_installs_exactly_the_canonical_crds():
    chart = load_chart()
    try:
        helm_crds = {f["name"]: f["data"] for f in chart.crds}
    finally:
        chart.close()
    assert helm_crds, "Helm sees no CRDs in the chart"
    assert {name.removeprefix("crds/"): data for name, data in helm_crds.items()} == {
        p.name: p.read_text() for p in CRD_FILES}


def test_crd_upgrade_hook_applies_the_chart_crds_before_install_and_upgrade():
    objs = render_objects()
    hooks = [o for o in objs if "helm.sh/hook" in o["metadata"].get("annotations", {})]
    assert {o["kind"] for o in hooks} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Job"}
    for obj in hooks:
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
        assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"]
    weight = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in hooks}
    assert all(weight[k] < weight["Job"] for k in weight if k != "Job")  # RBAC and data exist before the Job
    config = one(hooks, "ConfigMap")
    assert config["data"] == {p.name: p.read_text().rstrip("\n") for p in CRD_FILES}
    job = one(hooks, "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["afd-apply-crds"] and "--dir=/crds" in container["args"]
    assert container["image"] == one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert {"name": "crds", "configMap": {"name": config["metadata"]["name"]}} in pod["volumes"]
    assert pod["serviceAccountName"] == f"{FULLNAME}-crd-upgrade" and pod["restartPolicy"] == "Never"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    role = one(hooks, "ClusterRole")
    names = sorted(yaml.safe_load(p.read_text())["metadata"]["name"] for p in CRD_FILES)
    assert role["rules"] == [
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["create"]},
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["get", "patch"],
         "resourceNames": names},
    ]
    assert not [o for o in render_objects({"crds": {"upgradeJob": {"enabled": False}}})
                if "crd-upgrade" in o["metadata"]["name"]]


def test_documented_manual_crd_upgrade_command_points_at_the_chart_copy():
    """The manual path (NOTES.txt, chart README, the hook's comment) applies charts/afd-operator/crds/,
    which is the same content as crds/."""
    command = "kubectl apply --server-side --force-conflicts -f charts/afd-operator/crds/"
    for doc in (CHART_DIR / "README.md", CHART_DIR / "templates" / "NOTES.txt", CHART_DIR / "templates" / "crd-upgrade.yaml"):
        assert command in doc.read_text(), f"{doc.relative_to(ROOT)} does not document the CRD upgrade command"
    target = ROOT / command.split(" -f ")[1]
    assert sorted(p.name for p in target.glob("*.yaml")) == [p.name for p in CRD_FILES]
    for p in CRD_FILES:
        assert (target / p.name).read_bytes() == p.read_bytes()


# --- RBAC: one source, operator/afd_operator/rbac.yaml -------------------------------------------

def test_cluster_wide_rbac_is_exactly_the_operators_clusterrole():
    objs = render_objects()
    role = one(objs, "ClusterRole", FULLNAME)
    assert role["rules"] == source_rbac()["afd-operator"]
    binding = one(objs, "ClusterRoleBinding", FULLNAME)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": FULLNAME}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    assert not by_kind(objs, "Role")


def test_peering_adds_exactly_the_operators_peering_rules():
    objs = render_objects({"operator": {"peering": "afd"}, "replicaCount": 2})
    source = source_rbac()
    assert one(objs, "ClusterRole", FULLNAME)["rules"] == source["afd-operator"] + source["afd-operator-peering"]


CLUSTER_SCOPED = {"customresourcedefinitions", "namespaces", "clusterkopfpeerings"}


def test_namespaced_mode_grants_the_same_permissions_split_by_scope():
    objs = render_objects(ALL_FEATURES)  # two namespaces, with peering
    source = source_rbac()
    want = permissions(source["afd-operator"] + source["afd-operator-peering"])
    cluster_role = one(objs, "ClusterRole", FULLNAME)
    roles = by_kind(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        granted = permissions(cluster_role["rules"]) | permissions(role["rules"])
        assert granted == want
        assert not {r for _, r, _ in permissions(role["rules"])} & CLUSTER_SCOPED
    assert {r for _, r, _ in permissions(cluster_role["rules"])} == CLUSTER_SCOPED
    bindings = by_kind(objs, "RoleBinding")
    assert sorted((b["metadata"]["namespace"], b["roleRef"]["kind"]) for b in bindings) == [
        ("team-a", "Role"), ("team-b", "Role")]
    assert all(b["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}] for b in bindings)


@pytest.mark.parametrize("values", [{}, ALL_FEATURES], ids=["default", "all-features"])
def test_no_wildcards_in_any_rendered_rbac(values):
    for obj in render_objects(values):
        for rule in obj.get("rules", []):
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(field, []), f"{obj['kind']}/{obj['metadata']['name']}: wildcard {field}"


def test_rbac_off_renders_no_rbac_and_uses_an_existing_service_account():
    objs = render_objects({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"}})
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")
                and "crd-upgrade" not in o["metadata"]["name"]]
    assert not [o for o in by_kind(objs, "ServiceAccount") if "crd-upgrade" not in o["metadata"]["name"]]
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


# --- Grafana dashboards -------------------------------------------------------------------------

@pytest.fixture
def chart_with_dashboards(tmp_path):
    """A copy of the chart whose dashboards/ holds exactly two fixture dashboards."""
    chart = tmp_path / "afd-operator"
    shutil.copytree(CHART_DIR, chart)
    for real in (chart / "dashboards").glob("*.json"):  # only the fixtures, whatever the chart ships
        real.unlink()
    boards = {
        "afd_overview.json": {"title": "AFD overview", "panels": [{"targets": [{"expr": "rate(afd_step_duration_seconds_count[1m])"}]}]},
        "afd-layers.json": {"title": "AFD layers", "panels": []},
    }
    for name, board in boards.items():
        (chart / "dashboards" / name).write_text(json.dumps(board, indent=2) + "\n")
    return chart, boards


def test_every_dashboard_file_becomes_a_labelled_configmap(chart_with_dashboards):
    chart, boards = chart_with_dashboards
    rendered = render({"dashboards": {"enabled": True, "namespace": "monitoring"}}, path=chart)
    maps = [o for o in yaml.safe_load_all(rendered["afd-operator/templates/dashboards.yaml"]) if o]
    assert len(maps) == len(boards)
    for cm in maps:
        assert cm["kind"] == "ConfigMap" and cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "AFD"}
        ((key, text),) = cm["data"].items()
        assert json.loads(text) == boards[key]
    assert sorted(cm["metadata"]["name"] for cm in maps) == [
        f"{FULLNAME}-dashboard-afd-layers", f"{FULLNAME}-dashboard-afd-overview"]
    assert "2 ConfigMap(s) labelled grafana_dashboard=\"1\"" in rendered["afd-operator/templates/NOTES.txt"]
    custom = render({"dashboards": {"enabled": True, "label": "grafana_dash", "labelValue": "afd", "folder": ""}}, path=chart)
    for cm in (o for o in yaml.safe_load_all(custom["afd-operator/templates/dashboards.yaml"]) if o):
        assert cm["metadata"]["labels"]["grafana_dash"] == "afd" and "annotations" not in cm["metadata"]
        assert cm["metadata"]["namespace"] == NAMESPACE


def test_dashboards_are_off_by_default(chart_with_dashboards):
    chart, _ = chart_with_dashboards
    assert not by_kind([o for o in yaml.safe_load_all(render(path=chart)["afd-operator/templates/dashboards.yaml"]) if o],
                       "ConfigMap")


def test_the_charts_own_dashboards_are_valid_json_with_unique_configmaps():
    files = sorted((CHART_DIR / "dashboards").glob("*.json"))
    for path in files:
        board = json.loads(path.read_text())
        assert board.get("title") and isinstance(board.get("panels"), list), f"{path.name} is not a Grafana dashboard"
    maps = by_kind(render_objects({"dashboards": {"enabled": True}}), "ConfigMap")
    names = [cm["metadata"]["name"] for cm in maps if cm["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert len(names) == len(set(names)) == len(files)

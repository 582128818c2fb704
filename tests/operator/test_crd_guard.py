"""The CI-side guard (scripts/check_crd.py): what a real API server checks when the CRD is
created, without an API server. The CRD passes it; each mistake that once made a real
kube-apiserver refuse the CRD (issue 14) is caught by it."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

import check_crd
from op_testkit import CRD_PATH, ROOT, SAMPLES, load_crd

CHART_CRD = ROOT / "charts" / "afd-operator" / "crds" / CRD_PATH.name


@pytest.mark.parametrize("path", [CRD_PATH, CHART_CRD], ids=["crds", "chart"])
def test_the_crd_passes_the_guard(path):
    assert check_crd.check_crd(yaml.safe_load(path.read_text()), SAMPLES) == []


def _spec_node(crd, name):
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][name]


def _problems(change):
    crd = copy.deepcopy(load_crd())
    change(crd)
    return check_crd.check_crd(crd, SAMPLES)


def test_an_empty_default_under_a_rule_is_caught():
    """The API server evaluates rules on `default: {}` as written: "no such key"."""
    problems = _problems(lambda crd: _spec_node(crd, "restartPolicy").update(default={}))
    assert len(problems) == 1
    assert ".spec.restartPolicy: rule fails on the default (as written)" in problems[0]
    assert "no such member" in problems[0] and "maxBackoffSeconds" in problems[0]


def test_an_incomplete_default_is_caught():
    problems = _problems(lambda crd: _spec_node(crd, "ports").update(default={"http": 8000}))
    assert any(".spec.ports: default {'http': 8000} is incomplete" in p for p in problems), problems


def test_a_default_that_breaks_its_own_rule_is_caught():
    def change(crd):
        _spec_node(crd, "podSecurity")["default"]["runAsUser"] = 0

    problems = _problems(change)
    assert any("the default (as written) breaks its own rule: podSecurity.runAsUser must not be 0" in p
               for p in problems), problems


def test_string_concatenation_in_a_message_expression_is_caught():
    """What the API server refused "by a factor of more than 100x"."""
    def change(crd):
        _spec_node(crd, "restartPolicy")["x-kubernetes-validations"][0]["messageExpression"] = (
            "'restartPolicy.maxBackoffSeconds (' + string(self.maxBackoffSeconds) + ') is too low'")

    problems = _problems(change)
    assert len(problems) == 1 and "joins string(...) with '+'" in problems[0]


@pytest.mark.parametrize("field, bound", [("maxBackoffSeconds", "maximum"), ("backoffSeconds", "maximum")])
def test_an_unbounded_field_in_a_message_is_caught(field, bound):
    problems = _problems(lambda crd: _spec_node(crd, "restartPolicy")["properties"][field].pop(bound))
    assert problems == [f"afddeployments.afd.io v1alpha1: .spec.restartPolicy.{field}: messageExpression "
                        f"format() uses it, so it needs {bound} (cost estimate)"]


def test_unbounded_strings_and_lists_in_rules_are_caught():
    def change(crd):
        spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        spec["x-kubernetes-validations"].append(
            {"rule": "(!has(self.afd.vllmArgs) || self.afd.vllmArgs.all(a, a != '--x')) && size(self.image) < 500",
             "message": "m"})

    problems = _problems(change)
    assert sorted(p.split(": ", 1)[1] for p in problems) == [
        ".spec.afd.vllmArgs: rule .all() uses it, so it needs maxItems (cost estimate)",
        ".spec.image: rule size() uses it, so it needs maxLength (cost estimate)",
    ]


def test_a_sample_a_rule_refuses_is_caught(tmp_path):
    sample = yaml.safe_load(SAMPLES[0].read_text())
    sample["spec"]["rollout"] = {"maxSurge": 0, "maxUnavailable": 0}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(sample))
    problems = check_crd.check_crd(load_crd(), [tmp_path / "bad.yaml"])
    assert problems == ["afddeployments.afd.io v1alpha1: bad.yaml: refused by a rule: "
                        "rollout.maxSurge and rollout.maxUnavailable must not both be 0"]


def test_the_guard_runs_as_a_script(tmp_path):
    script = ROOT / "scripts" / "check_crd.py"
    ok = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = copy.deepcopy(load_crd())
    _spec_node(bad, "rollout")["default"] = {}
    (tmp_path / "crd.yaml").write_text(yaml.safe_dump(bad))
    refused = subprocess.run([sys.executable, str(script), str(tmp_path / "crd.yaml")], capture_output=True, text=True)
    assert refused.returncode == 1 and ".spec.rollout: rule fails on the default" in refused.stdout


def test_format_in_the_checker_matches_cel():
    """The checker's stand-in for CEL's strings-library format(): %d, %s, %%, nothing else."""
    assert str(check_crd.evaluate("'a %d b %s %%'.format([3, 'x'])", {})) == "a 3 b x %"
    with pytest.raises(check_crd.RuleError):  # celpy words a function's ValueError its own way
        check_crd.evaluate("'%f'.format([1.5])", {})

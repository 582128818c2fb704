"""The typed spec: defaults, clear errors for bad CRs, and what starts a rollout."""

from __future__ import annotations

import pytest
import yaml

from afd_operator.model.spec import SpecError, parse_owner, parse_spec

from op_testkit import SAMPLES, make_cr


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_samples_parse(path):
    body = yaml.safe_load(path.read_text())
    spec = parse_spec(body["spec"])
    assert spec.topology.num_ffn <= spec.topology.num_attention


def test_the_issue_minimal_cr_parses_with_expected_defaults():
    spec = parse_spec(make_cr(attention={"ranks": 4}, ffn={"ranks": 2},
                              afd={"connector": "nccl", "stages": 2})["spec"])
    assert str(spec.topology) == "4A2F"
    assert spec.replicas == 1
    assert spec.restart_type == "None"  # the runtime rebuilds the NCCL pair in place, holding the requests
    assert spec.rollout.max_unavailable == 1 and spec.rollout.max_surge == 0
    assert spec.ports.http == 8000 and spec.ports.control == 25500


@pytest.mark.parametrize("connector", ["zmq", "nccl"])
def test_either_connector_defaults_to_runtime_recovery(connector):
    assert parse_spec(make_cr(afd={"connector": connector})["spec"]).restart_type == "None"
    chosen = make_cr(afd={"connector": connector}, restartPolicy={"type": "RecreateGroupOnRankFailure"})
    assert parse_spec(chosen["spec"]).restart_type == "RecreateGroupOnRankFailure"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"attention": {"ranks": 2}, "ffn": {"ranks": 3}}, "ffn.ranks (3) must not exceed attention.ranks (2)"),
        ({"ffn": {"ranks": 0}}, "spec.ffn.ranks: Input should be greater than or equal to 1"),
        ({"afd": {"stages": 3}}, "spec.afd.stages: Input should be 1 or 2"),
        ({"afd": {"connector": "tcp"}}, "spec.afd.connector: Input should be 'zmq' or 'nccl'"),
        ({"ports": {"control": 9090}}, "the FFN ports"),
        ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}},
         "rollout.maxSurge and rollout.maxUnavailable must not both be 0"),
        ({"restartPolicy": {"backoffSeconds": 60, "maxBackoffSeconds": 10}},
         "restartPolicy.maxBackoffSeconds (10) must not be below restartPolicy.backoffSeconds (60)"),
        ({"model": {"uri": "s3://bucket/model"}}, "expected pvc://<claim>[/dir], hf://<org>/<name>"),
        ({"attention": {"rank": 2}}, "spec.attention.rank: Extra inputs are not permitted"),
        ({"ffn": {"expertParallel": 65}}, "spec.ffn.expertParallel: Input should be less than or equal to 64"),
        ({"attention": {"expertParallel": 2}}, "spec.attention.expertParallel: Extra inputs are not permitted"),
        ({"ffn": {"expertParallel": 2}, "afd": {"attentionEngine": "vllm"}}, "ffn.expertParallel > 1 needs afd.attentionEngine=afd"),
    ],
)
def test_bad_specs_give_clear_messages(change, message):
    with pytest.raises(SpecError) as err:
        parse_spec(make_cr(**change)["spec"])
    assert message in str(err.value)


def test_missing_required_fields_are_all_reported():
    with pytest.raises(SpecError) as err:
        parse_spec({"replicas": 1})
    assert "spec.image: Field required" in str(err.value)
    assert "spec.model: Field required" in str(err.value)


def test_long_names_are_refused_before_children_get_invalid_names():
    with pytest.raises(SpecError, match="at most 40"):
        parse_owner(make_cr(name="x" * 41))


@pytest.mark.parametrize("uri, kind", [
    ("pvc://models/DeepSeek-V2-Lite", "pvc"), ("hf://org/name@v1", "hf"), ("/data/ckpt", "host"),
    ("file:///data/ckpt", "host"),
])
def test_model_sources(uri, kind):
    assert parse_spec(make_cr(model={"uri": uri})["spec"]).model.kind == kind


class TestRevision:
    """The revision decides rollouts: pod-shaping changes start one, nothing else does."""

    def rev(self, **change):
        return parse_spec(make_cr(**change)["spec"]).revision

    def test_spelled_out_defaults_do_not_change_it(self):
        assert self.rev() == self.rev(afd={"connector": "zmq", "stages": 1}, ports={"http": 8000})

    @pytest.mark.parametrize("change", [
        {"replicas": 5}, {"rollout": {"maxSurge": 2}}, {"restartPolicy": {"maxRestarts": 3}},
        {"podDisruptionBudget": {"enabled": True}}, {"monitoring": {"podMonitor": True}},
        {"networkPolicy": {"enabled": True}},
    ])
    def test_scaling_and_policies_do_not_change_it(self, change):
        assert self.rev(**change) == self.rev()

    @pytest.mark.parametrize("change", [
        {"image": "registry.example/afd-runtime:0.2.0"}, {"afd": {"stages": 2}},
        {"attention": {"ranks": 4}}, {"model": {"uri": "pvc://models/other"}},
        {"podSecurity": {"runAsUser": 2000}},
    ])
    def test_pod_changes_do(self, change):
        assert self.rev(**change) != self.rev()


def test_the_pod_contract_version_enters_the_revision(monkeypatch):
    """Pods of an older operator lack the group Secret: an upgrade must roll groups, never
    let a recreated rank (with the Secret) meet peers without it."""
    from afd_operator.model import spec as model

    before = parse_spec(make_cr()["spec"]).revision
    monkeypatch.setattr(model, "POD_CONTRACT", model.POD_CONTRACT + 1)
    assert parse_spec(make_cr()["spec"]).revision != before

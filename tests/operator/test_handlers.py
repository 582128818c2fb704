"""The operator's memory of pods (afd_operator.handlers.note_pod): nothing stays of an owner whose pods all went."""

from __future__ import annotations

from afd_operator.handlers import OperatorMemo, note_pod
from afd_operator.groups.observe import PodFacts


def facts(name: str) -> PodFacts:
    return PodFacts(name=name, group=0, role="attention", revision="r", phase="Running", ready=True, restarts=0,
                    created=0.0)


def test_an_owner_is_forgotten_once_its_last_pod_is_deleted():
    memo = OperatorMemo()
    owner, other = ("ns", "demo"), ("ns", "other")
    for name in ("demo-a-0-0", "demo-f-0-0"):
        note_pod(memo.pods, owner, "ADDED", facts(name))
    note_pod(memo.pods, other, "MODIFIED", facts("other-a-0-0"))
    note_pod(memo.pods, owner, "DELETED", facts("demo-a-0-0"))
    assert list(memo.pods[owner]) == ["demo-f-0-0"]
    note_pod(memo.pods, owner, "DELETED", facts("demo-f-0-0"))
    assert owner not in memo.pods and list(memo.pods) == [other]
    note_pod(memo.pods, owner, "DELETED", facts("demo-f-0-0"))  # a repeated deletion leaves no empty entry either
    assert owner not in memo.pods

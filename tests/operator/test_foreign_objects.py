"""A child's create answering 409: the operator takes over only its own object."""

from __future__ import annotations

import pytest

from epdserve.operator.kube import ApiError
from epdserve.operator.reconcile import ForeignObject, apply_object

OURS = [{"apiVersion": "epdserve.io/v1alpha1", "kind": "InferencePool", "name": "p", "uid": "u1"}]


class ExistingKube:
    """create answers 409; get returns `existing`; apply records what it got."""

    def __init__(self, existing: dict | None):
        self.existing, self.applied = existing, []

    def create(self, obj):
        raise ApiError(409, "already exists")

    def get(self, api_version, kind, namespace, name):
        return self.existing

    def apply(self, obj):
        self.applied.append(obj)
        return obj


def service(owners=None) -> dict:
    meta = {"name": "p", "namespace": "ns"}
    if owners is not None:
        meta["ownerReferences"] = owners
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": {}}


def test_an_own_child_with_its_labels_edited_away_is_applied():
    kube = ExistingKube(service(OURS))
    assert apply_object(kube, service(OURS), None) == "updated"
    assert kube.applied


@pytest.mark.parametrize("owners", [None, [{**OURS[0], "uid": "someone-else"}]])
def test_an_object_of_someone_else_is_left_alone_and_named(owners):
    kube = ExistingKube(service(owners))
    with pytest.raises(ForeignObject, match="Service ns/p already exists"):
        apply_object(kube, service(OURS), None)
    assert not kube.applied


def test_a_conflict_with_nothing_there_after_all_is_applied():
    kube = ExistingKube(None)  # an injected or raced 409: the object is gone again
    assert apply_object(kube, service(OURS), None) == "updated"

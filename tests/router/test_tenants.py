"""Tenant identity: the keys file, the trusted header, how they combine with --api-key, and
the bounded metric labels."""

from __future__ import annotations

import hashlib
import json

import pytest

from epdserve.router.config import RouterConfig
from epdserve.router.tenants import (
    OTHER,
    BadTenantHeader,
    Identity,
    KeyedTenantHeader,
    TenantFile,
    TenantLabels,
    TenantTable,
)

TENANTS = {
    "tenants": [
        {"name": "team-a", "weight": 3, "priority": -1, "keys": ["sk-a1", "sk-a2"]},
        {"name": "batch", "keys": ["sha256:" + hashlib.sha256(b"sk-b").hexdigest()]},
    ]
}
ENDPOINT = ("--endpoint", "http://127.0.0.1:9")


def test_a_key_names_its_tenant_with_weight_and_priority():
    table = TenantTable.parse(TENANTS)
    a = table.by_key(b"sk-a2")
    assert (a.name, a.weight, a.priority) == ("team-a", 3.0, -1)
    assert table.by_key(b"sk-b").name == "batch"  # given as its sha256 only
    assert table.by_key(b"sk-a") is None


def test_the_file_may_be_yaml_or_json(tmp_path):
    as_json, as_yaml = tmp_path / "t.json", tmp_path / "t.yaml"
    as_json.write_text(json.dumps(TENANTS))
    as_yaml.write_text("tenants:\n  - name: team-a\n    weight: 3\n    keys: [sk-a1]\n")
    assert TenantTable.load(str(as_json)).by_key(b"sk-a1").weight == 3
    assert TenantTable.load(str(as_yaml)).by_key(b"sk-a1").weight == 3


@pytest.mark.parametrize(
    ("tenants", "field"),
    [
        ([{"name": "bad name"}], "tenants[0].name"),
        ([{"name": "x" * 64}], "tenants[0].name"),
        ([{"name": "a", "weight": 0}], "tenants[0].weight"),
        ([{"name": "a", "weight": True}], "tenants[0].weight"),
        ([{"name": "a", "priority": 1.5}], "tenants[0].priority"),
        ([{"name": "a", "keys": "sk"}], "tenants[0].keys"),
        ([{"name": "a", "keys": [""]}], "tenants[0].keys[0]"),
        ([{"name": "a", "keys": ["sha256:zz"]}], "tenants[0].keys[0]"),
        ([{"name": "a", "color": 1}], "tenants[0]: unknown field"),
        ([{"name": "a"}, {"name": "a"}], "tenants[1].name"),
        ([{"name": "a", "keys": ["k"]}, {"name": "b", "keys": ["k"]}], "tenants[1].keys[0]"),
    ],
)
def test_a_bad_tenant_file_is_an_error_naming_the_field(tenants, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        TenantTable.parse({"tenants": tenants})


def test_tenant_keys_and_the_shared_key_both_open_the_router():
    ident = Identity(TenantTable.parse(TENANTS), api_key=b"shared")
    assert ident.identify(b"sk-a1", None).name == "team-a"
    assert ident.identify(b"shared", None).name == "default"
    assert ident.identify(b"wrong", None) is None
    assert ident.identify(None, None) is None


def test_the_header_names_the_tenant_only_when_configured_and_never_beats_a_key():
    table = TenantTable.parse(TENANTS)
    trusted = Identity(table, header=b"x-tenant-id", api_key=b"shared")
    assert trusted.identify(b"shared", b"team-b").name == "team-b"
    assert trusted.identify(b"sk-a1", b"batch").name == "team-a"
    assert trusted.identify(b"nope", b"batch") is None
    untrusted = Identity(table, header=None, api_key=b"shared")
    assert untrusted.identify(b"shared", b"batch").name == "default"


def test_the_shared_key_cannot_claim_a_keyed_tenant_by_header():
    trusted = Identity(TenantTable.parse(TENANTS), header=b"x-tenant-id", api_key=b"shared")
    for keyed in (b"batch", b"team-a"):
        with pytest.raises(KeyedTenantHeader, match="has its own keys"):
            trusted.identify(b"shared", keyed)
    assert trusted.identify(b"sk-b", b"team-a").name == "batch"  # its key still rules


def test_without_any_key_the_header_or_default_names_the_tenant():
    ident = Identity(TenantTable.empty(), header=b"x-tenant-id")
    assert ident.identify(None, b"gw-team").name == "gw-team"
    assert ident.identify(None, None).name == "default"
    with pytest.raises(BadTenantHeader):
        ident.identify(None, b"a{b}")


def test_metric_labels_stay_bounded_past_the_limit():
    labels = TenantLabels(configured=["team-a"], limit=3)
    names = [labels(f"t{i}") for i in range(10)]
    assert names[:3] == ["t0", "t1", "t2"] and set(names[3:]) == {OTHER}
    assert labels("t1") == "t1" and labels("team-a") == "team-a"


def test_router_config_builds_tenancy_only_when_asked(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(TENANTS))
    assert RouterConfig(endpoint=list(ENDPOINT[1:])).tenancy() is None
    tenancy = RouterConfig(
        endpoint=[ENDPOINT[1]], tenant_keys=str(keys), max_inflight_per_pod=2
    ).tenancy()
    assert tenancy.gate.max_inflight_per_pod == 2
    assert tenancy.identity.table.current().by_key(b"sk-b").name == "batch"


@pytest.mark.parametrize(
    ("options", "flag"),
    [
        ({"tenant_keys": "/nonexistent/keys.json"}, "--tenant-keys"),
        ({"tenant_header": "X Tenant"}, "--tenant-header"),
        ({"tenant_header": "Authorization"}, "--tenant-header"),
        ({"max_inflight_per_pod": -1}, "--max-inflight-per-pod"),
        ({"tenant_queue_size": 0}, "--tenant-queue-size"),
    ],
)
def test_bad_tenant_flags_name_the_flag(options, flag):
    with pytest.raises(ValueError, match=flag):
        RouterConfig(endpoint=[ENDPOINT[1]], **options)


def test_a_changed_keys_file_is_read_again_and_a_broken_one_keeps_the_last_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(TENANTS))
    errors = []
    source = TenantFile(str(path), check_s=0.0)
    source.on_error = lambda: errors.append(1)
    assert source.current().by_key(b"sk-a1").name == "team-a"
    rotated = {"tenants": [{"name": "team-a", "keys": ["sk-a-new"]}]}
    replacement = tmp_path / "next.json"  # swapped in whole, as a Secret volume does
    replacement.write_text(json.dumps(rotated))
    replacement.replace(path)
    assert source.current().by_key(b"sk-a1") is None
    assert source.current().by_key(b"sk-a-new").name == "team-a"
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    broken.replace(path)
    assert source.current().by_key(b"sk-a-new").name == "team-a"
    assert errors == [1]
    source.current()
    assert errors == [1]  # reported once per change


def test_a_keys_file_without_keys_leaves_requests_to_the_header():
    ident = Identity(TenantTable.parse({"tenants": [{"name": "gw", "weight": 5}]}), b"x-t")
    assert ident.identify(None, b"gw").weight == 5

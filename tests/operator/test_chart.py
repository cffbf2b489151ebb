"""The Helm chart: strict lint, renders, every template is valid Kubernetes (1.30, 1.33),
the CRD copy is byte-identical, RBAC covers what the operator does, the dashboard is sane."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from ipool_samples import ROOT

CHART = ROOT / "charts" / "epdserve"
SCOPED = {"watchNamespaces": ["team-a", "team-b"], "serviceMonitor": {"enabled": True}}
VALUES = [
    {},
    {
        **SCOPED,
        "verbose": True,
        "nodeSelector": {"pool": "cpu"},
        "imagePullSecrets": [{"name": "r"}],
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
        "secrets": {"readNames": ["hub-token"], "readAll": True},
    },
]
RULES = CHART / "files" / "prometheus-rules.yaml"


def render(values: dict) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name="epd", namespace="epdserve-system")
    docs = []
    for path, text in files.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def test_chart_passes_strict_lint():
    for version in ("v1.30.0", "v1.33.0"):
        result = helm.lint(CHART, strict=True, kube_version=version)
        assert result["errors"] == [] and result["messages"] == [], result


def test_chart_crd_is_byte_identical_to_the_source_of_truth():
    source = (ROOT / "crds" / "inferencepool.yaml").read_bytes()
    assert (CHART / "crds" / "inferencepool.yaml").read_bytes() == source


@pytest.mark.parametrize("values", VALUES, ids=["cluster-wide", "namespaced"])
@pytest.mark.parametrize("version", ["1.30.0", "1.33.0"])
def test_every_rendered_template_is_valid_kubernetes(values, version):
    docs = render(values)
    assert {d["kind"] for d in docs} >= {"Deployment", "ServiceAccount", "ConfigMap"}
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # prometheus-operator's CRD: not a built-in kind
        kubernetes_validate.validate(doc, version, strict=True)


def _rules(docs: list[dict], kind: str) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for d in docs
        if d["kind"] == kind
        for rule in d["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_rbac_is_namespaced_when_namespaces_are_listed():
    docs = render(SCOPED)
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted({r["metadata"]["namespace"] for r in roles}) == ["team-a", "team-b"]
    bound = {
        (b["metadata"]["namespace"], b["roleRef"]["name"])
        for b in docs
        if b["kind"] == "RoleBinding"
    }
    assert bound == {(r["metadata"]["namespace"], r["metadata"]["name"]) for r in roles}
    cluster_rules = _rules(docs, "ClusterRole")
    assert {r for _, r, _ in cluster_rules} == {"customresourcedefinitions", "namespaces"}
    assert all(verb in ("get", "list", "watch") for _, _, verb in cluster_rules)


def test_operator_rbac_allows_what_it_creates_and_no_more():
    rules = _rules(render({}), "ClusterRole")
    from epdserve.operator.desired import OWNED_KINDS
    from epdserve.operator.kube import PLURALS
    from epdserve.operator.router import ROUTER_RULES

    for api_version, kind in OWNED_KINDS:
        group = api_version.rpartition("/")[0]
        for verb in ("get", "list", "create", "patch", "delete"):  # patch: server-side apply
            assert (group, PLURALS[kind], verb) in rules, (kind, verb)
    for rule in ROUTER_RULES:  # held, so the operator may grant them to the router
        for resource in rule["resources"]:
            for verb in rule["verbs"]:
                assert (rule["apiGroups"][0], resource, verb) in rules
    assert ("", "secrets", "create") in rules and ("", "secrets", "patch") not in rules
    assert not any(verb in ("*", "escalate", "bind", "impersonate") for _, _, verb in rules)
    assert not any("*" in (group, resource) for group, resource, _ in rules)


def _secret_grants(docs: list[dict]) -> dict[tuple[str, str], set[str]]:
    """(kind, namespace) -> verbs on Secrets, for every Role and ClusterRole rendered."""
    grants: dict[tuple[str, str], set[str]] = {}
    for doc in docs:
        if doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                if "secrets" in rule["resources"]:
                    key = (doc["kind"], doc["metadata"].get("namespace", ""))
                    grants.setdefault(key, set()).update(rule["verbs"])
    return grants


def test_secrets_are_granted_only_in_the_watched_namespaces():
    grants = _secret_grants(render(SCOPED))
    assert set(grants) == {("Role", "team-a"), ("Role", "team-b")}


def test_secret_access_is_cluster_wide_only_when_every_namespace_is_watched():
    docs = render({})
    assert set(_secret_grants(docs)) == {("ClusterRole", "")}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(a.startswith("--namespace") for a in args)  # it watches the whole cluster


def test_by_default_the_operator_may_create_secrets_and_read_none():
    for values in ({}, SCOPED):
        for verbs in _secret_grants(render(values)).values():
            assert verbs == {"create"}


def _secret_rules(docs: list[dict]) -> list[dict]:
    return [
        rule
        for d in docs
        if d["kind"] in ("Role", "ClusterRole")
        for rule in d["rules"]
        if "secrets" in rule["resources"]
    ]


def test_named_secrets_are_readable_by_name_only():
    values = {**SCOPED, "secrets": {"readNames": ["hub-token", "redis-auth"]}}
    rules = _secret_rules(render(values))
    reads = [r for r in rules if r["verbs"] != ["create"]]
    assert len(reads) == 2  # one Role per watched namespace
    for rule in reads:
        assert rule["verbs"] == ["get"]
        assert rule["resourceNames"] == ["hub-token", "redis-auth"]
    assert all("resourceNames" not in r for r in rules if r["verbs"] == ["create"])


def test_reading_every_secret_is_an_explicit_opt_in():
    docs = render({"secrets": {"readAll": True}})
    grants = _secret_grants(docs)
    assert grants == {("ClusterRole", ""): {"create", "get", "list", "watch"}}
    assert not any("resourceNames" in r for r in _secret_rules(docs))


def test_secret_values_are_checked_by_the_schema():
    with pytest.raises(helm.HelmError):
        render({"secrets": {"readAll": "yes"}})
    with pytest.raises(helm.HelmError):
        render({"secrets": {"readNames": "one"}})


def test_operator_pod_is_locked_down_and_runs_epdserve_operator():
    (dep,) = [d for d in render(SCOPED) if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["epdserve", "operator"]
    assert "--namespace=team-a" in container["args"] and "--namespace=team-b" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def test_dashboard_has_panels_on_vllm_metrics():
    (cm,) = [d for d in render({}) if d["kind"] == "ConfigMap"]
    dashboard = json.loads(cm["data"]["epdserve.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    for metric in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "epdserve_router:requests_total",
    ):
        assert metric in exprs, metric
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_values_schema_rejects_bad_values():
    with pytest.raises(helm.HelmError):
        render({"resyncSeconds": 0})
    with pytest.raises(helm.HelmError):
        render({"watchNamespaces": "team-a"})  # a list is required


def test_alert_rules_are_off_by_default():
    assert not [d for d in render({}) if d["kind"] == "PrometheusRule"]


def test_prometheus_rule_carries_the_rules_file_unchanged():
    (rule,) = [d for d in render(VALUES[1]) if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "epdserve-system"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())  # `{{ $labels }}` left to Prometheus
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert all(r["labels"]["severity"] in ("warning", "critical") for r in alerts)
    assert all("{{ $labels.pod }}" in r["annotations"]["summary"] for r in alerts)


def _promtool() -> str:
    found = shutil.which("promtool")
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail("promtool not found: `make prometheus` installs it")
    return found or pytest.skip("no promtool, and no root/apt-get to install it with")


def test_promtool_accepts_the_rendered_rules(tmp_path):
    (rule,) = [d for d in render(VALUES[1]) if d["kind"] == "PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    out = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr

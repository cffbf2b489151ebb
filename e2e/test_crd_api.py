"""The InferencePool CRD on a real kube-apiserver, driven with the real kubectl (issue #42,
items 5a and 7).

Only etcd and kube-apiserver run (no nodes, no controllers: a few seconds). The CRD must be
accepted and served (structural, printer columns, published OpenAPI), accept every example
under strict field validation, and refuse invalid pools at `kubectl apply` time with the
field's path: the OpenAPI schema's own checks, and the CEL rules (`x-kubernetes-validations`)
that mirror the operator's cross-field checks (operator/spec.py and the modules it calls). The
operator keeps its own checks; every CEL refusal here is refused by `parse_pool` as well, and
the edge cases accepted here are accepted by both.

Then the Gateway API Inference Extension's CRD (same kind `InferencePool`, same plural, group
inference.networking.k8s.io) is installed beside ours, and the names that reach each are shown.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml
from controlplane import ControlPlane, MissingTools
from crd_cases import ACCEPTED, REFUSED_BY_CEL, REFUSED_BY_SCHEMA, ids, pool
from ipool_samples import EXAMPLES, ROOT, example_docs

from epdserve.operator.errors import InvalidSpec
from epdserve.operator.spec import parse_pool

pytestmark = pytest.mark.e2e
CRD = ROOT / "crds" / "inferencepool.yaml"
GATEWAY_CRD = ROOT / "tools" / "crds" / "gateway-inferencepool.yaml"
OURS, THEIRS = "inferencepools.epdserve.io", "inferencepools.inference.networking.k8s.io"
DRY_RUN = ("apply", "--dry-run=server", "--validate=strict", "-f", "-")
GATEWAY_POOL = {
    "apiVersion": "inference.networking.k8s.io/v1",
    "kind": "InferencePool",
    "metadata": {"name": "twin", "namespace": "default"},
    "spec": {
        "selector": {"matchLabels": {"app": "vllm"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "twin-epp", "port": {"number": 9002}},
    },
}


class Kubectl:
    """tools/bin/kubectl with the admin kubeconfig and its own discovery cache."""

    def __init__(self, plane: ControlPlane, cache):
        self.plane, self.cache = plane, cache

    def run(self, *args: str, body: dict | None = None) -> subprocess.CompletedProcess:
        text = None if body is None else json.dumps(body)
        return self.plane.kubectl(*args, stdin=text, timeout=60, cache=self.cache)

    def __call__(self, *args: str, body: dict | None = None) -> str:
        """The stdout of a command that must succeed."""
        out = self.run(*args, body=body)
        assert out.returncode == 0, f"kubectl {' '.join(args)} failed: {out.stderr}"
        return out.stdout

    def refused(self, *args: str, body: dict | None = None) -> str:
        """The stderr of a command that must fail."""
        out = self.run(*args, body=body)
        assert out.returncode != 0, f"kubectl {' '.join(args)} was accepted: {out.stdout}"
        return out.stderr


def establish(kubectl: Kubectl, path, name: str) -> None:
    kubectl("apply", "-f", str(path))
    kubectl.plane.wait_established(name, cache=kubectl.cache)


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory):
    """etcd + kube-apiserver with our CRD applied (as the docs say: `kubectl apply -f`)."""
    workdir = tmp_path_factory.mktemp("crd-api")
    plane = ControlPlane(workdir, "127.0.0.1")  # loopback: no endpoint reconciler
    try:
        try:
            plane.start(only=("etcd", "kube-apiserver"))
        except MissingTools as exc:
            if os.environ.get("CI"):
                raise  # CI builds them (make k8s-tools): never skip there
            pytest.skip(str(exc))
        client = Kubectl(plane, workdir / "kubectl-cache")
        establish(client, CRD, OURS)
        yield client
    finally:
        plane.stop()


def test_the_roles_carry_the_same_schema_and_rules():
    """The four role schemas are copies (no $ref in a CRD): only the encoder differs, by its
    one rank (tensorParallelSize at most 1, no rule tying ranks to GPUs)."""
    schema = yaml.safe_load(CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    roles = schema["properties"]["spec"]["properties"]["roles"]["properties"]
    colocated, encoder = roles["colocated"], roles["encoder"]
    for name in ("prefill", "decode"):
        assert roles[name]["properties"] == colocated["properties"]
        assert roles[name]["x-kubernetes-validations"] == colocated["x-kubernetes-validations"]
    differ = [k for k, v in colocated["properties"].items() if encoder["properties"][k] != v]
    assert (
        differ == ["tensorParallelSize"]
        and encoder["properties"]["tensorParallelSize"]["maximum"] == 1
    )
    rules = [r["rule"] for r in colocated["x-kubernetes-validations"]]
    assert [r["rule"] for r in encoder["x-kubernetes-validations"]] == [
        r for r in rules if "tensorParallelSize" not in r
    ]


def test_crd_is_established_structural_and_named(kubectl):
    crd = json.loads(kubectl("get", "crd", OURS, "-o", "json"))
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    assert "NonStructuralSchema" not in conditions
    names = crd["status"]["acceptedNames"]
    assert names["shortNames"] == ["ipool"] and names["categories"] == ["epdserve"]


def test_get_prints_the_printer_columns(kubectl):
    kubectl("create", "-f", "-", body=pool("columns"))
    status = {"phase": "Ready", "ready": "3/3", "endpoint": "http://columns.default.svc:80"}
    patch = json.dumps({"status": status})
    kubectl("patch", "ipool", "columns", "--subresource=status", "--type=merge", "-p", patch)
    header, row = kubectl("get", "ipool", "columns").splitlines()
    assert header.split() == ["NAME", "PHASE", "READY", "ENDPOINT", "AGE"]
    assert row.split()[:4] == ["columns", "Ready", "3/3", status["endpoint"]]


def test_explain_reads_the_published_openapi(kubectl):
    spec = kubectl("explain", "inferencepool.spec")
    assert re.search(r"GROUP:\s+epdserve\.io", spec) and "Desired state of the pool." in spec
    assert re.search(r"roles\s+<Object> -required-", spec)
    field = kubectl("explain", "ipool.spec.roles.prefill.tensorParallelSize")
    assert "Tensor-parallel ranks in each pod" in field


def test_kubectl_apply_validates_strictly_by_default(kubectl):
    assert "--validate='strict'" in kubectl("apply", "--help")
    typo = pool("typo", {"roles.decode.replica": 2})
    refused = kubectl.refused("apply", "--dry-run=server", "-f", "-", body=typo)
    assert 'strict decoding error: unknown field "spec.roles.decode.replica"' in refused
    warned = kubectl.run("apply", "--dry-run=server", "--validate=warn", "-f", "-", body=typo)
    assert warned.returncode == 0 and 'unknown field "spec.roles.decode.replica"' in warned.stderr


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_a_strict_server_side_dry_run(kubectl, path):
    out = kubectl("apply", "--dry-run=server", "--validate=strict", "-f", str(path))
    names = [doc["metadata"]["name"] for doc in example_docs(path)]
    assert out.splitlines() == [
        f"inferencepool.epdserve.io/{n} created (server dry run)" for n in names
    ]


@pytest.mark.parametrize(
    ("changes", "path", "words"), REFUSED_BY_SCHEMA, ids=ids(REFUSED_BY_SCHEMA)
)
def test_the_schema_refuses_with_the_field_path(kubectl, changes, path, words):
    refused = kubectl.refused(*DRY_RUN, body=pool("bad", changes))
    assert path in refused and words in refused, refused


@pytest.mark.parametrize(("changes", "path", "words"), REFUSED_BY_CEL, ids=ids(REFUSED_BY_CEL))
def test_cel_rules_refuse_what_the_operator_refuses(kubectl, changes, path, words):
    body = pool("bad", changes)
    refused = kubectl.refused(*DRY_RUN, body=body)
    assert f"{path}: " in refused and words in refused, refused
    with pytest.raises(InvalidSpec) as operator:
        parse_pool(body)
    where = re.match(r"[\w.\[\]]+", str(operator.value)).group()
    assert where.startswith(path) or path.startswith(where), (where, path)


@pytest.mark.parametrize("changes", ACCEPTED, ids=lambda c: ",".join(c))
def test_edge_cases_pass_both_the_api_server_and_the_operator(kubectl, changes):
    body = pool("edge", changes)
    parse_pool(body)
    assert "created (server dry run)" in kubectl(*DRY_RUN, body=body)


# --- the Gateway API Inference Extension's InferencePool beside ours -------------------------


@pytest.fixture(scope="module")
def both(kubectl, tmp_path_factory):
    """Their CRD too, and a pool of each kind named `twin` in `default`; a fresh discovery
    cache, so that kubectl sees both groups."""
    if not GATEWAY_CRD.is_file():
        if os.environ.get("CI"):
            raise AssertionError(f"{GATEWAY_CRD} is missing (make k8s-tools)")
        pytest.skip(f"{GATEWAY_CRD} is missing: run `make k8s-tools` (tools/build.sh)")
    client = Kubectl(kubectl.plane, tmp_path_factory.mktemp("kubectl-cache"))
    establish(client, GATEWAY_CRD, THEIRS)
    client("create", "-f", "-", body=pool("twin"))
    client("create", "-f", "-", body=GATEWAY_POOL)
    return client


def test_both_crds_are_established_with_the_same_kind_and_plural(both):
    for name in (OURS, THEIRS):
        crd = json.loads(both("get", "crd", name, "-o", "json"))
        conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
        assert conditions["Established"] == conditions["NamesAccepted"] == "True"
        assert crd["spec"]["names"]["kind"] == "InferencePool"
        assert crd["spec"]["names"]["plural"] == "inferencepools"


def test_the_bare_resource_name_means_ours(both):
    """`kubectl get inferencepool` is not refused as ambiguous: kubectl maps a resource name to
    the first API group of discovery that serves it, and the API server lists CRD groups (all
    of equal priority) by name, so epdserve.io comes before inference.networking.k8s.io. The
    bare name (and so get, describe, delete, explain) means ours, silently; theirs needs
    `infpool` or its full name. (A group sorting before epdserve.io would win the same way.)"""
    for name in ("inferencepool", "inferencepools", "InferencePool"):
        out = both.run("get", name, "twin", "-o", "name")
        assert out.returncode == 0 and out.stdout.strip() == "inferencepool.epdserve.io/twin"
        assert "ambiguous" not in out.stderr.lower()
    assert re.search(r"GROUP:\s+epdserve\.io", both("explain", "inferencepool"))
    deleted = both("delete", "inferencepool", "twin", "--dry-run=server")
    assert deleted.startswith('inferencepool.epdserve.io "twin" deleted')
    rows = [line.split() for line in both("api-resources", "--no-headers").splitlines()]
    groups = [row[-3] for row in rows if row[0] == "inferencepools"]
    assert groups == ["epdserve.io/v1alpha1", "inference.networking.k8s.io/v1"]


@pytest.mark.parametrize(
    ("resource", "group"),
    [
        ("ipool", "epdserve.io"),
        ("inferencepools.epdserve.io", "epdserve.io"),
        ("inferencepool.v1alpha1.epdserve.io", "epdserve.io"),
        ("infpool", "inference.networking.k8s.io"),
        ("inferencepools.inference.networking.k8s.io", "inference.networking.k8s.io"),
        ("inferencepool.v1.inference.networking.k8s.io", "inference.networking.k8s.io"),
    ],
)
def test_short_and_qualified_names_address_one_group(both, resource, group):
    assert both("get", resource, "twin", "-o", "name").strip() == f"inferencepool.{group}/twin"


def test_one_of_each_with_the_same_name_in_one_namespace(both):
    ours = json.loads(both("get", OURS, "twin", "-o", "json"))
    theirs = json.loads(both("get", THEIRS, "twin", "-o", "json"))
    assert ours["apiVersion"] == "epdserve.io/v1alpha1"
    assert theirs["apiVersion"] == "inference.networking.k8s.io/v1"
    assert ours["metadata"]["namespace"] == theirs["metadata"]["namespace"] == "default"
    assert ours["metadata"]["uid"] != theirs["metadata"]["uid"]
    assert theirs["spec"]["endpointPickerRef"]["name"] == "twin-epp"
    assert ours["spec"]["model"]["name"] == "tiny"


def test_the_epdserve_category_lists_ours_only(both):
    listed = both("get", "epdserve", "-o", "name").split()
    assert "inferencepool.epdserve.io/twin" in listed
    assert not [name for name in listed if "inference.networking.k8s.io" in name]

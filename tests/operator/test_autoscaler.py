"""The operator's autoscaling loop against an in-memory API and a fake metrics source."""

from __future__ import annotations

from ipool_samples import pool_body

from epdserve.operator.autoscaler import Autoscaler, held_replicas
from epdserve.operator.desired import desired_objects, desired_replicas
from epdserve.operator.spec import parse_pool

NOW = "2026-01-01T00:00:00Z"


class FakeApi:
    """Deployments and Pods by name; records the PATCHes the autoscaler sends."""

    def __init__(self, replicas: dict[str, int], pods: dict[str, list[str]]):
        self.replicas = dict(replicas)  # deployment name -> spec.replicas
        self.pods = pods  # role -> pod IPs (all ready)
        self.patches: list[tuple[str, dict]] = []

    def get(self, api_version, kind, namespace, name):
        return {"spec": {"replicas": self.replicas[name]}} if name in self.replicas else None

    def list(self, api_version, kind, namespace, selector):
        role = selector.rpartition("=")[2]
        ready = [{"type": "Ready", "status": "True"}]
        return [
            {"metadata": {"name": f"{role}-{i}"}, "status": {"podIP": ip, "conditions": ready}}
            for i, ip in enumerate(self.pods.get(role, []))
        ]

    def request(self, method, path, body=None, query=None, content_type=""):
        name = path.rpartition("/")[2]
        self.patches.append((name, body))
        self.replicas[name] = body["spec"]["replicas"]
        return {}


def _pool(**decode) -> dict:
    prefill = {"maxReplicas": 6, "target": 4, "scaleDownStabilizationSeconds": 0}
    roles = {
        "prefill": {"replicas": 1, "autoscaling": prefill},
        "decode": {"replicas": 2, **({"autoscaling": decode} if decode else {})},
    }
    return pool_body(roles=roles, cache={"backend": "redis", "redis": {"managed": True}})


def _waiting(n: float) -> str:
    return f'vllm:num_requests_waiting{{model_name="m"}} {n}\n'


def _ttft(fast: int, slow: int) -> str:
    return (
        f'vllm:time_to_first_token_seconds_bucket{{le="0.5"}} {fast}\n'
        f'vllm:time_to_first_token_seconds_bucket{{le="2.0"}} {fast + slow}\n'
        f'vllm:time_to_first_token_seconds_bucket{{le="+Inf"}} {fast + slow}\n'
    )


def test_busy_prefill_pods_scale_the_prefill_deployment_only():
    api = FakeApi({"p-prefill": 2, "p-decode": 2}, {"prefill": ["10.0.0.1", "10.0.0.2"]})
    metrics = {"10.0.0.1": _waiting(10), "10.0.0.2": _waiting(6)}
    scaler = Autoscaler(api, scrape=lambda url: metrics[url.split("//")[1].split(":")[0]])
    status, events = scaler.step(_pool(), NOW)
    assert api.patches == [("p-prefill", {"spec": {"replicas": 4}})]  # ceil(2 * 8 / 4)
    assert status["prefill"]["desiredReplicas"] == 4
    assert status["prefill"]["currentReplicas"] == 2
    assert status["prefill"]["lastScaleTime"] == NOW
    assert "waiting 8 vs target 4: 2 -> 4" in status["prefill"]["lastScaleReason"]
    assert "decode" not in status
    assert events[0][1] == "Scaled"


def test_a_steady_pool_is_left_alone_and_keeps_its_last_reason():
    api = FakeApi({"p-prefill": 2}, {"prefill": ["10.0.0.1"]})
    scaler = Autoscaler(api, scrape=lambda url: _waiting(4))
    body = _pool()
    body["status"] = {
        "autoscaling": {"prefill": {"lastScaleReason": "earlier", "lastScaleTime": NOW}}
    }
    status, events = scaler.step(body, "2026-01-01T00:01:00Z")
    assert api.patches == [] and events == []
    assert status["prefill"]["lastScaleReason"] == "earlier"


def test_an_unreachable_pod_is_left_out_and_counted():
    api = FakeApi({"p-prefill": 1}, {"prefill": ["10.0.0.1", "10.0.0.2"]})

    def scrape(url):
        if "10.0.0.2" in url:
            raise OSError("connection refused")
        return _waiting(8)

    scaler = Autoscaler(api, scrape=scrape)
    status, _ = scaler.step(_pool(), NOW)
    assert status["prefill"]["desiredReplicas"] == 2 and scaler.scrape_errors == 1


def test_an_unreadable_metrics_page_is_left_out_and_counted():
    api = FakeApi({"p-prefill": 1}, {"prefill": ["10.0.0.1", "10.0.0.2"]})
    pages = {"10.0.0.1": _waiting(8), "10.0.0.2": "<html>not a metrics page</html>\n"}
    scaler = Autoscaler(api, scrape=lambda url: pages[url.split("//")[1].split(":")[0]])
    status, _ = scaler.step(_pool(), NOW)
    assert status["prefill"]["desiredReplicas"] == 2 and scaler.scrape_errors == 1


def test_decode_scales_on_ttft_p90_of_new_observations():
    api = FakeApi({"p-prefill": 1, "p-decode": 1}, {"decode": ["10.0.0.3"]})
    text = {"now": _ttft(100, 0)}
    scaler = Autoscaler(api, scrape=lambda url: text["now"] if "10.0.0.3" in url else "")
    decode = {"maxReplicas": 8, "metric": "ttftP90", "target": 0.5}
    scaler.step(_pool(**decode), NOW)  # fast history: p90 below the target
    assert api.replicas["p-decode"] == 1
    text["now"] = _ttft(100, 100)  # the last 100 requests were all slow
    status, _ = scaler.step(_pool(**decode), NOW)
    assert api.replicas["p-decode"] > 1
    assert status["decode"]["lastScaleReason"].startswith("ttftP90")


def test_other_engines_leave_the_loop_to_the_cluster():
    api = FakeApi({"p-prefill": 1}, {"prefill": ["10.0.0.1"]})
    body = _pool()
    body["spec"]["autoscaling"] = {"engine": "hpa"}
    assert Autoscaler(api, scrape=lambda url: _waiting(100)).step(body, NOW) == ({}, [])
    assert api.patches == []


def test_builders_take_the_live_size_of_autoscaled_roles():
    pool = parse_pool(_pool())
    live = {("Deployment", "p-prefill"): {"spec": {"replicas": 5}}}
    held = held_replicas(pool, live)
    assert held == {"prefill": 5}
    sizes = {
        o["metadata"]["name"]: o["spec"]["replicas"]
        for o in desired_objects(pool, held)
        if o["kind"] == "Deployment"
    }
    assert sizes["p-prefill"] == 5 and sizes["p-decode"] == 2
    assert desired_replicas(pool, held)["prefill"] == ("p-prefill", 5)


def test_a_new_autoscaled_role_starts_at_min_and_is_clamped_to_max():
    pool = parse_pool(_pool())
    assert held_replicas(pool, {}) == {"prefill": 1}
    assert held_replicas(pool, {("Deployment", "p-prefill"): {"spec": {"replicas": 50}}}) == {
        "prefill": 6
    }

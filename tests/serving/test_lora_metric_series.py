"""Per-adapter metric series live as long as their adapters (issue #41): a real pod drops an
adapter's ``epdserve:lora_requests`` series when it is unloaded, and a request that finishes
after the unload brings none back (it is not counted: its adapter is no longer served)."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
from serving_support import API_KEY, ServerProcess

from epdserve.common import metrics_text
from epdserve.engine.lora.random_adapters import write_random_adapters

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory):
    return write_random_adapters(models.get("llama"), 3, out=tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def pod(models, adapters):
    srv = ServerProcess(
        str(models.get("llama")),
        "--enable-lora",
        "--lora-modules",
        f"lora0={adapters[0]}",
        "--lora-modules",
        f"lora1={adapters[1]}",
        "--max-loras",
        "2",
        "--max-model-len",  # room for streams long enough to hold the slots (seconds)
        "4096",
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    )
    yield srv
    srv.stop()


def post(pod, path: str, body: dict) -> int:
    return httpx.post(pod.url + path, json=body, headers=HEADERS, timeout=60).status_code


def complete(pod, model: str) -> int:
    body = {"model": model, "prompt": [11, 12, 13, 14], "max_tokens": 1}
    return post(pod, "/v1/completions", body)


def adapter_series(pod) -> set[str]:
    """The adapters named by an ``epdserve:lora_requests`` series on the pod's page."""
    page = httpx.get(pod.url + "/metrics", timeout=5).text
    return {
        s.labels["lora_name"]
        for s in metrics_text.parse(page)
        if s.name.startswith("epdserve:lora_requests") and "lora_name" in s.labels
    }


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + 60
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.mark.parametrize("cycles", [20, pytest.param(200, marks=pytest.mark.slow)])
def test_load_unload_cycles_leave_only_the_served_adapters_series(pod, adapters, cycles):
    assert complete(pod, "lora0") == 200
    for i in range(cycles):
        name = f"cycle{i}"
        assert (
            post(pod, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapters[2])})
            == 200
        )
        assert complete(pod, name) == 200
        if i == 0:
            assert adapter_series(pod) == {"lora0", name}  # counted while served
        assert post(pod, "/v1/unload_lora_adapter", {"lora_name": name}) == 200
    assert adapter_series(pod) == {"lora0"}


@contextlib.contextmanager
def slots_held(pod, models: list[str]):
    """A long stream per adapter of ``models``, running until the block ends (then closed,
    so the pod aborts them): the device slots they use are busy meanwhile."""
    stop = threading.Event()

    def hold(model: str) -> None:
        body = {"model": model, "prompt": [11, 12], "max_tokens": 4000, "stream": True}
        body["ignore_eos"] = True
        with httpx.stream(
            "POST", pod.url + "/v1/completions", json=body, headers=HEADERS, timeout=120
        ) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, args=(m,), daemon=True) for m in models]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def test_a_request_finishing_after_its_adapter_is_unloaded_brings_no_series_back(pod, adapters):
    assert (
        post(pod, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapters[2])})
        == 200
    )
    status = []
    with slots_held(pod, ["lora0", "lora1"]):  # both of the pod's slots: "late" must wait
        wait_until(lambda: pod.metric("vllm:num_requests_running") == 2, "streams running")
        waiter = threading.Thread(target=lambda: status.append(complete(pod, "late")))
        waiter.start()
        wait_until(lambda: pod.metric("vllm:num_requests_waiting") == 1, "late waiting")
        assert post(pod, "/v1/unload_lora_adapter", {"lora_name": "late"}) == 200
        assert pod.metric("vllm:num_requests_waiting") == 1  # still in flight
    waiter.join(60)
    assert status == [200]  # served after the unload, with the files it was loaded from
    assert "late" not in adapter_series(pod)


def test_a_failed_in_place_load_that_leaves_the_name_unserved_drops_its_series(
    pod, adapters, tmp_path
):
    body = {"lora_name": "swap", "lora_path": str(adapters[2])}
    assert post(pod, "/v1/load_lora_adapter", body) == 200
    assert complete(pod, "swap") == 200 and "swap" in adapter_series(pod)
    body = {"lora_name": "swap", "lora_path": str(tmp_path / "none"), "load_inplace": True}
    assert post(pod, "/v1/load_lora_adapter", body) == 400  # the old one is gone too
    assert complete(pod, "swap") == 404
    assert "swap" not in adapter_series(pod)

"""``epdserve serve --scheduling-policy priority`` with the official openai client: the request
``priority`` field orders the queue; a priority that is not a 64-bit integer is a 400 naming
the field (fcfs's refusal is in test_request_features.py, on its default server).

The order is the engine's own: one sequence runs at a time (``--max-num-seqs 1``), so
requests start, and finish, in the order the scheduler admits them. Requests are queued
behind a blocker that is cancelled once every one of them waits (the server's gauges say
when); no assertion reads a clock."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serving_support import API_KEY, ServerProcess

LOW, HIGH = 10, -1
LOW_TOKENS = 128  # each low request runs this many steps after the high one finished


@pytest.fixture(scope="module")
def prio_server(models):
    srv = ServerProcess(
        str(models.get("llama")),
        *("--scheduling-policy", "priority", "--max-num-seqs", "1"),
        *("--max-queued-requests", "8", "--max-model-len", "4096"),
    )
    yield srv
    srv.stop()


@pytest.fixture
def prio_client(prio_server):
    return openai.OpenAI(
        base_url=prio_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120
    )


def wait_for_gauge(server: ServerProcess, name: str, value: float) -> None:
    """Wait until the server's gauge reads ``value`` (a sync point, not a time check)."""
    deadline = time.monotonic() + 60
    while server.metric(name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.02)


def low_request(client: openai.OpenAI, i: int):
    return client.completions.create(
        model="tiny",
        prompt=f"def low_{i}(x):",
        max_tokens=LOW_TOKENS,
        extra_body={"priority": LOW, "ignore_eos": True},
    )


def high_chat_streamed(client: openai.OpenAI) -> list[str | None]:
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "urgent"}],
        max_tokens=4,
        stream=True,
        extra_body={"priority": HIGH, "ignore_eos": True},
    )
    return [c.choices[0].finish_reason for c in stream if c.choices]


def test_a_high_priority_request_queued_behind_low_ones_is_served_first(prio_server, prio_client):
    blocker = prio_client.completions.create(
        model="tiny",
        prompt="def blocker():",
        max_tokens=4000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(blocker))  # it runs, holding the one sequence slot
    with ThreadPoolExecutor(4) as pool:
        lows = [pool.submit(low_request, prio_client, i) for i in range(3)]
        wait_for_gauge(prio_server, "vllm:num_requests_waiting", 3)
        high = pool.submit(high_chat_streamed, prio_client)
        wait_for_gauge(prio_server, "vllm:num_requests_waiting", 4)
        blocker.close()  # its abort frees the slot: the queue's first request starts
        assert high.result()[-1] == "length"
        # one sequence at a time: had a low request started first, it would be done now
        assert [f.done() for f in lows] == [False, False, False]
        results = [f.result() for f in lows]
    assert [r.usage.completion_tokens for r in results] == [LOW_TOKENS] * 3


@pytest.mark.parametrize("value", ["high", 1.5, True, None, 1 << 63, -(1 << 63) - 1])
def test_a_priority_that_is_not_a_64_bit_integer_is_a_400_naming_it(prio_client, value):
    with pytest.raises(openai.BadRequestError) as err:
        prio_client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"priority": value}
        )
    assert err.value.status_code == 400 and err.value.body["param"] == "priority"


def test_the_64_bit_bounds_are_accepted_streamed_or_not(prio_client):
    out = prio_client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=1,
        extra_body={"priority": (1 << 63) - 1, "ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    stream = prio_client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=1,
        stream=True,
        extra_body={"priority": -(1 << 63), "ignore_eos": True},
    )
    assert [c.choices[0].finish_reason for c in stream if c.choices][-1] == "length"

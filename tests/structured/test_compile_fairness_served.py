"""Issue #41 through a real ``epdserve serve`` and the official ``openai`` client: a schema
over the compile-cost bound is a 400 naming the field, and a plain client's ``choice`` is
answered while four of the costliest schemas that pass the bound compile."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from serving_support import API_KEY, ServerProcess

from epdserve.engine.structured.manager import HOLD_ENV
from epdserve.engine.structured.schema_cost import MAX_COMPILE_COST, SchemaCost

# the costliest value per property measured (bench/grammar_cost.py): a five-type union
UNION = {"type": ["string", "integer", "null", "boolean", "number"]}


def optional(n: int, tag: str, value=UNION) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": value for i in range(n)}}


def worst_passing(tag: str) -> dict:
    """The most optional properties of ``UNION`` one object may have under the bound."""
    n = 1
    while SchemaCost().add(optional(n + 1, tag)).total <= MAX_COMPILE_COST:
        n += 1
    return optional(n, tag)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A file whose creation lets the server's large-lane compiles start (HOLD_ENV)."""
    return tmp_path_factory.mktemp("hold") / "release"


@pytest.fixture(scope="module")
def server(models, release):
    srv = ServerProcess(str(models.get("llama")), env={HOLD_ENV: str(release)})
    yield srv
    release.touch()
    srv.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def ask(client, spec: dict, max_tokens: int):
    return client.completions.create(
        model="tiny",
        prompt="Output:",
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"structured_outputs": spec},
    )


def test_a_schema_over_the_compile_bound_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as exc:
        ask(client, {"json": optional(1000, "p", {"type": "integer"})}, 4)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == "structured_outputs.json"
    assert "1000 optional properties at #" in exc.value.body["message"]


def wait_for_waiting(server, n: int, timeout: float = 60) -> None:
    """Until the core holds ``n`` requests waiting (their grammars compiling or queued)."""
    deadline = time.monotonic() + timeout
    while server.metric("vllm:num_requests_waiting") < n:
        assert time.monotonic() < deadline, "the large requests never reached the core"
        time.sleep(0.02)


def test_a_choice_is_answered_while_four_worst_case_schemas_compile(server, client, release):
    # the large lane is held (HOLD_ENV) until the choice is answered: a worst-case schema
    # compiles in ~0.1 s at the tiny model's vocabulary, too fast to race against
    schemas = [worst_passing(f"s{i}_") for i in range(4)]  # four distinct compiles
    with ThreadPoolExecutor(4) as pool:
        big = [pool.submit(ask, client, {"json": s}, 2) for s in schemas]
        wait_for_waiting(server, 4)
        answer = ask(client, {"choice": ["yes", "no"]}, 4)
        pending = sum(not f.done() for f in big)
        release.touch()
        results = [f.result() for f in big]
    assert answer.choices[0].text in ("yes", "no")
    assert pending == 4  # before the lanes, the choice compiled after all four
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)

"""Model sources, offline: a hub id resolves through a local HuggingFace cache built from a
`make-model` checkpoint (huggingface_hub's layout), and `epdserve serve ORG/NAME` serves it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from epdserve.engine.model_source import resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
from serving_support import ServerProcess  # noqa: E402

REPO_ID = "org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def build_hub_cache(cache: Path, checkpoint: Path, repo_id: str = REPO_ID) -> Path:
    """The HF hub cache layout: models--ORG--NAME/{blobs/<sha256>, snapshots/<commit>/<file>
    -> ../../blobs/<sha256>, refs/main = <commit>}. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for src in sorted(p for p in checkpoint.iterdir() if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / src.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(models, tmp_path_factory) -> tuple[Path, Path]:
    """(cache dir, snapshot dir) holding the tiny llama as org/tiny-llama."""
    cache = tmp_path_factory.mktemp("hf-hub")
    return cache, build_hub_cache(cache, Path(models.get("llama")))


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    """huggingface_hub reads its env at import: point its constants at the test cache."""
    from huggingface_hub import constants

    cache, snapshot = hub_cache
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def offline_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "EPDSERVE_"))}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def epdserve(*argv: str, env: dict) -> subprocess.CompletedProcess:
    code = "import sys; from epdserve.engine.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_an_existing_directory_is_returned_as_is(models):
    path = str(models.get("llama"))
    assert resolve_model(path) == path
    assert resolve_model(path, revision="v2") == path  # a directory has no revisions


def test_a_hub_id_resolves_to_its_cached_snapshot(offline_cache):
    assert resolve_model(REPO_ID) == str(offline_cache)
    assert resolve_model(REPO_ID, revision="main") == str(offline_cache)
    assert resolve_model(REPO_ID, revision=COMMIT) == str(offline_cache)
    assert (offline_cache / "config.json").is_file()


def test_an_uncached_id_offline_fails_naming_the_model_and_the_way_out(offline_cache):
    with pytest.raises(ValueError, match=r"model 'org/unknown'.*not in the HuggingFace cache"):
        resolve_model("org/unknown")
    with pytest.raises(ValueError, match=r"revision 'v9'.*epdserve download"):
        resolve_model(REPO_ID, revision="v9")


@pytest.mark.parametrize("bad", ["/no/such/dir", "./rel", "a b/c!"])
def test_a_missing_path_or_malformed_id_is_refused(bad, offline_cache):
    with pytest.raises(ValueError, match=f"model {bad!r}"):
        resolve_model(bad)


def test_download_subcommand_prints_the_snapshot_and_links_it(hub_cache, tmp_path):
    cache, snapshot = hub_cache
    link = tmp_path / "current"
    out = epdserve("download", REPO_ID, "--link", str(link), env=offline_env(cache))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(snapshot)
    assert link.resolve() == snapshot.resolve() and (link / "tokenizer.json").is_file()
    again = epdserve("download", REPO_ID, "--link", str(link), env=offline_env(cache))
    assert again.returncode == 0 and link.resolve() == snapshot.resolve()


def test_download_subcommand_fails_with_the_model_named(hub_cache):
    cache, _ = hub_cache
    out = epdserve("download", "org/unknown", env=offline_env(cache))
    assert out.returncode == 1
    assert "epdserve download: model 'org/unknown'" in out.stderr


def test_serve_accepts_a_hub_id_and_answers_under_that_name(hub_cache):
    cache, _ = hub_cache
    env = offline_env(cache)
    server = ServerProcess(REPO_ID, api_key=None, env=env)
    try:
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]  # --served-model-name wins
        body = {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "temperature": 0}
        out = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_serve_with_an_unknown_id_exits_at_start_naming_it(hub_cache):
    cache, _ = hub_cache
    out = epdserve("serve", "org/unknown", "--port", "0", env=offline_env(cache))
    assert out.returncode != 0
    assert "model 'org/unknown'" in out.stderr and "not in the HuggingFace cache" in out.stderr


def test_the_operators_download_init_container_runs_as_built(hub_cache, tmp_path):
    """The pod contract end to end: the router pod's init container command, with its env
    (HF_HOME remapped onto the test cache), fills the link the router reads."""
    from epdserve.operator.router import build_router_deployment
    from epdserve.operator.spec import parse_pool

    cache, snapshot = hub_cache
    hub = {"id": REPO_ID, "revision": "main"}
    body = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {
            "model": {"name": "tiny", "source": {"huggingFace": hub}},
            "engine": {"image": "img:1"},
            "roles": {"colocated": {}},
        },
    }
    pod = build_router_deployment(parse_pool(body))["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    command = [tmp_path / "model" if c == "/tmp/model" else c for c in init["command"]]
    env = offline_env(cache)
    env.pop("HF_HUB_CACHE")
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    (hf_home / "hub").symlink_to(cache)  # HF_HOME/hub is the hub cache
    env.update({e["name"]: e["value"] for e in init["env"] if "value" in e})
    env.update(HOME=str(tmp_path), HF_HOME=str(hf_home))
    assert command[:2] == ["epdserve", "download"]
    out = epdserve(*map(str, command[1:]), env=env)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "model").resolve() == snapshot.resolve()

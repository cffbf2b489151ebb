"""``epdserve up`` gives its pool a processed-prompt key, as the operator's Secret does: one
fresh key per pool, in every engine's and the router's environment, on no command line."""

from __future__ import annotations

import argparse

import pytest

from epdserve.engine.entrypoints import up_cli


@pytest.mark.parametrize("mode", ["colocated", "epd"])
def test_up_gives_every_engine_and_the_router_one_fresh_key(tmp_path, monkeypatch, mode):
    spawned = []
    monkeypatch.setattr(up_cli, "wait_http", lambda pool, url: None)
    monkeypatch.setattr(up_cli, "start_redis", lambda pool: "redis://127.0.0.1:1/0")
    parser = argparse.ArgumentParser()
    up_cli.add_arguments(parser)
    args = parser.parse_args(["--mode", mode])
    keys = set()
    for _ in range(2):
        pool = up_cli.Pool(tmp_path)
        monkeypatch.setattr(pool, "spawn", lambda name, cmd, env=None: spawned.append((cmd, env)))
        spawned.clear()
        up_cli.start_pool(pool, args, "models/tiny")
        names = [cmd[cmd.index("epdserve.engine.cli") + 1] for cmd, _ in spawned]
        assert names == ["serve"] * (len(names) - 1) + ["router"] and len(names) >= 2
        found = {(env or {}).get("EPDSERVE_PROCESSED_PROMPT_KEY") for _, env in spawned}
        (key,) = found
        assert key and len(key) == 64
        assert not any(key in " ".join(cmd) for cmd, _ in spawned)
        keys.add(key)
    assert len(keys) == 2

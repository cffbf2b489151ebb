"""The pool's processed-prompt key (pure but for key generation).

Every pool gets one Secret `<pool>-processed-prompt-key` holding a random 256-bit key (64 hex
characters) under `key`. Engine pods sign the processed prompts they return with it and take
only processed prompts signed with it; the router signs the prompts it tokenizes itself. Both
read it from `EPDSERVE_PROCESSED_PROMPT_KEY` (a `secretKeyRef`, never a literal). Created once,
never read back or overwritten, like the Curve keys: bring your own by creating the Secret
before the pool.
"""

from __future__ import annotations

import base64
import secrets

from epdserve.operator import meta
from epdserve.operator.spec import PoolSpec

ENV = "EPDSERVE_PROCESSED_PROMPT_KEY"
SECRET_KEY = "key"


def secret_name(pool: PoolSpec) -> str:
    return meta.name_of(pool, "processed-prompt-key")


def new_key() -> str:
    """A fresh random key (the only impure helper here)."""
    return secrets.token_hex(32)


def build_secret(pool: PoolSpec, key: str) -> dict:
    """Secret `<pool>-processed-prompt-key` with the key; created once, never overwritten."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta.metadata(pool, secret_name(pool), "processed-prompt-key"),
        "type": "Opaque",
        "data": {SECRET_KEY: base64.b64encode(key.encode()).decode()},
    }


def key_env(pool: PoolSpec) -> list[dict]:
    """`EPDSERVE_PROCESSED_PROMPT_KEY` from the pool's Secret (engine and router pods)."""
    ref = {"secretKeyRef": {"name": secret_name(pool), "key": SECRET_KEY}}
    return [{"name": ENV, "valueFrom": ref}]

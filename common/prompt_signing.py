"""Processed prompts signed with the pool's key (HMAC-SHA256), so a pod takes only the ones
a pod of its own pool (or its router) made.

A pod takes a ``processed_prompt`` as is: its image identifiers name encoder outputs in the
shared store. Unsigned, any client that reaches port 8000 could name an identifier it
guessed and learn from the answer whether the store holds it (a membership oracle). With a
key, the pod that makes a prompt signs it and the next pod refuses one whose signature does
not match. The signature covers the token ids, the items (identifier, offset, length) and the
request's ``cache_salt``, in one canonical serialization both sides make the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import json

FIELD = "signature"
VERSION = "epdserve-processed-prompt-v1"
MIN_KEY_CHARS = 32  # the operator and `epdserve up` make 64 hex characters (256 bits)


def canonical(prompt: dict, cache_salt: str | None) -> bytes:
    """The bytes a signature covers: a compact JSON array, the same in every process."""
    items = [[i["id"], i["offset"], i["length"]] for i in prompt.get("mm_items") or []]
    body = [VERSION, prompt["prompt_token_ids"], items, cache_salt]
    return json.dumps(body, separators=(",", ":"), ensure_ascii=True).encode()


def check_key(key: str | None, flag: str) -> None:
    """A key given as a setting: long enough to be a key (ValueError naming ``flag``)."""
    if key is not None and len(key) < MIN_KEY_CHARS:
        raise ValueError(f"{flag} must be at least {MIN_KEY_CHARS} characters (a random key)")


class PromptSigner:
    """Signs and checks processed prompts (their wire form) with one pool's key."""

    def __init__(self, key: str):
        self._key = key.encode()

    def signature(self, prompt: dict, cache_salt: str | None) -> str:
        return hmac.new(self._key, canonical(prompt, cache_salt), hashlib.sha256).hexdigest()

    def sign(self, prompt: dict, cache_salt: str | None) -> dict:
        """``prompt`` with its signature for a request of ``cache_salt``."""
        return {**prompt, FIELD: self.signature(prompt, cache_salt)}

    def check(self, prompt: dict, signature: object, cache_salt: str | None) -> None:
        """Raise ValueError naming ``processed_prompt.signature`` unless ``signature`` is
        this key's over ``prompt`` (already checked for shape) and ``cache_salt``."""
        where = f"processed_prompt.{FIELD}"
        if signature is None:
            raise ValueError(
                f"{where}: required: this pool takes only processed prompts its own pods made "
                "(send the request without processed_prompt)"
            )
        if not isinstance(signature, str) or not hmac.compare_digest(
            signature.encode(), self.signature(prompt, cache_salt).encode()
        ):
            raise ValueError(
                f"{where}: does not match: the prompt was not made by a pod of this pool, "
                "was changed, or belongs to another cache_salt"
            )

"""The processed prompt on the router's side of a disaggregated pool.

A pod that renders, tokenizes and (for images) hashes a request returns the result in its
answer as ``processed_prompt``: ``{"prompt_token_ids": [...], "mm_items": [{"id", "offset",
"length"}, ...]}`` (an encoder pod always; any pod asked for a prefill with
``kv_transfer_params.do_remote_decode``). The router puts it on the next legs' bodies, with
the images stripped from ``messages``, and those pods take it as is. A text-only request may
get the router's own processed prompt (its ids, no items) when it tokenized it to route.

The router checks only the shape it relies on; the pod checks the contents (vocabulary,
placeholder spans, identifiers) as strictly as its own, and, in a pool with a processed-prompt
key, the signature (common/prompt_signing.py): the pods sign what they return, the router
signs the prompts it tokenizes itself.

A pod that was sent a prompt naming images whose encoder outputs are in no store any more
(evicted between the legs) answers 503 with ``RESEND_HEADER``: that leg goes once more with
the client's images (``needs_images``).
"""

from __future__ import annotations

from hashlib import blake2b

from epdserve.common.chat_parts import image_parts, image_urls, without_images

FIELD = "processed_prompt"
RESEND_HEADER = "x-epdserve-resend"  # engine/entrypoints/openai/errors.py RESEND_HEADERS


def is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


def has_images(path: str, body: dict) -> bool:
    """A chat request with at least one image part."""
    return is_chat(path) and next(image_parts(body.get("messages")), None) is not None


def needs_images(status: int, headers) -> bool:
    """Whether a pod's answer asks for the request again with its images (not a busy 503)."""
    return status == 503 and headers.get(RESEND_HEADER) == "images"


def with_images(body: dict) -> dict:
    """``body`` as the client sent it, less any processed prompt: the pod loads the images."""
    return {k: v for k, v in body.items() if k != FIELD}


def names_images(prompt: dict | None) -> bool:
    return bool(prompt and prompt.get("mm_items"))


def from_answer(answer: object) -> dict | None:
    """The ``processed_prompt`` of a pod's JSON answer, if it has a usable one."""
    prompt = answer.get(FIELD) if isinstance(answer, dict) else None
    if not isinstance(prompt, dict):
        return None
    ids = prompt.get("prompt_token_ids")
    if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
        return None
    items = prompt.get("mm_items") or []
    if not isinstance(items, list) or not all(_item_ok(i) for i in items):
        return None
    return prompt


def _item_ok(item: object) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("id"), str)
        and type(item.get("offset")) is int
        and type(item.get("length")) is int
    )


def routing_ids(body: dict) -> list[int] | None:
    """The ids a body's processed prompt routes by: those before its first image item (the
    pods' events name no block that holds image tokens). None: the body has none."""
    prompt = from_answer(body)
    if prompt is None:
        return None
    ids = prompt["prompt_token_ids"]
    starts = [item["offset"] for item in prompt.get("mm_items") or []]
    return ids[: min(starts)] if starts else ids


def with_prompt(body: dict, prompt: dict | None) -> dict:
    """``body`` for a pod that takes ``prompt`` as is: image parts dropped from
    ``messages`` (the pod never loads them again). ``prompt`` None: ``body`` unchanged."""
    if prompt is None:
        return body
    out = {**body, FIELD: prompt}
    if isinstance(body.get("messages"), list):
        out["messages"] = without_images(body["messages"])
    return out


def router_may_tokenize(path: str, body: dict) -> bool:
    """Whether the router's own ids can stand for the prompt on the pods: a text-only chat,
    or a completion of one prompt string whose text the pod does not echo."""
    if is_chat(path):
        return not has_images(path, body)
    return isinstance(body.get("prompt"), str) and not body.get("echo")


def image_affinity(body: dict, pods: list[str]) -> dict[str, int]:
    """Rendezvous weights of ``pods`` for the request's images (empty: it has none), so the
    same images rank the pods the same way while the pods stay the same."""
    urls = image_urls(body.get("messages"))
    if not urls:
        return {}
    key = blake2b("\n".join(urls).encode(), digest_size=16).digest()
    return {
        name: int.from_bytes(blake2b(key + name.encode(), digest_size=8).digest(), "big")
        for name in pods
    }

"""Which stored blocks cover a request's tokens but its last, and the name of a prompt's
partial last block (its *tail*).

Full blocks are named by the engine's chained block hashes. A prompt whose length is not a
multiple of the block size ends in a partial block that no full-block hash names; a prefill
pod stores its tokens' KV under a *tail hash* so that the decode pod of a P/D pair loads the
whole prompt but its last token (which it computes, to sample the first token), as vLLM's P/D
does. A tail is never a block of the prefix cache: no KV event names it, and no lookup of
whole blocks finds it.
"""

from __future__ import annotations

from hashlib import blake2b
from typing import NamedTuple

import msgspec

from epdserve.connectors.kv_connector.base import KVRequest

TAIL_DOMAIN = b"epdserve-kv-tail-v1\x00"


class LoadChain(NamedTuple):
    """The stored values a request may load, in order, and the tokens they give it."""

    hashes: list[bytes]  # full blocks' hashes, then the tail's when ``tail_tokens``
    tail_tokens: int  # tokens the stored tail holds (0: the chain has no tail)
    tokens: int  # tokens the whole chain credits (never the request's last one)


def tail_hash(request: KVRequest, block_size: int) -> bytes | None:
    """The name of the KV of the prompt's partial last block: the parent block's hash (which
    names everything before), the block's tokens, and what else its KV depends on (the LoRA
    adapter, the multimodal items overlapping it, the cache salt). None when the prompt ends
    on a block boundary (or its earlier blocks are not hashed yet)."""
    num_prompt = request.num_prompt_tokens
    k, rest = divmod(num_prompt, block_size)
    if rest == 0 or len(request.block_hashes) < k:
        return None
    start = k * block_size
    spans = getattr(request, "mm_spans", ()) or ()
    items = [ident for s, e, ident in spans if s < num_prompt and e > start]
    payload = [
        request.block_hashes[k - 1] if k else b"",
        list(request.all_token_ids[start:num_prompt]),
        list(getattr(request, "lora_key", ()) or ()),
        getattr(request, "cache_salt", None),
        items,
    ]
    return blake2b(TAIL_DOMAIN + msgspec.msgpack.encode(payload), digest_size=32).digest()


def load_chain(request: KVRequest, block_size: int, tail: bytes | None) -> LoadChain:
    """What may be loaded for ``request``: the blocks holding its tokens but the last one. The
    last of them may be a full block of which only the first tokens are credited, or, given
    ``tail`` (the request's ``tail_hash``; only before it has outputs), its partial last
    block. Without a tail, a partial last block is left to compute."""
    wanted = request.num_tokens - 1
    needed = -(-wanted // block_size)  # blocks holding tokens [0, wanted)
    full = list(request.block_hashes[:needed])
    if len(full) == needed - 1 and tail is not None:
        return LoadChain([*full, tail], request.num_prompt_tokens % block_size, wanted)
    if len(full) < needed:
        full = full[: wanted // block_size]
    return LoadChain(full, 0, min(len(full) * block_size, wanted))


def chain_tokens(chain: LoadChain, found: int, block_size: int) -> int:
    """Tokens the first ``found`` values of ``chain`` credit."""
    return chain.tokens if found >= len(chain.hashes) else found * block_size

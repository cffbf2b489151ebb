"""``kv_transfer_params`` of an OpenAI request, validated at the edge (vLLM's field)."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

HexHash = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{1,128}$")]
MAX_BLOCKS = 1 << 16


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """What a prefill pod hands a decode pod (unknown keys, e.g. vLLM's, are ignored)."""

    do_remote_decode: bool = False  # to a prefill pod: save the prompt's blocks, hand them over
    do_remote_prefill: bool = False  # to a decode pod: a prefill pod saved these blocks
    block_hashes: Annotated[list[HexHash], msgspec.Meta(max_length=MAX_BLOCKS)] = []
    num_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    tail_hash: HexHash | None = None  # the prompt's partial last block, saved too
    # KV heads per stored value, as the prefill pod's ranks cut its blocks (its TP shape)
    kv_heads_per_value: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None
    pool: str | None = None
    fingerprint: str | None = None
    kv_connector: str | None = None


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def validate_kv_transfer_params(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """The known fields as plain values; ``ValueError("kv_transfer_params.FIELD: ...")``."""
    if raw is None:
        return None
    try:
        params = msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        field = "kv_transfer_params"
        if match and match.group(1):
            field += "." + match.group(1).split("[")[0]
        raise ValueError(f"{field}: {_PATH.sub('', message).strip(' -')}") from None
    return msgspec.to_builtins(params)

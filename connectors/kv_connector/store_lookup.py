"""What of a request's load chain (``load_chain.py``) the store holds, and how its values are
cut: looked up off the step loop, or trusted from a prefill pod's ``kv_transfer_params``.

Each rank of a pod stores one value per block holding its KV heads, so pods of different TP
sizes cut blocks differently (``part_heads``: KV heads per value). A lookup asks for this pod's
own cut first (one round trip: all a pool of one TP shape needs on a hit) and only when that
does not hold the whole chain asks the other cuts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from epdserve.connectors.storage import KVBlockIO


class Found(NamedTuple):
    """Leading values of a chain in the store, and the KV heads per value of that run."""

    count: int
    part_heads: int


def part_sizes(num_kv_heads: int) -> list[int]:
    """Every way a TP shape cuts a block: KV heads per value, the whole block first."""
    return [g for g in range(num_kv_heads, 0, -1) if num_kv_heads % g == 0]


def look_up(kv_io: KVBlockIO, hashes: list[bytes], own: int) -> Found:
    """The longest run of the chain's leading blocks stored whole under one cut: this pod's
    ``own`` when it holds the whole chain, else the longest of any (``own`` on a tie). Another
    cut can only run longer if it holds the first block ``own`` lacks: that block is asked
    for first (a miss in a pool of one TP shape costs this one small round trip more)."""
    best = Found(kv_io.count_cached_prefixes(hashes, [own])[0], own)
    if best.count == len(hashes):
        return best
    others = [g for g in part_sizes(kv_io.meta.num_kv_heads) if g != own]
    probe = kv_io.count_cached_prefixes(hashes[best.count : best.count + 1], others)
    others = [g for g, found in zip(others, probe, strict=True) if found]
    if not others:
        return best
    for g, count in zip(others, kv_io.count_cached_prefixes(hashes, others), strict=True):
        if count > best.count:
            best = Found(count, g)
    return best


def handed_over(
    params: dict[str, Any], hashes: list[bytes], with_tail: bool, fingerprint: str, pool: str
) -> tuple[Found | None, str | None]:
    """``(found, warning)``: the values of ``hashes`` (a request's chain, its tail last when
    ``with_tail``) a prefill pod says it saved, when its hashes, model and pool agree with ours
    (None: look them up instead; ``warning`` says why, when it is a misconfiguration)."""
    remote = list(params.get("block_hashes") or ())
    if params.get("tail_hash") and with_tail:
        remote.append(params["tail_hash"])  # their tail follows their full blocks
    if not params.get("do_remote_prefill") or not remote or not hashes:
        return None, None
    theirs = (params.get("fingerprint"), params.get("pool"))
    if theirs[0] not in (None, fingerprint) or theirs[1] not in (None, pool):
        return None, f"kv_transfer_params name model {theirs[0]} in pool {theirs[1]}, not ours"
    agree = 0
    for mine, their_hash in zip(hashes, remote, strict=False):
        if mine.hex() != their_hash:
            break
        agree += 1
    if agree == 0:
        return None, (
            "kv_transfer_params.block_hashes disagree with this pod's: do all pods of the "
            "pool share --hash-seed and --prefix-caching-hash-algo?"
        )
    return Found(agree, int(params.get("kv_heads_per_value") or 0)), None

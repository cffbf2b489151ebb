"""Engine test helpers: HF reference generations, cached per checkpoint."""

from __future__ import annotations

import random

import pytest
import torch

MAX_NEW = 16


def make_kv_request(
    req_id: str, tokens: list[int], block_size: int, seed: str = "s", algo: str = "sha256_cbor"
):
    """A bare ``Request`` whose block hashes follow its tokens (for KV-manager state tests)."""
    from epdserve.engine.core.hashing import BlockHasher, get_hash_fn, none_hash
    from epdserve.engine.core.request import Request
    from epdserve.engine.sampling_params import SamplingParams

    fn = get_hash_fn(algo)
    hasher = BlockHasher(block_size, fn, none_hash(fn, seed))
    return Request(req_id, tokens, SamplingParams(max_tokens=4), 2, hasher)


def make_prompts(n: int, seed: int = 0, shared_prefix: int = 32) -> list[list[int]]:
    """``n`` prompts of different lengths; every other one starts with a shared prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(10, 4000) for _ in range(shared_prefix)]
    prompts = []
    for i in range(n):
        length = 3 + (i * 97) % 120
        body = [rng.randrange(10, 4000) for _ in range(length)]
        prompts.append(prefix + body if i % 2 else body)
    return prompts


class HFReference:
    """Greedy continuations from transformers, computed once per (checkpoint, dtype)."""

    def __init__(self):
        self.cache = {}

    def greedy(self, path, prompts, max_new=MAX_NEW, dtype=torch.float32) -> list[list[int]]:
        import json
        from pathlib import Path

        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        key = (str(path), dtype, max_new, tuple(map(tuple, prompts)))
        if key not in self.cache:
            image_text = "vision_config" in json.loads((Path(path) / "config.json").read_text())
            auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
            model = auto.from_pretrained(path, dtype=dtype)
            model.generation_config.eos_token_id = None  # compare with ignore_eos=True
            outs = []
            with torch.inference_mode():
                for p in prompts:
                    ids = torch.tensor([p])
                    gen = model.generate(
                        ids,
                        max_new_tokens=max_new,
                        do_sample=False,
                        attention_mask=torch.ones_like(ids),
                    )
                    outs.append(gen[0, len(p) :].tolist())
            self.cache[key] = outs
        return self.cache[key]

    def next_logits(self, path, prefixes, dtype=torch.float32) -> list[torch.Tensor]:
        """transformers' logits for the token after each of ``prefixes`` (fp32 values)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        with torch.inference_mode():
            return [model(torch.tensor([p])).logits[0, -1].float() for p in prefixes]


@pytest.fixture(scope="session")
def hf_reference() -> HFReference:
    return HFReference()


def assert_no_leak(llm) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks() == llm.engine.num_blocks - 1, "KV blocks leaked"
    kv.pool.check_integrity()

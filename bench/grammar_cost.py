"""The worst compile time of a JSON schema that passes the API's checks (issue #41), one JSON.

Each family below grows one dimension of a schema (optional properties with the costliest
values and names, counted or open objects, many objects, and the linear shapes: a large
const, anyOf branches, enums, required properties, prefixItems). For each, the largest size
that ``backend.validate`` accepts (the keyword check, the pattern budget, ``schema_cost``'s
bound and the 64 KB spec limit) is found by bisection and compiled with xgrammar as the
engine core does (``Compiler``, 4 threads at most, no cache), best of ``--repeats``; the
schema's estimate is printed beside it. ``refused`` times the issue's own example (1000
optional integers), which the API now refuses, for scale.

The vocabulary: the ``tiny`` make-model tokenizer (4k tokens) by default, ``--model DIR`` a
checkpoint's, or ``--vocab N`` N random tokens (a real model's vocabulary size; compile time
grows with it).

    python bench/grammar_cost.py [--repeats 2] [--model DIR | --vocab 131072] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

INT = {"type": "integer"}
UNION = {"type": ["string", "integer", "null", "boolean", "number"]}


def optional(n: int, value=INT, name=lambda i: f"p{i}") -> dict:
    return {"type": "object", "properties": {name(i): value for i in range(n)}}


FAMILIES = {
    "optional_integers": lambda k: optional(k),
    "optional_unions": lambda k: optional(k, UNION),
    "optional_untyped": lambda k: optional(k, {}),
    "optional_anyof": lambda k: optional(k, {"anyOf": [INT, {"type": "string"}, {"type": "null"}]}),
    "optional_digit_names": lambda k: optional(k, INT, lambda i: f"{i:040d}"),
    "optional_max_properties": lambda k: {**optional(k), "maxProperties": max(k - 1, 1)},
    "optional_min_properties": lambda k: {**optional(k), "minProperties": max(k // 10, 1)},
    "optional_open": lambda k: {**optional(k), "additionalProperties": INT},
    "objects_of_25_optional": lambda k: optional(k, optional(25)),
    "objects_of_75_optional": lambda k: optional(k, optional(75)),
    "const_object": lambda k: {"const": {f"k{i}": [i, str(i)] for i in range(k)}},
    "anyof_objects": lambda k: {
        "anyOf": [
            {"type": "object", "properties": {f"a{i}": INT, "b": INT}, "required": [f"a{i}", "b"]}
            for i in range(k)
        ]
    },
    "enum_strings": lambda k: {"enum": [f"v{i}" for i in range(k)]},
    "required_integers": lambda k: {**optional(k), "required": [f"p{i}" for i in range(k)]},
    "prefix_items": lambda k: {"type": "array", "prefixItems": [INT] * k, "items": False},
}
REFUSED = optional(1000)  # the issue's example: 4.1 s before the bound


def passes(schema: dict) -> bool:
    from epdserve.engine.structured import StructuredOutputsParams, backend

    try:
        backend.validate(StructuredOutputsParams(json=schema))
    except ValueError:
        return False
    return True


def largest_passing(family, hi: int = 16384) -> int:
    """The largest size the API accepts (sizes are assumed to pass up to a point)."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if passes(family(mid)) else (lo, mid - 1)
    return lo


def tokenizer_info(args):
    import xgrammar as xgr

    from epdserve.engine.structured.backend import tokenizer_info as model_info

    if args.vocab:
        rng, chars = random.Random(0), 'abcdefghijklmnopqrstuvwxyz0123456789 ,:{}[]"_-.'
        vocab: set[str] = set()
        while len(vocab) < args.vocab:
            vocab.add("".join(rng.choice(chars) for _ in range(rng.randint(1, 8))))
        return xgr.TokenizerInfo(sorted(vocab), vocab_size=args.vocab, stop_token_ids=[0])
    model = args.model
    if model is None:
        from epdserve.engine.make_model import make_model

        model = make_model("llama", tempfile.mkdtemp(prefix="grammar-cost-"), 0, "tiny")
    from epdserve.engine.models.config import load_model_config

    cfg = load_model_config(str(model))
    return model_info(model, cfg.vocab_size, list(cfg.eos_token_ids))


def compile_s(compiler, schema: dict, repeats: int) -> float:
    from epdserve.engine.structured import StructuredOutputsParams

    params = StructuredOutputsParams(json=schema)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        compiler.compile(params)
        best = min(best, time.perf_counter() - start)
    return round(best, 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=None)
    parser.add_argument("--vocab", type=int, default=0)
    parser.add_argument("--only", action="append", choices=sorted(FAMILIES))
    args = parser.parse_args(argv)
    from epdserve.engine.structured.backend import Compiler
    from epdserve.engine.structured.schema_cost import MAX_COMPILE_COST, SchemaCost

    compiler = Compiler(tokenizer_info(args), threads=min(4, os.cpu_count() or 1))
    families = {}
    for name in args.only or FAMILIES:
        size = largest_passing(FAMILIES[name])
        schema = FAMILIES[name](size)
        families[name] = {
            "size": size,
            "bytes": len(json.dumps(schema)),
            "estimate": SchemaCost().add(schema).total,
            "compile_s": compile_s(compiler, schema, args.repeats),
        }
        print(name, families[name], file=sys.stderr, flush=True)
    worst = max(families, key=lambda n: families[n]["compile_s"])
    out = {
        "vocab": args.vocab or args.model or "tiny (4096)",
        "cpus": os.cpu_count(),
        "max_compile_cost": MAX_COMPILE_COST,
        "families": families,
        "worst": {"family": worst, **families[worst]},
        "refused_example_s": compile_s(compiler, REFUSED, 1),
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

"""xgrammar, the grammar backend (vLLM's default): specs checked, compiled, matched.

``validate`` needs no tokenizer: the API process calls it so a bad schema, regex or grammar
is the request's 400 before the core sees it. ``Compiler`` (core side) compiles against the
model's vocabulary.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from pathlib import Path

from epdserve.engine.structured.params import StructuredOutputsParams
from epdserve.engine.structured.schema_check import check_schema, tag_schemas
from epdserve.engine.structured.schema_cost import SchemaCost

# JSON mode (``json_object``) means an object, as OpenAI documents it, not any JSON value
JSON_OBJECT = '{"type": "object"}'
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def _message(exc: Exception) -> str:
    """xgrammar's C++ message without its timestamp and source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _CPP_PREFIX.sub("", text)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF alternation of the literal choices (JSON escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# a length-bounded string without a pattern, as a pattern that keeps JSON's forbidden raw
# characters out: xgrammar 0.2.9 lets control characters into minLength/maxLength strings
_BOUNDED = r'^[^"\\\x00-\x1f]{%d,%s}$'


def _bounded_strings(schema):
    """``schema`` with every string type (alone or in a type list) that has minLength/maxLength (and no pattern
    or format) rewritten as a pattern of the same lengths (the copy keeps key order)."""
    if isinstance(schema, list):
        return [_bounded_strings(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _bounded_strings(v) for k, v in schema.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    lengths = [v for v in (lo, hi) if v is not None]
    if (
        (
            out.get("type") == "string"
            or isinstance(out.get("type"), list)
            and "string" in out["type"]
        )
        and lengths
        and all(isinstance(v, int) and not isinstance(v, bool) for v in lengths)
        and "pattern" not in out
        and "format" not in out
    ):
        out.pop("minLength", None), out.pop("maxLength", None)
        out["pattern"] = _BOUNDED % (lo or 0, "" if hi is None else hi)
    return out


def schema_text(params: StructuredOutputsParams) -> str:
    """The JSON schema xgrammar compiles (see ``_bounded_strings``)."""
    return json.dumps(_bounded_strings(params.json), ensure_ascii=False)


def _json_kwargs(params: StructuredOutputsParams) -> dict:
    if params.disable_any_whitespace:  # compact, as vLLM writes it: no space after , or :
        return {"any_whitespace": False, "separators": (",", ":"), "strict_mode": True}
    return {"any_whitespace": True, "strict_mode": True}


def _grammar(params: StructuredOutputsParams):
    """The xgrammar ``Grammar`` of a spec (raises RuntimeError/ValueError when malformed)."""
    import xgrammar as xgr

    kind = params.kind
    if kind == "json":
        return xgr.Grammar.from_json_schema(schema_text(params), **_json_kwargs(params))
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT, **_json_kwargs(params))
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(params.grammar)
    return xgr.Grammar.from_structural_tag(params.spec_text())


VALID_ENTRIES = 1024  # specs known to be valid, so a repeated one is not built again
_VALID: OrderedDict[tuple, None] = OrderedDict()
_VALID_LOCK = threading.Lock()  # validate runs in worker threads


def validate(params: StructuredOutputsParams, field: str | None = None) -> None:
    """``ValueError("<field>: ...")`` when the spec does not build a grammar, a JSON schema
    in it has keywords the grammar would not enforce (``schema_check``), or its schemas would
    take too long to compile (``schema_cost``)."""
    key = params.key()
    with _VALID_LOCK:
        if key in _VALID:  # the same spec again (the common case): checked already
            _VALID.move_to_end(key)
            return
    name = field or f"structured_outputs.{params.kind}"
    schemas = [params.json] if params.kind == "json" else []
    if params.kind == "structural_tag":
        schemas = tag_schemas(params.structural_tag)
    spent, cost = [0], SchemaCost()  # one budget of each kind for all of a tag's schemas
    try:
        for schema in schemas:  # keywords xgrammar would ignore, patterns too costly to build
            check_schema(schema, spent)
            cost.add(schema)
        cost.check()  # checked before the build: an over-long one costs nothing more
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    try:
        _grammar(params)
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError/its own types
        raise ValueError(f"{name}: {_message(exc)}") from None
    with _VALID_LOCK:
        _VALID[key] = None
        while len(_VALID) > VALID_ENTRIES:
            _VALID.popitem(last=False)


def tokenizer_info(model_dir: str | Path, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the model's vocabulary (``vocab_size``: the logits' width)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(model_dir) / "tokenizer.json"))
    return xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
    )


class Compiler:
    """Compiles specs against one vocabulary (thread-safe; xgrammar releases the GIL)."""

    def __init__(self, info, threads: int = 1):
        import xgrammar as xgr

        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def compile(self, params: StructuredOutputsParams):
        c, kind = self._compiler, params.kind
        try:
            if kind == "json":
                return c.compile_json_schema(schema_text(params), **_json_kwargs(params))
            if kind == "json_object":
                return c.compile_json_schema(JSON_OBJECT, **_json_kwargs(params))
            if kind == "regex":
                return c.compile_regex(params.regex)
            if kind == "choice":
                return c.compile_grammar(choice_grammar(params.choice))
            if kind == "grammar":
                return c.compile_grammar(params.grammar)
            return c.compile_structural_tag(params.spec_text())
        except Exception as exc:
            raise ValueError(f"structured_outputs.{kind}: {_message(exc)}") from None

"""The whole corpus as ``Spec``s (schemas, regexes, choices, grammars) and the check of one
output against its spec, written apart from xgrammar: ``json.loads`` (strict, no repeated
keys) plus ``jsonschema`` with format checks, ``re.fullmatch``, membership, the grammars'
own checkers."""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from jsonschema import Draft202012Validator
from so_grammars import GRAMMARS
from so_schemas import SCHEMAS

from epdserve.engine.structured import StructuredOutputsParams

REGEXES: dict[str, tuple[str, str, str]] = {  # name -> (regex, a match, a non-match)
    "phone": (r"\d{3}-\d{4}", "555-1234", "5551234"),
    "paren_phone": (r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567", "555 123-4567"),
    "email_like": (r"[a-z]{1,8}@[a-z]{1,8}\.(com|org|net)", "bo@ex.org", "bo@ex.de"),
    "hex_color": (r"#[0-9a-fA-F]{6}", "#00ffAA", "#00ffA"),
    "iso_date": (r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "2024-12-31", "2024-13-01"),
    "clock": (r"([01]\d|2[0-3]):[0-5]\d(:[0-5]\d)?", "23:59:01", "24:00"),
    "semver": (r"v?\d{1,2}\.\d{1,2}\.\d{1,2}(-(alpha|beta|rc)\.\d)?", "v1.2.3-rc.1", "1.2"),
    "plural_pet": (r"(cat|dog|bird)s?", "dogs", "cow"),
    "title_words": (r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}", "Big Red Dog", "big dog"),
    "identifier": (r"[a-z_][a-z0-9_]{0,7}", "_x9", "9x"),
    "decimal": (r"-?\d{1,3}(\.\d{1,2})?", "-12.5", "12."),
    "url": (r"https?://[a-z]{1,8}\.(com|io)(/[a-z]{1,5}){0,2}", "https://ab.io/x/y", "ftp://a.io"),
    "greek": (r"[αβγδ]{1,3}", "αδ", "αe"),
    "not_quotes": (r"[^\x00-\x1f\"\\]{1,5}", "a b!", 'a"'),
    "anchored": (r"^(on|off)$", "on", "onoff"),
}

CHOICES: dict[str, list[str]] = {
    "yes_no": ["yes", "no"],
    "colors": ["red", "green", "blue", "yellow"],
    "prefixes": ["a", "ab", "abc"],
    "escapes": ['say "hi"', "back\\slash", "new\nline"],
    "unicode": ["café", "naïve", "日本"],
    "sentiment": ["positive", "negative", "neutral"],
    "spaces": [" leading space", "trailing space "],
    "many": [f"option_{k}" for k in range(50)],
}

# small JSON schemas also decoded with free whitespace (a random model may run on in it)
WHITESPACE_SCHEMAS = ("object_flat", "enum_mixed", "array_of_enums", "anyof_primitives")


class Spec(NamedTuple):
    name: str
    kind: str  # a StructuredOutputsParams field
    value: object
    disable_any_whitespace: bool = True
    must_finish: bool = True  # a random model completes it well within the tests' max_tokens

    def params(self) -> StructuredOutputsParams:
        kw = {self.kind: self.value}
        if self.kind in ("json", "json_object"):
            kw["disable_any_whitespace"] = self.disable_any_whitespace
        return StructuredOutputsParams(**kw)

    def wire(self) -> dict:
        """The request's vLLM ``structured_outputs`` object."""
        out = {self.kind: self.value}
        if self.kind in ("json", "json_object") and self.disable_any_whitespace:
            out["disable_any_whitespace"] = True
        return out


def all_specs() -> list[Spec]:
    specs = [Spec(f"json:{k}", "json", v) for k, v in SCHEMAS.items()]
    specs += [Spec(f"json_ws:{k}", "json", SCHEMAS[k], False, False) for k in WHITESPACE_SCHEMAS]
    specs.append(Spec("json_object", "json_object", True, True, False))  # free strings run on
    specs += [Spec(f"regex:{k}", "regex", v[0]) for k, v in REGEXES.items()]
    specs += [Spec(f"choice:{k}", "choice", v) for k, v in CHOICES.items()]
    specs += [Spec(f"grammar:{k}", "grammar", g.ebnf) for k, g in GRAMMARS.items()]
    return specs


def _no_repeated_keys(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"repeated keys {keys}")
    return dict(pairs)


def parse_json(text: str):
    """``json.loads`` as a strict client parses: no control characters in strings, and (a
    check of ours) no key twice in one object."""
    return json.loads(text, object_pairs_hook=_no_repeated_keys)


def check(spec: Spec, text: str) -> str | None:
    """None when ``text`` (a finished output) is in the spec's language, else why not."""
    if spec.kind in ("json", "json_object"):
        try:
            value = parse_json(text)
        except ValueError as exc:
            return f"not JSON: {exc}"
        if spec.kind == "json_object":
            return None if isinstance(value, dict) else "not an object"
        validator = Draft202012Validator(
            spec.value, format_checker=Draft202012Validator.FORMAT_CHECKER
        )
        errors = [e.message for e in validator.iter_errors(value)]
        return "; ".join(errors) or None
    if spec.kind == "regex":
        return None if re.fullmatch(spec.value, text, re.ASCII) else "no full match"
    if spec.kind == "choice":
        return None if text in spec.value else "not one of the choices"
    return GRAMMARS[spec.name.partition(":")[2]].check(text)

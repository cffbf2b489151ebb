"""The corpus' EBNF grammars, each with a checker written apart from xgrammar, and one string
the grammar accepts and one it refuses (so that the checker itself is tested)."""

from __future__ import annotations

import ast
import csv
import io
import json
import re
from typing import NamedTuple


class Grammar(NamedTuple):
    ebnf: str
    check: object  # text -> None when the text is in the language, else why not
    good: str
    bad: str


def _full(pattern: str):
    compiled = re.compile(pattern, re.ASCII)
    return lambda text: None if compiled.fullmatch(text) else f"not {pattern!r}"


ARITH = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,2}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" inner ")"
inner ::= iterm (("+" | "-") iterm){0,2}
iterm ::= num (("*" | "/") num){0,2}
num ::= "0" | [1-9] [0-9]{0,2}
"""


def check_arith(text: str) -> str | None:
    """An arithmetic expression of integers with + - * / and parentheses nested once."""
    if not re.fullmatch(r"[0-9+\-*/()]+", text):
        return "characters outside digits, + - * / and parentheses"
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth > 1 or depth < 0:
            return "parentheses nested deeper than once or unbalanced"
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        return f"not an expression: {exc.msg}"
    allowed = (ast.Expression, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Constant)
    for node in ast.walk(tree):
        if not isinstance(node, allowed) or (
            isinstance(node, ast.Constant) and not isinstance(node.value, int)
        ):
            return f"{type(node).__name__} is not part of the language"
    return None


NESTED = r"""
root ::= l1
l1 ::= "[" (i1 ("," i1){0,2})? "]"
i1 ::= l2 | digit
l2 ::= "[" (i2 ("," i2){0,2})? "]"
i2 ::= l3 | digit
l3 ::= "[" (digit ("," digit){0,2})? "]"
digit ::= [0-9]
"""


def check_nested(text: str) -> str | None:
    """Lists of digits, at most 3 items each, nested at most 3 deep, no spaces."""
    try:
        value = json.loads(text)
    except ValueError:
        return "not a JSON list"
    if json.dumps(value, separators=(",", ":")) != text:
        return "spaces or a non-canonical form"

    def ok(v, depth: int) -> bool:
        if isinstance(v, list):
            return depth <= 3 and len(v) <= 3 and all(ok(x, depth + 1) for x in v)
        return isinstance(v, int) and 0 <= v <= 9 and depth > 1

    return None if isinstance(value, list) and ok(value, 1) else "shape outside the grammar"


CSV = r"""
root ::= "name,qty\n" row ("\n" row){0,2}
row ::= [a-z]{1,6} "," [0-9]{1,3}
"""


def check_csv(text: str) -> str | None:
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or rows[0] != ["name", "qty"] or not 2 <= len(rows) <= 4:
        return "wrong header or row count"
    for row in rows[1:]:
        if (
            len(row) != 2
            or not re.fullmatch(r"[a-z]{1,6}", row[0])
            or not re.fullmatch(r"[0-9]{1,3}", row[1])
        ):
            return f"bad row {row!r}"
    return None if not text.endswith("\n") else "trailing newline"


_LIT = r"(not )?(true|false|x|y)"
_CONJ = rf"{_LIT}( and {_LIT}){{0,2}}"

GRAMMARS: dict[str, Grammar] = {
    "arithmetic": Grammar(ARITH, check_arith, "12*(3+4)-5", "12*((3))"),
    "nested_lists": Grammar(NESTED, check_nested, "[[1,[2]],3]", "[[[[1]]]]"),
    "csv_rows": Grammar(CSV, check_csv, "name,qty\nab,12\nc,3", "name,qty\nAB,1"),
    "key_values": Grammar(
        'root ::= pair ("&" pair){0,3}\npair ::= [a-z]{1,6} "=" [a-zA-Z0-9]{0,6}',
        _full(r"[a-z]{1,6}=[a-zA-Z0-9]{0,6}(&[a-z]{1,6}=[a-zA-Z0-9]{0,6}){0,3}"),
        "a=1&bc=X2",
        "a=1&&b=2",
    ),
    "sql_select": Grammar(
        r"""
root ::= "SELECT " cols " FROM " table where? ";"
cols ::= "*" | col (", " col){0,2}
col ::= "id" | "name" | "age"
table ::= "users" | "orders"
where ::= " WHERE " col " " [=<>] " " val
val ::= [0-9]{1,4} | "'" [a-z]{1,6} "'"
""",
        _full(
            r"SELECT (\*|(id|name|age)(, (id|name|age)){0,2}) FROM (users|orders)"
            r"( WHERE (id|name|age) [=<>] ([0-9]{1,4}|'[a-z]{1,6}'))?;"
        ),
        "SELECT id, age FROM users WHERE name = 'bob';",
        "SELECT * FROM users WHERE;",
    ),
    "boolean_logic": Grammar(
        'root ::= conj (" or " conj){0,2}\nconj ::= lit (" and " lit){0,2}\n'
        'lit ::= ("not ")? ("true" | "false" | "x" | "y")',
        _full(rf"{_CONJ}( or {_CONJ}){{0,2}}"),
        "x and not y or true",
        "x and or y",
    ),
    "function_call": Grammar(
        r"""
root ::= name "(" args? ")"
name ::= "get_weather" | "search" | "send_mail"
args ::= arg (", " arg){0,2}
arg ::= [a-z]{1,5} "=" (str | int)
str ::= "\"" [a-z ]{0,8} "\""
int ::= "-"? [0-9]{1,3}
""",
        _full(
            r'(get_weather|search|send_mail)\(([a-z]{1,5}=("[a-z ]{0,8}"|-?[0-9]{1,3})'
            r'(, [a-z]{1,5}=("[a-z ]{0,8}"|-?[0-9]{1,3})){0,2})?\)'
        ),
        'search(q="cats", n=3)',
        "search(q=cats)",
    ),
    "json_by_ebnf": Grammar(
        'root ::= "{\\"ok\\":" ("true" | "false") ",\\"n\\":" [0-9]{1,2} "}"',
        lambda t: (
            None
            if (v := _json_or_none(t)) is not None
            and set(v) == {"ok", "n"}
            and isinstance(v["ok"], bool)
            and 0 <= v["n"] <= 99
            else "not the object"
        ),
        '{"ok":true,"n":42}',
        '{"ok":1,"n":42}',
    ),
    "greek_letters": Grammar(
        'root ::= ("α" | "β" | "γ" | "ω"){1,4} "!"', _full("[αβγω]{1,4}!"), "αωβ!", "αδ!"
    ),
}


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None

"""What a regular expression inside a JSON schema costs xgrammar to build.

A schema's ``pattern`` becomes grammar rules with every counted repetition of a group spelled
out: ``(a|b|c){1,5000}`` takes xgrammar 0.2.9 15 s to build, while a bare ``[a-z]{1,60000}``
or a ``regex`` spec costs nothing. Measured, a group repeated up to ``B`` times around a body
of expanded length ``L`` costs about ``B * B * L`` (8 million: ~1 s), nested groups counting
their inner repetitions in ``L``. Schemas keep the sum over their patterns bounded.
"""

from __future__ import annotations

import re

MAX_SCHEMA_COST = 2_000_000  # all patterns of one schema: ~0.25 s to build

_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def pattern_cost(pattern: str) -> int:
    """``sum(B * B * L)`` over the counted groups of ``pattern`` (see the module's note)."""
    lengths: list[int] = [0]  # the expanded length of each open group so far
    cost, last = 0, 0  # last: the expanded length of the atom just read
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "(":
            lengths.append(0)
            i += 3 if pattern.startswith("?", i + 1) else 1  # (?: (?= (?!: no atom
            continue
        if c == ")" and len(lengths) > 1:
            body = lengths.pop()
            bound, i = _count(pattern, i + 1)
            if bound is not None:
                cost += bound * bound * max(body, 1)
                body *= bound
            lengths[-1] += body
            last = 0  # already counted
            continue
        if c == "{":
            bound, j = _count(pattern, i)
            if bound is not None:  # a counted character, class or escape
                lengths[-1] += (bound - 1) * last
                i, last = j, 0
                continue
        if c == "\\":
            i += 2
        elif c == "[":
            i = _skip_class(pattern, i)
        else:
            i += 1
        last = 0 if c in "|?*+^$" else 1
        lengths[-1] += last
    return cost


def _count(pattern: str, i: int) -> tuple[int | None, int]:
    """A ``{m}``, ``{m,}`` or ``{m,n}`` at ``i``: its largest count, and where it ends."""
    match = _COUNT.match(pattern, i)
    if match is None:
        return None, i
    low, upper = int(match.group(1)), match.group(3)
    return max(int(upper) if upper else low, 1), match.end()


def _skip_class(pattern: str, i: int) -> int:
    """The index after the character class opening at ``i``."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1

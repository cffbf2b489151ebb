"""An incremental reader of one tool-call JSON object, ``{"name": ..., "arguments": ...}``.

Text arrives in pieces of any size; the scanner reads each character once and records where
the call's name and its arguments value lie, so a stream can announce the call as soon as its
name is whole and then pass the arguments' own text on as it grows. It interprets only the
object's top level: braces, brackets and quotes inside values and strings cannot confuse it.
"""

from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 templates say "parameters"

# what the scanner expects next at the object's top level
_KEY, _COLON, _VALUE, _STRING, _CONTAINER, _SCALAR, _AFTER = range(7)


class CallScanner:
    """Reads one JSON object from its ``{``; ``feed`` stops at the closing ``}``.

    ``name`` is set once its string is closed; ``args_start``/``args_end`` delimit the
    arguments value in ``text`` (``args_end`` is None while it grows). ``bad`` means the text
    is not such an object; ``closed`` that the object ended and parsed as JSON.
    """

    def __init__(self, argument_keys: tuple[str, ...] = ARGUMENT_KEYS):
        self.argument_keys = argument_keys
        self.text = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.closed = False
        self.bad = False
        self._depth = 0
        self._in_string = self._escaped = False
        self._expect = _KEY
        self._key: str | None = None
        self._start = 0  # where the current key or value began

    @property
    def done(self) -> bool:
        return self.closed or self.bad

    @property
    def ready(self) -> bool:
        """Its name is known and its arguments have begun: a stream may announce it."""
        return not self.bad and self.name is not None and self.args_start is not None

    def arguments_text(self) -> str:
        """The arguments value's text read so far."""
        if self.args_start is None:
            return ""
        end = self.args_end if self.args_end is not None else len(self.text)
        return self.text[self.args_start : end]

    def feed(self, chunk: str) -> int:
        """Read ``chunk``; returns how many of its characters belong to the object."""
        if self.done:
            return 0
        base = len(self.text)
        self.text += chunk
        for i, ch in enumerate(chunk):
            self._step(ch, base + i)
            if self.done:
                self.text = self.text[: base + i + 1]
                return i + 1
        return len(chunk)

    def _step(self, ch: str, pos: int) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._depth == 1:
                    self._string_closed(pos)
            return
        if self._depth == 0:  # the object's opening brace
            if ch == "{":
                self._depth = 1
            elif not ch.isspace():
                self.bad = True
            return
        if self._depth > 1:  # inside a container value: only nesting and strings matter
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1:
                    self._end_value(pos + 1)
            return
        self._top_level(ch, pos)

    def _top_level(self, ch: str, pos: int) -> None:
        expect = self._expect
        if expect == _SCALAR:
            if ch in ",}" or ch.isspace():
                self._end_value(pos)
                expect = self._expect
            else:
                return
        if ch.isspace():
            return
        if ch == '"' and expect in (_KEY, _VALUE):
            self._in_string, self._start = True, pos
            if expect == _VALUE:
                self._begin_value(pos, _STRING)
        elif ch == ":" and expect == _COLON:
            self._expect = _VALUE
        elif ch in "{[" and expect == _VALUE:
            self._begin_value(pos, _CONTAINER)
            self._depth += 1
        elif ch == "," and expect == _AFTER:
            self._expect, self._key = _KEY, None
        elif ch == "}" and expect in (_AFTER, _KEY):
            self._close(pos)
        elif expect == _VALUE and ch not in ",:}]":
            self._begin_value(pos, _SCALAR)
        else:
            self.bad = True

    def _string_closed(self, pos: int) -> None:
        if self._expect == _KEY:
            try:
                self._key = json.loads(self.text[self._start : pos + 1])
            except json.JSONDecodeError:
                self.bad = True
            self._expect = _COLON
        else:
            self._end_value(pos + 1)

    def _begin_value(self, pos: int, kind: int) -> None:
        self._start, self._expect = pos, kind
        if self._key in self.argument_keys and self.args_start is None:
            self.args_start = pos

    def _end_value(self, end: int) -> None:
        if self.args_start == self._start and self.args_end is None:
            self.args_end = end
        elif self._key == "name" and self.name is None:
            if self._expect != _STRING:
                self.bad = True
                return
            try:
                self.name = json.loads(self.text[self._start : end])
            except json.JSONDecodeError:
                self.bad = True
        self._expect = _AFTER

    def _close(self, pos: int) -> None:
        self._depth = 0
        try:
            json.loads(self.text[: pos + 1])
        except json.JSONDecodeError:
            self.bad = True
            return
        self.closed = True

"""The jinja environment chat templates run in: transformers' sandbox, rebuilt without it.

Chat templates come with checkpoints, so they are untrusted code: an immutable sandbox, and
namespaces that refuse underscore attributes. Besides jinja's own, templates get what
transformers gives them: ``trim_blocks``/``lstrip_blocks``, loop controls, the
``{% generation %}`` tag, a ``tojson`` that does not escape HTML, ``raise_exception``,
``strftime_now`` and ``dict``.
"""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (no reach into internals)."""

    def __init__(*args, **kwargs):  # jinja's own signature trick: ``namespace(self=...)`` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore attributes on a namespace ({name!r})"
            )


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def template_environment() -> ImmutableSandboxedEnvironment:
    """A fresh environment (compile each template once and keep it)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_Dict(),
        namespace=_Namespace,
    )
    return env

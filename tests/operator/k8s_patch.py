"""Pure helpers of the API emulator: patch flavours and label/field selectors.

Approximations (documented, deliberate): a strategic-merge patch is applied as a JSON merge
patch (lists are replaced, not merged by key), and a server-side apply replaces every
top-level field it names except metadata (labels/annotations are merged), as one field
manager owning those fields would see it.
"""

from __future__ import annotations

import copy
import re

SERVER_FIELDS = ("uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp")


class PatchError(ValueError):
    """A patch that cannot apply (maps to 422 Unprocessable Entity)."""


def merge_patch(target, patch):
    """RFC 7386 JSON merge patch (None deletes a key)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"bad JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc, parts: list[str]):
    for part in parts:
        if isinstance(doc, list):
            doc = doc[int(part)]
        elif isinstance(doc, dict):
            doc = doc[part]
        else:
            raise KeyError(part)
    return doc


def json_patch(target: dict, ops: list[dict]) -> dict:
    """RFC 6902 add/remove/replace/test (what kopf and kubectl send)."""
    doc = copy.deepcopy(target)
    for op in ops:
        parts = _pointer(op.get("path", ""))
        kind = op.get("op")
        try:
            if kind == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise PatchError(f"test failed at {op['path']}")
                continue
            parent, last = _walk(doc, parts[:-1]), parts[-1]
            if kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind in ("add", "replace"):
                value = copy.deepcopy(op.get("value"))
                if isinstance(parent, list):
                    index = len(parent) if last == "-" else int(last)
                    if kind == "add":
                        parent.insert(index, value)
                    else:
                        parent[index] = value
                else:
                    if kind == "replace" and last not in parent:
                        raise PatchError(f"replace of missing {op['path']}")
                    parent[last] = value
            else:
                raise PatchError(f"unsupported op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            if isinstance(exc, PatchError):
                raise
            raise PatchError(f"{kind} {op.get('path')}: {exc}") from exc
    return doc


def server_side_apply(live: dict, applied: dict) -> dict:
    """Apply configuration `applied` over `live` (single-manager approximation)."""
    result = copy.deepcopy(live)
    for key, value in applied.items():
        if key == "metadata":
            meta = result.setdefault("metadata", {})
            for field, sub in value.items():
                if field in ("labels", "annotations"):
                    meta[field] = {**(meta.get(field) or {}), **sub}
                elif field not in SERVER_FIELDS:
                    meta[field] = copy.deepcopy(sub)
        elif key != "status":
            result[key] = copy.deepcopy(value)
    return result


_EXPR = re.compile(
    r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$"
)


def _split(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    return [p for p in parts + [current] if p.strip()]


def match_labels(selector: str | None, labels: dict | None) -> bool:
    """Kubernetes label-selector syntax: =, ==, !=, in, notin, exists, !exists."""
    labels = labels or {}
    for expr in _split(selector or ""):
        m = _EXPR.match(expr)
        if not m:
            raise PatchError(f"bad label selector {expr!r}")
        negate, key, op, value, set_op, values = m.groups()
        if op in ("=", "=="):
            ok = labels.get(key) == value
        elif op == "!=":
            ok = labels.get(key) != value
        elif set_op:
            choices = {v.strip() for v in values.split(",")}
            ok = (labels.get(key) in choices) == (set_op == "in") and (
                set_op == "notin" or key in labels
            )
        else:
            ok = (key in labels) != bool(negate)
        if not ok:
            return False
    return True


def match_fields(selector: str | None, obj: dict) -> bool:
    """Field selectors on metadata.name / metadata.namespace (what kubectl uses)."""
    meta = obj.get("metadata") or {}
    for expr in _split(selector or ""):
        key, _, value = expr.replace("==", "=").partition("=")
        negate = key.endswith("!")
        key = key.rstrip("!").strip()
        actual = meta.get(key.split(".", 1)[1]) if key.startswith("metadata.") else None
        if (actual == value.strip()) == negate:
            return False
    return True

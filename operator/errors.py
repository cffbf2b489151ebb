"""The operator's error for specs it cannot realise (its own module, so every spec parser,
spec.py and the ones it imports, raises the same class)."""


class InvalidSpec(ValueError):
    """A spec the schema accepts but the operator cannot realise; the message names the field."""

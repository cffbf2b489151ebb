"""The operator's side of the KV-event sockets (pure but for key generation).

Engines bind their PUB and replay sockets to the pod IP they get from the downward API
(`EPDSERVE_POD_IP`). With CurveZMQ on (the default), each pool has one Secret
`<pool>-kv-events-curve` holding a server and a client key pair; engine pods mount the server
pair and the client's public key (so they admit that client only), router pods the client
pair and the server's public key. Each file holds one key as its 40-character Z85 text.
"""

from __future__ import annotations

import base64

from epdserve.operator import meta
from epdserve.operator.spec import PoolSpec

CURVE_DIR = "/etc/epdserve/kv-events-curve"
CURVE_VOLUME = "kv-events-curve"
CURVE_KEYS = ("server.public", "server.secret", "client.public", "client.secret")
ENGINE_KEYS = ("server.public", "server.secret", "client.public")  # never the client secret
ROUTER_KEYS = ("client.public", "client.secret", "server.public")  # never the server secret


class CurveUnavailable(Exception):
    """This operator's libzmq was built without CURVE (libsodium): it cannot make keys."""


def curve_enabled(pool: PoolSpec) -> bool:
    """Whether the pool's KV-event sockets use CurveZMQ."""
    return pool.kv_events and pool.kv_events_curve


def curve_secret_name(pool: PoolSpec) -> str:
    return meta.name_of(pool, "kv-events-curve")


def new_curve_keys() -> dict[str, bytes]:
    """Fresh server and client key pairs, Z85-encoded (the only impure helper here)."""
    import zmq  # the operator extra installs pyzmq; imported here so builders stay light

    if not zmq.has("curve"):
        raise CurveUnavailable(
            "this operator's libzmq has no CURVE support; set spec.kvEvents.curve: false or "
            "run an operator image whose pyzmq bundles libsodium"
        )
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    keys = (server_public, server_secret, client_public, client_secret)
    return dict(zip(CURVE_KEYS, keys, strict=True))


def build_curve_secret(pool: PoolSpec, keys: dict[str, bytes]) -> dict:
    """Secret `<pool>-kv-events-curve` with the four keys; created once, never overwritten."""
    assert set(keys) == set(CURVE_KEYS), f"curve keys: {sorted(keys)}"
    data = {name: base64.b64encode(keys[name]).decode() for name in CURVE_KEYS}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta.metadata(pool, curve_secret_name(pool), "kv-events"),
        "type": "Opaque",
        "data": data,
    }


def _curve_volume(pool: PoolSpec, keys: tuple[str, ...]) -> dict:
    items = [{"key": k, "path": k} for k in keys]
    return {"name": CURVE_VOLUME, "secret": {"secretName": curve_secret_name(pool), "items": items}}


def _curve_mount() -> dict:
    return {"name": CURVE_VOLUME, "mountPath": CURVE_DIR, "readOnly": True}


def engine_env(pool: PoolSpec, role: str) -> list[dict]:
    """`EPDSERVE_POD_IP` (the address the KV-event sockets bind) and, with Curve,
    `EPDSERVE_KV_EVENTS_CURVE_DIR`."""
    env = [{"name": "EPDSERVE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    if curve_enabled(pool) and publishes(role):
        env.append({"name": "EPDSERVE_KV_EVENTS_CURVE_DIR", "value": CURVE_DIR})
    return env


def publishes(role: str) -> bool:
    """Encoder pods hold no KV cache, so they publish no KV events."""
    return role != "encoder"


def engine_volumes(pool: PoolSpec, role: str) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of an engine pod: the server pair and the client's public key."""
    if not (curve_enabled(pool) and publishes(role)):
        return [], []
    return [_curve_volume(pool, ENGINE_KEYS)], [_curve_mount()]


def router_args(pool: PoolSpec) -> list[str]:
    """The router's flag naming the directory of its client keys (with Curve)."""
    return ["--kv-events-curve-dir", CURVE_DIR] if curve_enabled(pool) else []


def router_volumes(pool: PoolSpec) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) of a router pod: the client pair and the server's public key."""
    if not curve_enabled(pool):
        return [], []
    return [_curve_volume(pool, ROUTER_KEYS)], [_curve_mount()]

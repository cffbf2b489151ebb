"""What a fresh cluster has before anyone applies anything: a serving certificate for the
API, the `kubernetes` Service, the `default` ServiceAccount and the `kube-root-ca.crt`
ConfigMap. Pure builders (plus one openssl call); `LocalCluster` creates them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_cert(workdir: Path, ip: str) -> tuple[str, str]:
    """A self-signed serving certificate for the `kubernetes` Service (it is its own CA)."""
    cert, key = workdir / "apiserver.crt", workdir / "apiserver.key"
    names = "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
    names += f"DNS:kubernetes.default.svc.cluster.local,IP:{ip}"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=kubernetes",
            "-addext",
            f"subjectAltName={names}",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


def bootstrap_objects(master_ip: str, ca: str) -> list[tuple[str, str, dict]]:
    """(kind, namespace, body) of every object a fresh cluster has, in creation order."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "kubernetes",
            "namespace": "default",
            "labels": {"component": "apiserver", "provider": "kubernetes"},
        },
        "spec": {
            "clusterIP": master_ip,
            "clusterIPs": [master_ip],
            "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}],
        },
    }
    account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": "default"},
    }
    root_ca = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "kube-root-ca.crt", "namespace": "default"},
        "data": {"ca.crt": ca},
    }
    return [
        ("Service", "default", service),
        ("ServiceAccount", "default", account),
        ("ConfigMap", "default", root_ca),
    ]

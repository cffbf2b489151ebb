"""The e2e cluster's certificates and kubeconfigs, made with `openssl` as kubeadm would make
them: one CA; the API server's serving certificate (its Service names and IPs); a client
certificate per identity (`admin` in `system:masters`, the controller manager, the
scheduler, the node); and the ServiceAccount token signing key pair.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

DAYS = "2"


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:3])}: {done.stderr.strip()[-500:]}")


class Pki:
    """Files under `directory`: ca.crt/key, <name>.crt/key, sa.key/pub, <name>.kubeconfig."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ca = self.dir / "ca.crt"
        self.ca_key = self.dir / "ca.key"

    def make_ca(self) -> None:
        if self.ca.exists():
            return
        ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
        _openssl(
            "req", "-x509", *ec, "-days", DAYS, "-subj", "/CN=epd-e2e-ca",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=self.dir,
        )  # fmt: skip
        _openssl("genrsa", "-out", "sa.key", "2048", cwd=self.dir)
        _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=self.dir)

    def cert(self, name: str, cn: str, org: str = "", sans: list[str] | None = None):
        """A certificate signed by the CA: a server's when `sans` is given, else a client's
        (CN = user, O = group). Returns (cert path, key path)."""
        subject = f"/CN={cn}" + (f"/O={org}" if org else "")
        _openssl(
            "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-subj", subject, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            cwd=self.dir,
        )  # fmt: skip
        usage = "serverAuth" if sans else "clientAuth"
        ext = [
            "basicConstraints=CA:FALSE",
            "keyUsage=critical,digitalSignature,keyEncipherment",
            f"extendedKeyUsage={usage}",
        ]
        if sans:
            ext.append("subjectAltName=" + ",".join(sans))
        (self.dir / f"{name}.ext").write_text("\n".join(ext) + "\n")
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", DAYS, "-extfile", f"{name}.ext", "-out", f"{name}.crt",
            cwd=self.dir,
        )  # fmt: skip
        return self.dir / f"{name}.crt", self.dir / f"{name}.key"

    def kubeconfig(self, name: str, server: str, cn: str, org: str = "") -> Path:
        """A kubeconfig for `server` as user `cn` (group `org`), with its own client cert."""
        cert, key = self.cert(name, cn, org)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "e2e",
                    "cluster": {"server": server, "certificate-authority": str(self.ca)},
                }
            ],
            "users": [
                {"name": cn, "user": {"client-certificate": str(cert), "client-key": str(key)}}
            ],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": cn}}],
            "current-context": "e2e",
        }
        path = self.dir / f"{name}.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

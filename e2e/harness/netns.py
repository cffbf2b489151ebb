"""The pod network: one Linux bridge, one network namespace + veth pair per pod.

Addresses come from the benchmarking range 198.18.0.0/15 (RFC 2544), so the pod network can
never be mistaken for a real one: the bridge (the "node") is 198.18.0.1, pods get
198.18.1.0 and up; Service cluster IPs, allocated by the API server from 198.19.0.0/16, are
added to the bridge, where the harness's userspace service proxy listens. Every name carries the run's prefix
(`epd-e2e-<pid>-`), so teardown, and the leak check, find exactly what this run made.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import threading
from pathlib import Path

GATEWAY = "198.18.0.1"
PREFIX_LEN = 15
POD_BASE = ipaddress.ip_address("198.18.1.0")
NETNS_DIR = Path("/etc/netns")
# A pod's names are its hosts file (cluster DNS as hosts entries). Any other lookup must fail
# at once, as cluster DNS answers one it has no record for: the node's nameserver is out of a
# pod's reach, and glibc would wait 2 x 5 s for it (torch's gloo looks names up at start).
# Nothing listens on the pod's own loopback port 53, so a query there is refused at once.
RESOLV_CONF = "nameserver 127.0.0.1\noptions attempts:1\n"


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run `ip ARGS`; raise with its stderr on failure (unless check=False)."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def can_make_namespaces() -> str | None:
    """None when this process can build the pod network, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the e2e tests as root, as CI does)"
    for tool in ("ip", "nsenter"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"`{tool}` (iproute2/util-linux) is not installed"
    probe = f"epd-e2e-probe-{os.getpid()}"
    made = ip("netns", "add", probe, check=False)
    ip("netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


def run_prefix() -> str:
    return f"epd-e2e-{os.getpid()}-"


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def remove_stale() -> list[str]:
    """Remove namespaces and bridges left by e2e runs whose process is gone (a crash or a
    SIGKILL skips teardown); they would hold this run's addresses. Returns what it removed."""
    removed = []
    for netns in list_namespaces("epd-e2e-"):
        pid = netns.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            for orphan in ip("netns", "pids", netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(orphan), signal.SIGKILL)  # pods of that run, left running
            ip("netns", "del", netns, check=False)
            removed.append(netns)
    for line in ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("epdbr") and name[5:].isdigit() and not _alive(int(name[5:])):
            ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def list_namespaces(prefix: str) -> list[str]:
    """Network namespaces whose name starts with `prefix`."""
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


class PodNetwork:
    """The bridge, per-pod namespaces and their hosts files; `close()` removes all of it."""

    def __init__(self, prefix: str | None = None):
        self.prefix = prefix or run_prefix()
        self.bridge = f"epdbr{os.getpid()}"  # pids fit: at most 4194304 (10 chars in all)
        self._lock = threading.Lock()
        self._next_pod = 0
        self._made_netns_dir = False
        self.namespaces: dict[str, tuple[str, str]] = {}  # netns -> (host veth, pod ip)

    def open(self) -> PodNetwork:
        remove_stale()
        self._made_netns_dir = not NETNS_DIR.exists()
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{GATEWAY}/{PREFIX_LEN}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def add_service_ip(self, addr: str) -> None:
        """Make a cluster IP (the API server's allocation) reachable from pods and host."""
        ip("addr", "add", f"{addr}/32", "dev", self.bridge)

    def add_pod(self) -> tuple[str, str]:
        """A new namespace wired to the bridge: returns (netns name, pod IP)."""
        with self._lock:
            n = self._next_pod
            self._next_pod += 1
        netns, addr = f"{self.prefix}{n}", str(POD_BASE + n)
        veth = f"ve{os.getpid() % 10**6}x{n}"[:15]
        ip("netns", "add", netns)
        self.namespaces[netns] = (veth, addr)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", veth, "master", self.bridge, "up")
        ip("-n", netns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "link", "set", "lo", "up")
        ip("-n", netns, "route", "add", "default", "via", GATEWAY)
        (NETNS_DIR / netns).mkdir(parents=True, exist_ok=True)
        write_in_place(NETNS_DIR / netns / "hosts", "127.0.0.1\tlocalhost\n")
        write_in_place(NETNS_DIR / netns / "resolv.conf", RESOLV_CONF)
        return netns, addr

    def set_hosts(self, netns: str, text: str) -> None:
        """Replace the namespace's /etc/hosts content (in place: running pods see it)."""
        path = NETNS_DIR / netns / "hosts"
        if path.exists() and path.read_text() != text:
            write_in_place(path, text)

    def remove_pod(self, netns: str) -> None:
        """Delete the namespace (its processes must be gone), its veth and hosts file."""
        veth, _ = self.namespaces.pop(netns, (None, None))
        ip("netns", "del", netns, check=False)
        if veth:
            ip("link", "del", veth, check=False)  # normally gone with the namespace
        files = [NETNS_DIR / netns / name for name in ("hosts", "resolv.conf")]
        for leftover in (*files, NETNS_DIR / netns):
            with contextlib.suppress(OSError):
                leftover.unlink() if leftover.is_file() else leftover.rmdir()

    def close(self) -> None:
        """Remove every namespace of this run and the bridge."""
        for netns in set(self.namespaces) | set(list_namespaces(self.prefix)):
            self.remove_pod(netns)
        ip("link", "del", self.bridge, check=False)
        if self._made_netns_dir:
            with contextlib.suppress(OSError):
                NETNS_DIR.rmdir()

    def leftovers(self) -> list[str]:
        """What of this run's network still exists (empty after close())."""
        found = [f"netns {n}" for n in list_namespaces(self.prefix)]
        if ip("link", "show", self.bridge, check=False).returncode == 0:
            found.append(f"bridge {self.bridge}")
        return found


def write_in_place(path: Path, text: str) -> None:
    """Overwrite keeping the inode, so a bind mount of the file shows the new content."""
    with open(path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(text)

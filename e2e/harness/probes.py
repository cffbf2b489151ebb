"""Container probes as the kubelet runs them: httpGet, tcpSocket, exec (inside the pod)."""

from __future__ import annotations

import http.client
import socket
import subprocess


def resolve_port(container: dict, port) -> int:
    """A probe/Service port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container['name']} has no port named {port!r}")


def run_probe(
    probe: dict, container: dict, pod_ip: str, pid: int | None, env: dict, why: list | None = None
) -> bool:
    """One probe attempt: True on success (timeouts and errors are failures; `why`, when
    given, gets the failure's reason)."""
    why = [] if why is None else why
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "httpGet" in probe:
            get = probe["httpGet"]
            conn = http.client.HTTPConnection(
                get.get("host") or pod_ip, resolve_port(container, get["port"]), timeout=timeout
            )
            try:
                conn.request("GET", get.get("path", "/"))
                status = conn.getresponse().status
                why.append(f"HTTP {status}")
                return 200 <= status < 400
            finally:
                conn.close()
        if "tcpSocket" in probe:
            port = resolve_port(container, probe["tcpSocket"]["port"])
            with socket.create_connection((pod_ip, port), timeout=timeout):
                return True
        if "exec" in probe and pid:
            # Enter the container's network and mount namespaces, with its environment.
            cmd = ["nsenter", "-t", str(pid), "-n", "-m", "--", *probe["exec"]["command"]]
            done = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout)
            why.append(f"exit {done.returncode}")
            return done.returncode == 0
    except (OSError, http.client.HTTPException, subprocess.TimeoutExpired, ValueError) as exc:
        why.append(repr(exc))
        return False
    return False


class ProbeState:
    """Schedule and thresholds of one probe (periods scaled by the harness's time scale)."""

    def __init__(self, probe: dict | None, scale: float, started_at: float):
        self.probe = probe
        self.period = max(0.2, float((probe or {}).get("periodSeconds", 10)) * scale)
        self.next_at = started_at + float((probe or {}).get("initialDelaySeconds", 0)) * scale
        self.failure_threshold = int((probe or {}).get("failureThreshold", 3))
        self.success_threshold = int((probe or {}).get("successThreshold", 1))
        self.failures = 0
        self.successes = 0

    def due(self, now: float) -> bool:
        return self.probe is not None and now >= self.next_at

    def record(self, ok: bool, now: float) -> str | None:
        """'success' / 'failure' when a threshold is crossed, else None."""
        self.next_at = now + self.period
        if ok:
            self.failures, self.successes = 0, self.successes + 1
            return "success" if self.successes >= self.success_threshold else None
        self.successes, self.failures = 0, self.failures + 1
        return "failure" if self.failures >= self.failure_threshold else None

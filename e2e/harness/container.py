"""One container of a pod: its process (through podinit.py in the pod's network namespace),
restarts with back-off, and startup/liveness/readiness probes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import podspec
from events import EVENTS
from probes import ProbeState, run_probe

PODINIT = str(Path(__file__).with_name("podinit.py"))


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Container:
    """One container of a pod: its process, restarts and probes."""

    def __init__(self, pod, spec: dict):  # pod: kubelet.PodRuntime
        self.pod, self.spec, self.name = pod, spec, spec["name"]
        self.proc: subprocess.Popen | None = None
        self.env: dict = {}
        self.restarts = 0
        self.waiting = ("ContainerCreating", "")
        self.started_at = ""
        self.last_state: dict = {}
        self.started = False  # the startup probe passed (or there is none)
        self.ready = False
        self.backoff_until = 0.0
        self.backoff_step = 0  # restarts in a row without a long enough run in between
        self.started_mono = 0.0
        self.probes: dict[str, ProbeState] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        pod, kubelet = self.pod, self.pod.kubelet
        try:
            services = kubelet.api.list("Service", pod.namespace)
            if pod.namespace != "default":  # every pod gets the API server's Service too
                services += [s for s in [kubelet.lookup("Service", "default", "kubernetes")] if s]
            base = {**kubelet.config.image_env, "HOSTNAME": pod.name}
            self.env = podspec.container_env(pod.obj, self.spec, kubelet.lookup, services, base)
            argv = podspec.container_argv(self.spec, self.env)
            mounts = pod.mounts_for(self.spec)
            sec = podspec.security(pod.obj, self.spec)
        except podspec.ConfigError as exc:
            self.waiting = ("CreateContainerConfigError", str(exc))
            self.backoff_until = time.monotonic() + 1
            return
        spec_file = pod.dir / f"{self.name}.json"
        # the "image" is this checkout and its venv: they stay visible even under a volume
        # mounted over one of their parents (a clean checkout may live under /tmp)
        keep = sorted({str(Path(sys.prefix).resolve()), str(Path(PODINIT).resolve().parents[2])})
        spec = {"argv": argv, "env": self.env, "mounts": mounts, "keep": keep, **sec}
        spec["hostname"] = pod.name
        spec_file.write_text(json.dumps(spec))
        log = open(pod.dir / f"{self.name}.log", "ab")  # noqa: SIM115 (owned by the process)
        log.write(f"--- {now_iso()} start #{self.restarts}: {argv}\n".encode())
        log.flush()
        cmd = ["ip", "netns", "exec", pod.netns, sys.executable, PODINIT, str(spec_file)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={},
            start_new_session=True,
        )
        log.close()
        kubelet.started_pids.add(self.proc.pid)
        self.waiting, self.started_at = None, now_iso()
        self.started_mono = time.monotonic()
        scale, t0 = kubelet.config.time_scale, time.monotonic()
        self.probes = {
            kind: ProbeState(self.spec.get(kind + "Probe"), scale, t0)
            for kind in ("startup", "liveness", "readiness")
        }
        self.started = self.spec.get("startupProbe") is None
        self.ready = False

    def tick(self, now: float) -> None:
        """Restart an exited container when its back-off is over; run due probes."""
        if self.proc is None:
            if now >= self.backoff_until and not self.pod.stopping:
                self.start()
            return
        code = self.proc.poll()
        if code is not None:
            self._exited(code, now)
            return
        self._probe(now)

    def _exited(self, code: int, now: float) -> None:
        reason = "Completed" if code == 0 else "Error"
        self.last_state = {
            "terminated": {
                "exitCode": code if code >= 0 else 128 - code,
                "reason": reason,
                "startedAt": self.started_at,
                "finishedAt": now_iso(),
            }
        }
        self.proc, self.ready, self.started = None, False, False
        self.restarts += 1
        self._event(f"exited with {code}")
        scale = self.pod.kubelet.config.time_scale
        if now - self.started_mono > 600 * scale:  # ran 10 (scaled) minutes: back-off resets
            self.backoff_step = 0
        self.backoff_until = now + min(300.0, 10.0 * 2**self.backoff_step) * scale
        self.backoff_step = min(self.backoff_step + 1, 5)
        self.waiting = ("CrashLoopBackOff", f"back-off restarting failed container {self.name}")

    def _probe(self, now: float) -> None:
        if not self.started:
            state = self.probes["startup"]
            if state.due(now):
                verdict = state.record(self._run(state.probe, "startup"), now)
                if verdict == "success":
                    self.started = True
                    self.probes["liveness"].next_at = self.probes["readiness"].next_at = now
                elif verdict == "failure":
                    self._event("startup probe failed: killed")
                    self.kill(self.pod.grace())
            return
        live = self.probes["liveness"]
        if live.due(now):
            if live.record(self._run(live.probe, "liveness"), now) == "failure":
                self._event("liveness probe failed: killed")
                self.kill(self.pod.grace())
                return
        ready = self.probes["readiness"]
        if ready.probe is None:
            self.ready = True
        elif ready.due(now):
            verdict = ready.record(self._run(ready.probe, "readiness"), now)
            if verdict is not None and self.ready != (verdict == "success"):
                self._event(f"readiness {verdict}: ready={verdict == 'success'}")
            if verdict == "success":
                self.ready = True
            elif verdict == "failure":
                self.ready = False

    def _run(self, probe: dict, kind: str) -> bool:
        why: list[str] = []
        ok = run_probe(probe, self.spec, self.pod.ip, self.proc.pid, self.env, why)
        if not ok and (kind == "liveness" or kind == "readiness" and self.ready):
            self._event(f"{kind} probe failed: {why[-1] if why else '?'}")  # not while starting
        return ok

    def _event(self, text: str) -> None:
        EVENTS.add("kubelet", f"{self.pod.namespace}/{self.pod.name}/{self.name} {text}")

    def pre_stop(self, deadline: float) -> None:
        """The container's preStop hook, within the grace period (the `sleep` action only)."""
        hook = (self.spec.get("lifecycle") or {}).get("preStop") or {}
        if self.proc is None or self.proc.poll() is not None or not hook:
            return
        if "sleep" not in hook:  # noted for describe(); the pod still stops
            self.pod.kubelet.errors.append(f"{self.name}: preStop {sorted(hook)} not supported")
            return
        scaled = max(1.0, float(hook["sleep"]["seconds"]) * self.pod.kubelet.config.time_scale)
        time.sleep(max(0.0, min(scaled, deadline - time.monotonic())))

    def kill(self, grace: float) -> None:
        """SIGTERM the container's process group, SIGKILL after `grace` seconds."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        signal_group(proc.pid, signal.SIGKILL)  # whatever is left of the group
        proc.wait(10)

    def status(self) -> dict:
        """The containerStatuses entry (read from the kubelet's thread: one look at proc)."""
        proc = self.proc
        if proc is not None:
            state = {"running": {"startedAt": self.started_at}}
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, "message": message}}
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "containerID": f"e2e://{proc.pid}" if proc else "",
            "ready": self.ready and proc is not None,
            "started": self.started and proc is not None,
            "restartCount": self.restarts,
            "state": state,
            "lastState": self.last_state,
        }


def signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)

"""The node agent: runs every Pod bound to this node as local processes.

Each Pod gets a network namespace (see netns.py); each container runs there through
podinit.py with its env, volumes and security context. The kubelet runs startup, liveness
and readiness probes, restarts exited containers (restartPolicy Always, with back-off),
and reports the Pod's status through the API. Times from the spec (probe periods, back-off)
are multiplied by `time_scale` so tests run in seconds; thresholds and timeouts are kept.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import podspec
from kapi import ApiError
from netns import GATEWAY, PodNetwork
from probes import ProbeState, run_probe

PODINIT = str(Path(__file__).with_name("podinit.py"))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class NodeConfig:
    """What the node offers pods besides the API objects."""

    name: str = "e2e-node"
    image_env: dict = field(default_factory=dict)  # ENV every image sets (PATH, ...)
    image_files: list = field(default_factory=list)  # [{"path", "source"}] in every image
    claims: dict = field(default_factory=dict)  # PVC name -> host directory
    time_scale: float = 0.2
    max_grace: float = 10.0  # cap on terminationGracePeriodSeconds
    token: str = "e2e-service-account-token"


class Container:
    """One container of a pod: its process, restarts and probes."""

    def __init__(self, pod: PodRuntime, spec: dict):
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
        self.probes: dict[str, ProbeState] = {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        pod, kubelet = self.pod, self.pod.kubelet
        try:
            services = kubelet.api.list("Service", pod.namespace)
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
        spec_file.write_text(json.dumps({"argv": argv, "env": self.env, "mounts": mounts, **sec}))
        log = open(pod.dir / f"{self.name}.log", "ab")  # noqa: SIM115 (owned by the process)
        log.write(f"--- {_now()} start #{self.restarts}: {argv}\n".encode())
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
        self.waiting, self.started_at = None, _now()
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
                "finishedAt": _now(),
            }
        }
        self.proc, self.ready, self.started = None, False, False
        self.restarts += 1
        delay = (
            min(300.0, 10.0 * 2 ** min(self.restarts - 1, 5)) * self.pod.kubelet.config.time_scale
        )
        self.backoff_until = now + delay
        self.waiting = ("CrashLoopBackOff", f"back-off restarting failed container {self.name}")

    def _probe(self, now: float) -> None:
        ip, pid = self.pod.ip, self.proc.pid
        if not self.started:
            state = self.probes["startup"]
            if state.due(now):
                verdict = state.record(run_probe(state.probe, self.spec, ip, pid, self.env), now)
                if verdict == "success":
                    self.started = True
                    self.probes["liveness"].next_at = self.probes["readiness"].next_at = now
                elif verdict == "failure":
                    self.kill(self.pod.grace())
            return
        live = self.probes["liveness"]
        if live.due(now):
            ok = run_probe(live.probe, self.spec, ip, pid, self.env)
            if live.record(ok, now) == "failure":
                self.kill(self.pod.grace())
                return
        ready = self.probes["readiness"]
        if ready.probe is None:
            self.ready = True
        elif ready.due(now):
            ok = run_probe(ready.probe, self.spec, ip, pid, self.env)
            verdict = ready.record(ok, now)
            if verdict == "success":
                self.ready = True
            elif verdict == "failure" or not ok and ready.failure_threshold <= 1:
                self.ready = False

    def kill(self, grace: float) -> None:
        """SIGTERM the container's process group, SIGKILL after `grace` seconds."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace)
        _signal_group(proc.pid, signal.SIGKILL)  # whatever is left of the group
        proc.wait(10)

    def status(self) -> dict:
        if self.proc is not None:
            state = {"running": {"startedAt": self.started_at}}
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, "message": message}}
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "containerID": f"e2e://{self.proc.pid}" if self.proc else "",
            "ready": self.ready and self.proc is not None,
            "started": self.started and self.proc is not None,
            "restartCount": self.restarts,
            "state": state,
            "lastState": self.last_state,
        }


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class PodRuntime:
    """A pod: its network namespace, directory, containers and their loop."""

    def __init__(self, kubelet: Kubelet, obj: dict):
        self.kubelet, self.obj = kubelet, obj
        meta = obj["metadata"]
        self.uid, self.name, self.namespace = meta["uid"], meta["name"], meta["namespace"]
        self.dir = kubelet.run_dir / "pods" / f"{self.namespace}_{self.name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.netns, self.ip = kubelet.network.add_pod()
        obj.setdefault("status", {}).update(podIP=self.ip, hostIP=GATEWAY)
        self.start_time = _now()
        self.stopping = False
        self.containers = [Container(self, c) for c in obj["spec"]["containers"]]
        self.volumes: dict[str, dict] = {}
        self.transitions: dict[str, tuple[str, str]] = {}
        self._thread = threading.Thread(target=self._loop, name=f"pod-{self.name}", daemon=True)
        self._thread.start()

    def grace(self) -> float:
        spec_grace = float(self.obj["spec"].get("terminationGracePeriodSeconds", 30))
        return min(spec_grace, self.kubelet.config.max_grace)

    def mounts_for(self, container: dict) -> list[dict]:
        """podinit mounts: the image's files, then the container's volumeMounts."""
        kubelet = self.kubelet
        mounts = [dict(m, readOnly=True) for m in kubelet.config.image_files]
        for vm in container.get("volumeMounts") or []:
            if vm["name"] not in self.volumes:
                volume = next(
                    v for v in self.obj["spec"].get("volumes", []) if v["name"] == vm["name"]
                )
                self.volumes[vm["name"]] = podspec.volume_source(
                    self.obj,
                    volume,
                    kubelet.lookup,
                    self.dir,
                    kubelet.config.claims,
                    kubelet.config.token,
                )
            source = dict(self.volumes[vm["name"]])
            if vm.get("subPath"):
                raise podspec.ConfigError("subPath mounts are not supported by the e2e kubelet")
            readonly = bool(vm.get("readOnly") or source.get("readOnly"))
            mounts.append(
                {"path": vm["mountPath"], "source": source["source"], "readOnly": readonly}
            )
        for m in mounts:
            kubelet.mount_point(m["path"])
        return mounts

    def _loop(self) -> None:
        while not self.stopping:
            now = time.monotonic()
            for c in self.containers:
                try:
                    c.tick(now)
                except Exception as exc:  # keep the pod loop alive; the status says why
                    c.waiting = ("RunContainerError", repr(exc))
                    c.backoff_until = now + 2
            time.sleep(0.1)

    def stop(self) -> None:
        """Kill every container (graceful first) and remove the pod's namespace."""
        self.stopping = True
        self._thread.join(10)
        for c in self.containers:
            c.kill(self.grace())
        self.kubelet.network.remove_pod(self.netns)

    def _condition(self, ctype: str, ok: bool) -> dict:
        value = "True" if ok else "False"
        old = self.transitions.get(ctype)
        if old is None or old[0] != value:
            self.transitions[ctype] = (value, _now())
        return {"type": ctype, "status": value, "lastTransitionTime": self.transitions[ctype][1]}

    def status(self) -> dict:
        statuses = [c.status() for c in self.containers]
        running = any("running" in s["state"] for s in statuses)
        ever_started = any(s["restartCount"] or "running" in s["state"] for s in statuses)
        ready = all(s["ready"] for s in statuses)
        return {
            "phase": "Running" if running or ever_started else "Pending",
            "hostIP": GATEWAY,
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodScheduled", True),
                self._condition("Initialized", True),
                self._condition("ContainersReady", ready),
                self._condition("Ready", ready),
            ],
            "containerStatuses": statuses,
        }


class Kubelet:
    """Syncs pods bound to this node with local processes and reports their status."""

    def __init__(self, api, network: PodNetwork, config: NodeConfig, run_dir: Path):
        self.api, self.network, self.config = api, network, config
        self.run_dir = Path(run_dir)
        self.pods: dict[str, PodRuntime] = {}
        self.reported: dict[str, dict] = {}
        self.started_pids: set[int] = set()
        self.made_dirs: list[Path] = []
        self.errors: list[str] = []
        self._dirs_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)

    def start(self) -> Kubelet:
        self._thread.start()
        return self

    def lookup(self, kind: str, namespace: str, name: str) -> dict | None:
        return self.api.get(kind, namespace, name)

    def mount_point(self, path: str) -> None:
        """Create a missing mount point on the host (recorded, removed at close)."""
        with self._dirs_lock:
            target = Path(path)
            missing = [p for p in (target, *target.parents) if not p.exists()]
            if missing:
                target.mkdir(parents=True, exist_ok=True)
                self.made_dirs.append(missing[-1])

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # API hiccups: note and go on, like a kubelet
                self.errors.append(repr(exc))
            self._stop.wait(0.3)

    def sync(self) -> None:
        pods = {
            p["metadata"]["uid"]: p
            for p in self.api.list("Pod")
            if (p.get("spec") or {}).get("nodeName") == self.config.name
        }
        for uid in list(self.pods):
            if uid not in pods:
                runtime = self.pods.pop(uid)
                threading.Thread(target=runtime.stop, name=f"stop-{runtime.name}").start()
                self.reported.pop(uid, None)
        for uid, obj in pods.items():
            if uid not in self.pods and not obj["metadata"].get("deletionTimestamp"):
                self.pods[uid] = PodRuntime(self, obj)
        for uid, runtime in list(self.pods.items()):
            status = runtime.status()
            if self.reported.get(uid) == status:
                continue
            try:
                self.api.patch("Pod", runtime.namespace, runtime.name, {"status": status}, "status")
            except ApiError as exc:
                if exc.status != 404:  # 404: deleted meanwhile, stopped on the next sync
                    raise
            self.reported[uid] = status

    def pod(self, namespace: str, name: str) -> PodRuntime | None:
        return next(
            (p for p in list(self.pods.values()) if (p.namespace, p.name) == (namespace, name)),
            None,
        )

    def close(self) -> None:
        """Stop syncing, kill every pod, remove the mount points it made."""
        self._stop.set()
        self._thread.join(15)
        stoppers = [threading.Thread(target=p.stop) for p in self.pods.values()]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(60)
        self.pods.clear()
        for pid in self.started_pids:  # anything left of any container ever started
            _signal_group(pid, signal.SIGKILL)
        for top in reversed(self.made_dirs):
            for path in sorted(top.rglob("*"), key=lambda p: -len(p.parts)) + [top]:
                with contextlib.suppress(OSError):
                    path.rmdir()

"""The node agent: runs every Pod bound to this node as local processes.

Each Pod gets a network namespace (see netns.py); each container runs there through
podinit.py with its env, volumes and security context. Volumes live as long as their pod:
an emptyDir is a directory of the pod's, a memory emptyDir a tmpfs (of its sizeLimit). The
kubelet runs startup, liveness and readiness probes, restarts exited containers (restartPolicy
Always, with back-off) and reports the Pod's status through the API. Spec times (probe periods,
back-off) are multiplied by `time_scale` so tests run in seconds; thresholds, timeouts are kept.

It registers its Node and renews its Lease (node.py), sees the pods the real scheduler bound
to it, asks the TokenRequest API for their ServiceAccount tokens, and resolves their claims
to the bound PersistentVolumes' paths, each with the node's own credentials
(system:node:NAME, checked by the Node authorizer and NodeRestriction).

A pod marked for deletion (`deletionTimestamp`, set by the API server) is terminated as a kubelet
does: no more restarts or probes, each container's preStop hook (the `sleep` action; its
seconds scaled too, at least 1 s), then SIGTERM and SIGKILL when the grace period (capped by
`max_grace`) runs out; then the pod object is removed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import podspec
from container import Container, now_iso, signal_group
from events import EVENTS
from kapi import ApiError
from netns import GATEWAY, PodNetwork
from node import NodeAgent


@dataclass
class NodeConfig:
    """What the node offers pods besides the API objects."""

    name: str = "e2e-node"
    image_env: dict = field(default_factory=dict)  # ENV every image sets (PATH, ...)
    image_files: list = field(default_factory=list)  # [{"path", "source"}] in every image
    time_scale: float = 0.2
    max_grace: float = 30.0  # cap on terminationGracePeriodSeconds


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
        self.start_time = now_iso()
        self.stopping = False
        self.terminating = False
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
                source = podspec.volume_source(
                    self.obj,
                    volume,
                    kubelet.lookup,
                    self.dir,
                    kubelet.token,
                )
                if source["source"] is None:  # a memory emptyDir
                    source["source"] = self._tmpfs(vm["name"], source.get("size"))
                self.volumes[vm["name"]] = source
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

    def _tmpfs(self, name: str, size: int | None) -> str:
        """A memory emptyDir: a tmpfs on the host, of the sizeLimit when there is one, that
        lives as long as the pod (a restarted container finds what the last one left, as on
        a node); unmounted when the pod stops."""
        where = self.dir / "volumes" / name
        where.mkdir(parents=True, exist_ok=True)
        options = "nosuid,nodev,mode=1777" + (f",size={size}" if size else "")
        cmd = ["mount", "-t", "tmpfs", "-o", options, f"e2e-{name}", str(where)]
        subprocess.run(cmd, check=True, capture_output=True)
        self.kubelet.tmpfs.add(str(where))
        return str(where)

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

    def terminate(self, grace: float) -> None:
        """Run the graceful termination (in a thread): preStop, SIGTERM, SIGKILL, remove."""
        self.terminating = True
        threading.Thread(target=self._terminate, args=(grace,), name=f"term-{self.name}").start()

    def _terminate(self, grace: float) -> None:
        self.stopping = True  # no restarts, no more probes
        EVENTS.add("kubelet", f"{self.namespace}/{self.name} terminating (grace {grace:g}s)")
        self._thread.join(10)
        deadline = time.monotonic() + min(grace, self.kubelet.config.max_grace)
        hooks = [threading.Thread(target=c.pre_stop, args=(deadline,)) for c in self.containers]
        for t in hooks:
            t.start()
        for t in hooks:
            t.join()
        killers = [
            threading.Thread(target=c.kill, args=(max(0.0, deadline - time.monotonic()),))
            for c in self.containers
        ]
        for t in killers:
            t.start()
        for t in killers:
            t.join()
        try:
            self.kubelet.api.delete("Pod", self.namespace, self.name, grace=0)
        except Exception as exc:  # the API may be gone already (the cluster is closing)
            self.kubelet.errors.append(f"removing terminated pod {self.name}: {exc!r}")

    def stop(self) -> None:
        """Kill every container (graceful first) and remove the pod's namespace."""
        self.stopping = True
        self._thread.join(10)
        for c in self.containers:
            c.kill(self.grace())
        self.kubelet.network.remove_pod(self.netns)
        for source in self.volumes.values():
            if source["source"] in self.kubelet.tmpfs:
                self.kubelet.unmount(source["source"])

    def _condition(self, ctype: str, ok: bool) -> dict:
        value = "True" if ok else "False"
        old = self.transitions.get(ctype)
        if old is None or old[0] != value:
            self.transitions[ctype] = (value, now_iso())
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
        self.api, self.network, self.config, self.run_dir = api, network, config, Path(run_dir)
        self.pods: dict[str, PodRuntime] = {}
        self.reported: dict[str, dict] = {}
        self.started_pids: set[int] = set()
        self.made_dirs: list[Path] = []
        self.tmpfs: set[str] = set()  # memory emptyDirs mounted on the host
        self.errors: list[str] = []
        self._dirs_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kubelet", daemon=True)
        self.node = NodeAgent(api, config.name, GATEWAY)

    def start(self) -> Kubelet:
        self.node.register()
        self._thread.start()
        return self

    def lookup(self, kind: str, namespace: str | None, name: str) -> dict | None:
        return self.api.get(kind, namespace, name)

    def token(self, pod: dict, request: dict) -> str:
        """A projected serviceAccountToken source's token, bound to the pod."""
        account = pod["spec"].get("serviceAccountName") or "default"
        seconds = int(request.get("expirationSeconds") or 3600)
        namespace = pod["metadata"]["namespace"]
        return self.api.token(namespace, account, pod, seconds, request.get("audience"))

    def mount_point(self, path: str) -> None:
        """Create a missing mount point on the host (recorded, removed at close)."""
        with self._dirs_lock:
            target = Path(path)
            missing = [p for p in (target, *target.parents) if not p.exists()]
            if missing:
                target.mkdir(parents=True, exist_ok=True)
                self.made_dirs.append(missing[-1])

    def unmount(self, path: str) -> None:
        done = subprocess.run(["umount", "-l", path], capture_output=True, text=True)
        if done.returncode == 0:
            self.tmpfs.discard(path)
        else:  # leaks() names it
            self.errors.append(f"umount {path}: {done.stderr.strip()}")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except Exception as exc:  # API hiccups: note and go on, like a kubelet
                self.errors.append(repr(exc))
            self._stop.wait(0.3)

    def sync(self) -> None:
        self.node.heartbeat()
        mine = self.api.list("Pod", fields=f"spec.nodeName={self.config.name}")
        pods = {p["metadata"]["uid"]: p for p in mine}
        for uid in list(self.pods):
            if uid not in pods:
                runtime = self.pods.pop(uid)
                threading.Thread(target=runtime.stop, name=f"stop-{runtime.name}").start()
                self.reported.pop(uid, None)
        for uid, obj in pods.items():
            meta = obj["metadata"]
            if not meta.get("deletionTimestamp"):
                if uid not in self.pods:
                    self.pods[uid] = PodRuntime(self, obj)
            elif uid not in self.pods:  # never started here: nothing to stop
                with contextlib.suppress(ApiError):
                    self.api.delete("Pod", meta["namespace"], meta["name"], grace=0)
            elif not self.pods[uid].terminating:
                self.pods[uid].terminate(float(meta.get("deletionGracePeriodSeconds") or 30))
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
            signal_group(pid, signal.SIGKILL)
        for top in reversed(self.made_dirs):
            for path in sorted(top.rglob("*"), key=lambda p: -len(p.parts)) + [top]:
                with contextlib.suppress(OSError):
                    path.rmdir()

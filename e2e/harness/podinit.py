"""The container runtime's last step, run inside the pod's network namespace (stdlib only).

`ip netns exec <ns> python podinit.py SPEC.json` gives a process the pod's network and a
private mount namespace; this script then lays out the container's filesystem view (volumes
bind-mounted or tmpfs, the root file system read-only when the pod asks for it), names the
host after the pod (a UTS namespace of its own), drops to the pod's uid/gid, and execs the
container's command with the container's environment.
Mount sources are opened before anything is mounted, so a volume mounted over `/tmp` cannot
hide a source that lives under `/tmp`.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 32, 4096, 16384
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWUTS = 0x04000000
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    if _libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} -> {dst}: {os.strerror(err)}")


def lay_out(mounts: list[dict], read_only_root: bool, keep: list[str] = ()) -> None:
    """Mount every volume (parents first), then make `/` read-only if asked.

    Paths in ``keep`` (the image's own files: the checkout and its venv) are bound back in
    place when a volume is mounted over one of their parents (e.g. an emptyDir on /tmp).
    """
    mounts = sorted(mounts, key=lambda m: m["path"].rstrip("/").count("/"))
    fds = {i: os.open(m["source"], os.O_PATH) for i, m in enumerate(mounts) if m.get("source")}
    kept = {p: os.open(p, os.O_PATH) for p in keep if os.path.exists(p)}
    for i, m in enumerate(mounts):
        os.makedirs(m["path"], exist_ok=True)  # inside an earlier volume, or made by the kubelet
        if m.get("source"):
            _mount(f"/proc/self/fd/{fds[i]}", m["path"], None, MS_BIND | MS_REC)
        else:
            _mount("tmpfs", m["path"], "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777")
    for path, fd in kept.items():
        parents = [m["path"].rstrip("/") + "/" for m in mounts]
        if any(path.startswith(p) for p in parents):  # hidden by a volume: bind it back
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    for m in mounts:  # after all: a read-only volume may hold mount points of later ones
        if m.get("readOnly"):
            _mount(None, m["path"], None, MS_REMOUNT | MS_BIND | MS_RDONLY)
    for fd in fds.values():
        os.close(fd)
    if read_only_root:
        _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def set_hostname(name: str) -> None:
    """The pod's own UTS namespace, named after the pod (its hosts file maps the name to the
    pod IP), as a container runtime gives every pod."""
    if _libc.unshare(CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUTS): {os.strerror(err)}")
    socket.sethostname(name)


def drop_privileges(uid: int | None, gid: int | None, groups: list[int], no_new_privs: bool):
    """setgroups/setgid/setuid as the kubelet does for runAsUser/runAsGroup/fsGroup."""
    if gid is not None:
        os.setgroups(groups)
        os.setgid(gid)
    if uid is not None:
        os.setuid(uid)  # a non-root uid keeps no capabilities: `drop: [ALL]` holds
    if no_new_privs:
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    lay_out(spec["mounts"], spec.get("readOnlyRoot", False), spec.get("keep", []))
    if spec.get("hostname"):
        set_hostname(spec["hostname"])
    drop_privileges(spec.get("uid"), spec.get("gid"), spec.get("groups", []), spec["noNewPrivs"])
    os.chdir(spec.get("workingDir") or "/")
    argv, env = spec["argv"], spec["env"]
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main()

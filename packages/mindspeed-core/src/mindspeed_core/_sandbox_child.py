"""Launcher run as `python -I -B _sandbox_child.py CONFIG_JSON` by `mindspeed_core.sandbox`.

A fresh single-threaded interpreter confines itself (cgroup, namespaces, read-only mounts,
resource limits, an unprivileged user), writes which confinements took hold to the report
file, then runs `program.py` from the work folder. Standard library only: this file runs
before anything of ours could be trusted to import.
"""

import ctypes
import json
import os
import resource
import runpy
import signal
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
NOBODY = 65534


def main(config: dict) -> None:
    work = config["work"]
    report = {}
    report["processes"] = _join_cgroup(config["cgroup"])
    libc = ctypes.CDLL(None, use_errno=True)
    report["network"] = "namespace" if libc.unshare(CLONE_NEWNET) == 0 else "socket guard"
    report["files"] = _read_only_mounts(libc, work)
    _limits(config)
    # In a new pid namespace the program's first process is its init: when it dies, the
    # kernel kills and reaps every process it left (no zombies for the host's init).
    report["reaping"] = "pid namespace" if libc.unshare(CLONE_NEWPID) == 0 else "process group"
    child = []  # the parent's SIGTERM ends the program's init, which ends the namespace
    signal.signal(signal.SIGTERM, lambda *_: child and os.kill(child[0], signal.SIGKILL))
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _run(config, report, work)
        return
    child.append(pid)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):  # end the same way, so the parent sees the signal
        number = os.WTERMSIG(status)
        if number != signal.SIGKILL:
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    sys.exit(os.waitstatus_to_exitcode(status))


def _run(config: dict, report: dict, work: str) -> None:
    report["user"] = _drop_privileges(work, report["files"] == "read-only mounts")
    if report["user"] == "nobody" and report["processes"] == "none":
        report["processes"] = "rlimit"
    with open(config["report"], "w") as f:  # before the program can touch it
        json.dump(report, f)
    if report["network"] != "namespace":
        _guard_sockets()
    os.chdir(work)
    sys.argv = ["program.py"]
    sys.path[0] = work  # the program's folder, not this launcher's
    runpy.run_path(os.path.join(work, "program.py"), run_name="__main__")


def _join_cgroup(group) -> str:
    if not group:
        return "none"
    try:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        return "cgroup"
    except OSError:
        return "none"


def _read_only_mounts(libc, work: str) -> str:
    """A private mount namespace where every mount but `work` is read-only."""
    if libc.unshare(CLONE_NEWNS) != 0:
        return "owner only"
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return "owner only"
    target = work.encode()
    if libc.mount(target, target, None, MS_BIND, None) != 0:
        return "owner only"
    _expose_library(libc, work)
    root_done = False
    for point, flags in _mounts():
        if point == work:
            continue
        keep = flags | MS_REMOUNT | MS_BIND | MS_RDONLY
        ok = libc.mount(None, point.encode(), None, keep, None) == 0
        root_done |= ok and point == "/"
    return "read-only mounts" if root_done else "owner only"


def _expose_library(libc, work: str) -> None:
    """Bind the interpreter's library folders that `nobody` cannot reach (e.g. under a
    0700 /root) into the work folder, and import from there."""
    moved = {}
    for i, path in enumerate(sys.path):
        if os.path.isdir(path) and not _reachable(path):
            target = os.path.join(work, ".lib", str(i))
            os.makedirs(target)
            if libc.mount(path.encode(), target.encode(), None, MS_BIND | MS_REC, None) == 0:
                moved[path] = target
    sys.path[:] = [moved.get(p, p) for p in sys.path]
    for module in list(sys.modules.values()):  # packages already imported (encodings)
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [_moved(p, moved) for p in search]


def _moved(path: str, moved: dict) -> str:
    for old, new in moved.items():
        if path == old or path.startswith(old + os.sep):
            return new + path[len(old) :]
    return path


def _reachable(path: str) -> bool:
    """Whether any user may list `path` (o+x on every folder above it, o+rx on it)."""
    import stat

    parts = os.path.abspath(path).split(os.sep)
    for depth in range(1, len(parts) + 1):
        mode = os.stat(os.sep.join(parts[:depth]) or os.sep).st_mode
        if not mode & stat.S_IXOTH:
            return False
    return bool(os.stat(path).st_mode & stat.S_IROTH)


def _mounts():
    """(mount point, its nosuid/nodev/noexec flags) from /proc/self/mountinfo, parents first."""
    flag_of = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            flags = sum(flag_of.get(o, 0) for o in fields[5].split(","))
            points.append((point, flags))
    return sorted(points, key=lambda p: p[0].count("/"))


def _limits(config: dict) -> None:
    cpu = config["cpu_s"]
    for name, value in (
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),
        (resource.RLIMIT_AS, (config["memory_bytes"],) * 2),
        (resource.RLIMIT_FSIZE, (config["max_file_bytes"],) * 2),
        (resource.RLIMIT_NOFILE, (64, 64)),
        (resource.RLIMIT_CORE, (0, 0)),
        (resource.RLIMIT_NPROC, (config["max_procs"],) * 2),
    ):
        resource.setrlimit(name, value)


def _drop_privileges(work: str, library_exposed: bool) -> str:
    """Become `nobody` when root, so RLIMIT_NPROC binds and the user's files are closed;
    not when `nobody` could not read the standard library (no mount namespace for it)."""
    if os.getuid() != 0:
        return "unchanged"
    if not library_exposed and not all(_reachable(p) for p in sys.path if os.path.isdir(p)):
        return "root (library unreadable to nobody)"
    os.chown(work, NOBODY, NOBODY)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    return "nobody"


def _guard_sockets() -> None:
    def refuse(*args, **kwargs):
        raise OSError("network access is disabled in the sandbox")

    socket.socket = refuse
    socket.create_connection = refuse
    socket.socketpair = refuse


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

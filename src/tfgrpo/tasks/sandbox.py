"""A throwaway Linux sandbox for model-written Python code.

`run_python(code)` saves the code in a fresh temporary directory and starts this
file as a bootstrap (`python -I -S sandbox.py --bootstrap CONFIG`) in a new
session.  A sandbox is three processes:

* outer: unshares the user, network, PID, IPC and UTS namespaces, forks init,
  and SIGKILLs it when the caller closes the control pipe (timeout, output
  limit, caller gone).  It waits for init and then deletes the temporary
  directory, so once it has exited nothing of the sandbox is left.
* init (PID 1 of the new PID namespace), in a mount namespace of its own:
  pivots into a new root made of a read-only tmpfs, read-only binds of an
  allow-list (/usr, the interpreter, the virtualenv, a few /dev nodes), a new
  /proc and a private tmpfs /sandbox (also $TMPDIR; /tmp links to it).  It runs the code and reports how it ended;
  when it exits, the kernel kills whatever the code left in the namespace.
* code: sets the rlimits, drops every capability, sets no_new_privs and execs
  `python -I -u /sandbox/main.py`.  For a root caller it runs as host uid 65534
  (RLIMIT_NPROC is never enforced for real root); otherwise as the caller.

The network namespace only has a loopback device, and it is down.  Where the
kernel refuses the namespaces the sandbox fails closed ("sandbox unavailable").
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import select
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

# Linux constants from <sched.h>, <sys/mount.h> and <sys/prctl.h>.
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME, MNT_DETACH = 1 << 18, 1 << 21, 1 << 24, 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 24, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41}  # glibc has no wrapper for it

NOBODY = 65534  # host uid/gid that runs the code when the caller is root
TMP_MB = 64  # size of the code's working tmpfs, which is also the largest file it may write
WORK = "/sandbox"  # the code's writable directory (and $TMPDIR); /tmp points here unless a bound path needs /tmp
GRACE_S = 5.0  # how long a killed sandbox may take to disappear
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: died of that signal; None: we killed it, or it never ran
    reason: str | None  # None when the code ran to completion, else one line saying why not

    @property
    def ok(self) -> bool:
        return self.reason is None and self.exit_code == 0


def run_python(code: str, *, wall_timeout_s: float = 10.0, cpu_time_s: int = 10,
               memory_mb: int = 1024, max_output_bytes: int = 64_000,
               max_processes: int = 32) -> SandboxResult:
    """Run `code` as a script in a fresh sandbox; safe to call from many threads."""
    stage = tempfile.mkdtemp(prefix="tfgrpo-sbx-")
    status_r, status_w = os.pipe()  # bootstrap -> us: how the code ended
    ctl_r, ctl_w = os.pipe()  # us -> bootstrap: closing our end means "kill it now"
    status, ctl, proc = open(status_r, "rb", buffering=0), open(ctl_w, "wb"), None
    try:
        with open(os.path.join(stage, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        cfg = {"stage": stage, "status_fd": status_w, "ctl_fd": ctl_r, "cpu": int(cpu_time_s),
               "memory_mb": int(memory_mb), "nproc": int(max_processes),
               "python": sys.executable, "binds": _allowed_paths()}
        try:  # on failure (say, no processes left) the finally below cleans up
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), "--bootstrap",
                 json.dumps(cfg)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(status_w, ctl_r), start_new_session=True,
                cwd=stage, env={"PATH": os.defpath, "LC_ALL": "C.UTF-8"})
        finally:  # from here on only the bootstrap holds these two ends
            os.close(status_w)
            os.close(ctl_r)
        out, err, how, killed = _collect(proc, status, ctl.close, wall_timeout_s, max_output_bytes)
    finally:
        if proc is not None:
            _killpg(proc.pid)  # normally a no-op; the group id stays ours until we reap
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            proc.stdout.close()
            proc.stderr.close()
        status.close()
        ctl.close()
        shutil.rmtree(stage, ignore_errors=True)
    stderr = err.decode("utf-8", "replace")
    exit_code, reason = _verdict(how.decode("utf-8", "replace"), killed, stderr, cpu_time_s)
    return SandboxResult(out.decode("utf-8", "replace"), stderr, exit_code, reason)


def _killpg(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _collect(proc, status, stop, timeout, cap):
    """Read stdout, stderr and the status pipe until all are closed; keep `cap` output bytes.

    Past `cap`, or at the deadline, call `stop()` and drain without keeping
    anything; if the sandbox is not gone GRACE_S later, kill its session."""
    outs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    how, total, killed = bytearray(), 0, None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        for fd in (*outs, status.fileno()):
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0 and killed is not None:
                _killpg(proc.pid)
                break
            if left <= 0:
                killed, deadline = "timeout", time.monotonic() + GRACE_S
                stop()
            for key, _ in sel.select(max(left, 0)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fd)
                elif key.fd == status.fileno():
                    how += data[:4096]
                else:
                    outs[key.fd] += data[:max(0, cap - total)]
                    total += len(data)
                    if total > cap and killed is None:
                        killed, deadline = "output limit", time.monotonic() + GRACE_S
                        stop()
    stop()
    return bytes(outs[proc.stdout.fileno()]), bytes(outs[proc.stderr.fileno()]), how, killed


def _verdict(how, killed, stderr, cpu_limit):
    """Turn the status lines written by the bootstrap into (exit_code, reason)."""
    lines = how.splitlines()
    errors = [line[len("error "):] for line in lines if line.startswith("error ")]
    ends = [line.split() for line in lines if line.startswith(("exit ", "signal "))]
    if killed or errors or not ends:
        return None, killed or (errors or ["sandbox failed: no exit status"])[0]
    kind, number, cpu = ends[-1][0], int(ends[-1][1]), float(ends[-1][2])
    if kind == "exit":
        last = (stderr.strip().splitlines() or [""])[-1]
        out_of_memory = number != 0 and re.match(r"[\w.]*MemoryError\b", last)
        return number, "memory limit" if out_of_memory else None
    if number == signal.SIGXCPU or (number == signal.SIGKILL and cpu >= cpu_limit):
        return -number, "cpu time limit"
    if number == signal.SIGXFSZ:
        return -number, "file size limit"
    return -number, f"killed by signal {signal.Signals(number).name}"


def _allowed_paths():
    """Host paths the code may read: system libraries, this interpreter, its venv."""
    real = os.path.realpath
    system_dirs = [real(p) for p in SYSTEM_PATHS if os.path.isdir(p)]
    extra = {os.path.abspath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix,
             sys.base_exec_prefix, os.path.dirname(os.path.dirname(real(sys.executable))))}
    # Skip what a system directory shows already, and directories inside other extras.
    extra = {p for p in extra if not any(real(p) == d or real(p).startswith(d + "/")
                                         for d in system_dirs)}
    extra = {p for p in extra if not any(p.startswith(q + "/") for q in extra)}
    return [p for p in SYSTEM_PATHS if os.path.lexists(p)] + sorted(extra)


# ----------------------------------------------------------------------------
# Everything below runs in the bootstrap processes, never in the caller.

def _check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(libc, src, dst, fstype=None, flags=0, data=None):
    enc = (lambda s: None if s is None else os.fsencode(s))
    _check(libc.mount(enc(src), enc(dst), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {dst}")


def _report(fd, line):
    os.write(fd, (line.replace("\n", " ") + "\n").encode())


def _bootstrap(cfg):
    """The outer process: enter the namespaces, start init, obey the control pipe."""
    for fd in (cfg["status_fd"], cfg["ctl_fd"]):
        os.set_inheritable(fd, False)  # the code itself never holds them
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        cfg["code_uid"] = _enter_namespaces(libc)
    except OSError as e:  # fail closed: the code never runs outside its jail
        _report(cfg["status_fd"], f"error sandbox unavailable: {e}")
        return 1
    init = os.fork()
    if init == 0:
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with the outer process
            _init(cfg, libc)
        except BaseException as e:  # noqa: BLE001 - whatever it was, report it
            _report(cfg["status_fd"], f"error sandbox setup failed: {e}")
        os._exit(1)
    pidfd = os.pidfd_open(init)
    if pidfd not in select.select([pidfd, cfg["ctl_fd"]], [], [])[0]:  # told to stop
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    os.waitpid(init, 0)  # returns once PID 1, and with it the whole namespace, is gone
    shutil.rmtree(cfg["stage"], ignore_errors=True)  # in case the caller died before us
    return 0


def _enter_namespaces(libc):
    """Unshare every namespace; return the uid the code will run as inside."""
    # (init takes a mount namespace of its own, so that we keep seeing the host's files)
    flags = CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    if os.getuid() != 0:  # unprivileged: we may only map ourselves, as root inside
        uid, gid = os.getuid(), os.getgid()
        _check(libc.unshare(flags), "unshare")
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                           ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        return 0
    # Root: a helper that stays outside maps 0 -> root (to build the jail) and
    # 1 -> nobody (to run the code); only a privileged outsider may map two ids.
    me, (r, w) = os.getpid(), os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(w)
        try:
            if os.read(r, 1):
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{me}/{name}", "w") as f:
                        f.write(f"0 0 1\n1 {NOBODY} 1\n")
                os._exit(0)
        finally:
            os._exit(1)
    os.close(r)
    try:
        _check(libc.unshare(flags), "unshare")
        os.write(w, b"1")
    finally:
        os.close(w)
        helper_status = os.waitpid(helper, 0)[1]
    if helper_status != 0:
        raise OSError("could not write the user namespace id maps")
    return 1


def _init(cfg, libc):
    """PID 1: build the jail, run the code, report how it ended."""
    with open(os.path.join(cfg["stage"], "main.py"), "rb") as f:
        source = f.read()
    _build_root(cfg["stage"], cfg["binds"], cfg["code_uid"], libc)
    with open(f"{WORK}/main.py", "wb") as f:
        f.write(source)
    os.chmod(f"{WORK}/main.py", 0o644)
    child = os.fork()
    if child == 0:
        try:
            _exec_code(cfg, libc)
        except BaseException as e:  # noqa: BLE001
            _report(cfg["status_fd"], f"error sandbox setup failed: {e}")
        os._exit(127)
    while True:  # as PID 1 we also reap orphans; stop when the code's own process ends
        pid, wstatus, usage = os.wait4(-1, 0)
        if pid == child:
            break
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(wstatus):
        _report(cfg["status_fd"], f"signal {os.WTERMSIG(wstatus)} {cpu:.3f}")
    else:
        _report(cfg["status_fd"], f"exit {os.waitstatus_to_exitcode(wstatus)} {cpu:.3f}")
    os._exit(0)


def _build_root(stage, binds, code_uid, libc):
    """Assemble the new root on a tmpfs, make it read-only and pivot into it."""
    new = os.path.join(stage, "root")
    os.mkdir(new, 0o755)
    _check(libc.unshare(CLONE_NEWNS), "unshare the mount namespace")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount reaches the host
    _mount(libc, "tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for src in [*binds, *DEVICES]:
        target = new + src
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if os.path.islink(src):  # e.g. /bin -> usr/bin: copy the link, not what it shows
            os.symlink(os.readlink(src), target)
            continue
        if os.path.isdir(src):
            os.makedirs(target, mode=0o755, exist_ok=True)
        else:
            open(target, "w").close()
        _mount(libc, src, target, None, MS_BIND | MS_REC)
    for name in (WORK[1:], "proc"):
        os.makedirs(os.path.join(new, name), 0o755, exist_ok=True)
    if not os.path.lexists(os.path.join(new, "tmp")):  # a venv under /tmp (CI clones) keeps the real path
        os.symlink(WORK, os.path.join(new, "tmp"))
    os.symlink("/proc/self/fd", os.path.join(new, "dev", "fd"))
    with open("/proc/self/mountinfo") as f:  # field 5 is the mount point, octal-escaped
        points = [re.sub(r"\\(\d{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
                  for line in f]
    for point in points:  # the root tmpfs, every bind, and any mount below one
        if point == new or point.startswith(new + "/"):
            _remount_readonly(libc, point)
    _mount(libc, "tmpfs", os.path.join(new, WORK[1:]), "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={TMP_MB}m,nr_inodes=4096,mode=0755,uid={code_uid},gid={code_uid}")
    try:
        _mount(libc, "proc", os.path.join(new, "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        # This limit is per user namespace: the code may not nest namespaces of its own.
        with open(os.path.join(new, "proc/sys/user/max_user_namespaces"), "w") as f:
            f.write("0")
    except OSError:
        pass  # some containers forbid a new /proc; the code can live without one
    # pivot_root(".", ".") stacks the old root under the new one; detach it right away.
    os.chdir(new)
    _check(libc.syscall(PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def _remount_readonly(libc, point):
    # A mount copied from the host has locked flags, which we must repeat unchanged.
    have, flags = os.statvfs(point).f_flag, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID
    for st, ms in ((os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC), (os.ST_NOATIME,
                   MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME)):
        flags |= ms if have & st else 0
    flags |= 0 if have & (os.ST_NOATIME | os.ST_RELATIME) else MS_STRICTATIME
    _mount(libc, None, point, None, flags)


def _exec_code(cfg, libc):
    """The code's own process: limits, no privileges, then exec Python on the script."""
    mib, uid = 1024 * 1024, cfg["code_uid"]
    for limit, value in ((resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1)),
                         (resource.RLIMIT_AS, (cfg["memory_mb"] * mib,) * 2),
                         (resource.RLIMIT_FSIZE, (TMP_MB * mib,) * 2),
                         (resource.RLIMIT_NPROC, (cfg["nproc"],) * 2),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)
    with open("/proc/sys/kernel/cap_last_cap") as f:  # we are root of our namespace:
        for cap in range(int(f.read()) + 1):  # empty the bounding set, so exec grants nothing
            _check(libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability")
    if uid != 0:  # root caller: uid 1 inside is nobody outside
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # this also clears the remaining capabilities
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignored these; restore the defaults
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(WORK)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK,
           "LANG": "C.UTF-8", "MPLBACKEND": "Agg", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    os.execve(cfg["python"], [cfg["python"], "-I", "-u", f"{WORK}/main.py"], env)


def _cli(argv):
    import argparse

    ap = argparse.ArgumentParser(prog="python -m tfgrpo.tasks.sandbox",
                                 description="Run a Python file in the sandbox.")
    ap.add_argument("file")
    ap.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds")
    ap.add_argument("--cpu", type=int, default=10, help="CPU seconds")
    ap.add_argument("--memory", type=int, default=1024, help="address space, MiB")
    ap.add_argument("--max-output", type=int, default=64_000, help="bytes of output kept")
    args = ap.parse_args(argv)
    with open(args.file, encoding="utf-8") as f:
        r = run_python(f.read(), wall_timeout_s=args.timeout, cpu_time_s=args.cpu,
                       memory_mb=args.memory, max_output_bytes=args.max_output)
    sys.stdout.write(r.stdout)
    sys.stdout.flush()
    sys.stderr.write(r.stderr)
    if r.reason is not None:
        print(f"sandbox: {r.reason}", file=sys.stderr)
        return r.exit_code if r.exit_code and r.exit_code > 0 else 1
    return r.exit_code if r.exit_code >= 0 else 128 - r.exit_code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--bootstrap"]:
        sys.exit(_bootstrap(json.loads(sys.argv[2])))
    sys.exit(_cli(sys.argv[1:]))

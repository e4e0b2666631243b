"""Escape and limit tests for the code sandbox (tfgrpo.tasks.sandbox).

Each test runs real code in a real sandbox; together they take a few seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tfgrpo.tasks import sandbox
from tfgrpo.tasks.sandbox import run_python

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the sandbox is Linux-only")

SANDBOX_FILE = Path(sandbox.__file__).resolve()  # src/tfgrpo/tasks/sandbox.py
PROJECT_DIR = SANDBOX_FILE.parents[3]  # the repository


def processes_with(marker: str) -> list[int]:
    """Host PIDs whose command line contains `marker` (a /proc scan, no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:  # the process went away while we looked
                pass
    return found


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def run_json(code: str, **limits) -> dict:
    """Run code that prints one JSON object on its last line; return that object."""
    r = run_python(textwrap.dedent(code), **limits)
    assert r.ok, r
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_prints_and_returns():
    r = run_python("print('hello', 6 * 7)")
    assert (r.stdout, r.stderr, r.exit_code, r.reason, r.ok) == ("hello 42\n", "", 0, None, True)


def test_exception_gives_traceback_and_nonzero_exit():
    r = run_python("def f():\n    raise ValueError('boom')\nf()")
    assert r.exit_code == 1 and r.reason is None and not r.ok
    assert "Traceback" in r.stderr and "ValueError: boom" in r.stderr


def test_exit_code_is_passed_through():
    r = run_python("import sys\nprint('bye')\nsys.exit(3)")
    assert (r.stdout, r.exit_code, r.reason) == ("bye\n", 3, None)


def test_math_libraries_import():
    pytest.importorskip("numpy")
    pytest.importorskip("sympy")
    r = run_python("import numpy, sympy\nprint(int(numpy.arange(10).sum()), sympy.factorint(360))")
    assert r.ok, r
    assert r.stdout == "45 {2: 3, 3: 2, 5: 1}\n"


def test_runs_without_privileges_in_a_fresh_directory():
    info = run_json("""
        import ctypes, json, os
        status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        nested = ctypes.CDLL(None).unshare(0x10000000)  # a user namespace of its own
        print(json.dumps({"cwd": os.getcwd(), "files": os.listdir("."), "nested": nested,
                          "caps": [status[k].strip() for k in ("CapEff", "CapPrm", "CapBnd")],
                          "nnp": status["NoNewPrivs"].strip(), "pid": os.getpid()}))
    """)
    assert info["files"] == ["main.py"]
    assert info["caps"] == ["0000000000000000"] * 3 and info["nnp"] == "1"
    assert info["pid"] == 2  # its own PID namespace, under our init
    assert info["nested"] == -1  # cannot nest namespaces to regain capabilities
    # a file left behind by one run is not seen by the next
    assert run_python("open('left.txt', 'w').write('x')").ok
    assert run_json("import json, os; print(json.dumps(os.listdir('.')))") == ["main.py"]


def test_temporary_directory_is_deleted(monkeypatch):
    made = []

    def recording_mkdtemp(*args, **kwargs):
        made.append(real_mkdtemp(*args, **kwargs))
        return made[-1]

    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", recording_mkdtemp)
    assert run_python("open('junk.bin', 'wb').write(b'0' * 1000)").ok
    assert len(made) == 1 and not os.path.exists(made[0])


def test_home_project_and_secrets_are_hidden():
    home = os.path.expanduser("~")
    seen = run_json(f"""
        import json, os
        def ls(p):
            try:
                return sorted(os.listdir(p))
            except OSError:
                return None
        print(json.dumps({{
            "home": ls({home!r}), "root": ls("/root"), "work": ls({str(PROJECT_DIR)!r}),
            "etc": ls("/etc"), "exists": [p for p in {[str(SANDBOX_FILE),
                str(PROJECT_DIR / "pyproject.toml"), "/etc/passwd", "/etc/shadow",
                "/home", "/sys", "/var", "/mnt"]!r} if os.path.lexists(p)],
        }}))
    """)
    assert seen["exists"] == []
    assert set(seen["etc"] or []) <= {"ld.so.cache", "localtime"}
    # Only the path down to the interpreter or the virtualenv may show in a hidden directory.
    allowed = set(sandbox._allowed_paths())
    for host_dir, key in ((home, "home"), ("/root", "root"), (str(PROJECT_DIR), "work")):
        if not os.path.isdir(host_dir):
            continue
        on_path = {p[len(host_dir) + 1:].split("/")[0]
                   for p in allowed if p.startswith(host_dir + "/")}
        assert set(seen[key] or []) <= on_path, (key, seen[key])
        assert set(os.listdir(host_dir)) - on_path, "the test needs something to hide"


def test_cannot_write_outside_its_directory():
    name = f"sandbox-escape-{uuid.uuid4().hex}"
    dirs = ["/", "/usr", "/etc", "/root", "/proc", "/dev", "/tmp/..", sys.prefix,
            os.path.join(sys.base_prefix, "lib"), str(PROJECT_DIR), os.path.expanduser("~")]
    targets = [os.path.join(d, name) for d in dirs]
    try:
        result = run_json(f"""
            import json
            out = {{}}
            for path in {targets!r}:
                try:
                    open(path, "w").write("escaped")
                    out[path] = "written"
                except OSError as e:
                    out[path] = type(e).__name__
            open("mine.txt", "w").write("fine")  # its own directory is writable
            try:  # but not without bound: the 64 MiB file size limit
                open("big.bin", "wb").write(bytes(100 * 2 ** 20))
                out["big"] = "written"
            except OSError as e:
                out["big"] = type(e).__name__
            print(json.dumps(out))
        """)
        assert "written" not in result.values(), result
        assert not [p for p in targets if os.path.lexists(p)]
    finally:  # should the test fail, leave no trace on the host
        for p in targets:
            if os.path.isfile(p) and open(p).read() == "escaped":
                os.unlink(p)


def test_no_network_even_to_host_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        r = run_python(textwrap.dedent(f"""
            import socket
            print([name for _, name in socket.if_nameindex()])
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("CONNECTED")
            except OSError as e:
                print("refused:", e)
        """))
        assert r.ok, r
        assert "CONNECTED" not in r.stdout and "refused:" in r.stdout
        assert r.stdout.splitlines()[0] == "['lo']"
        with pytest.raises(socket.timeout):
            listener.accept()


def test_fork_bomb_is_capped_and_leaves_no_process():
    token = f"bomb-{uuid.uuid4().hex}"
    code = textwrap.dedent(f"""
        import os, sys, time
        if sys.argv[1:] != ["{token}"]:  # re-exec so every bomb process carries the token
            os.execv(sys.executable, [sys.executable, "-I", "-u", __file__, "{token}"])
        refused = False
        while True:
            try:
                os.fork()
            except OSError:
                if not refused:
                    print("fork refused", flush=True)
                    refused = True
                time.sleep(0.01)
    """)
    start = time.monotonic()
    r = run_python(code, wall_timeout_s=2, max_processes=16)
    assert r.reason == "timeout" and not r.ok
    assert "fork refused" in r.stdout  # the process limit, not the clock, stopped the growth
    assert time.monotonic() - start < 8
    assert processes_with(token) == []


def test_detached_process_dies_with_the_sandbox():
    token = f"daemon-{uuid.uuid4().hex}"
    r = run_python(textwrap.dedent(f"""
        import os, sys, time
        if os.fork() == 0:
            os.setsid()  # leave the process group, as a daemon would
            os.execv(sys.executable,
                     [sys.executable, "-c", "import time; time.sleep(1000)", "{token}"])
        for _ in range(500):  # wait until the daemon runs (seen in the sandbox's own /proc)
            if any(b"{token}" in open(f"/proc/{{p}}/cmdline", "rb").read()
                   for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())):
                break
            time.sleep(0.01)
        print("daemon started")
    """))
    assert r.ok and r.stdout == "daemon started\n", r
    assert processes_with(token) == []


def test_sandbox_dies_with_its_caller(tmp_path):
    """If the calling process is SIGKILLed mid-run, the sandbox cleans up after itself."""
    head, tail = uuid.uuid4().hex, uuid.uuid4().hex  # the caller's command line holds only halves
    code = textwrap.dedent(f"""
        import os, sys, time
        token = "{head}" + "{tail}"
        if sys.argv[1:] != [token]:
            os.execv(sys.executable, [sys.executable, "-I", __file__, token])
        time.sleep(1000)
    """)
    caller = subprocess.Popen([sys.executable, "-c",
                               "from tfgrpo.tasks.sandbox import run_python; "
                               f"run_python({code!r}, wall_timeout_s=60)"],
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert wait_until(lambda: processes_with(head + tail), 20), "the sandbox never started"
    finally:
        caller.kill()
        caller.wait()
    assert wait_until(lambda: not processes_with(head + tail), 5)
    assert wait_until(lambda: not os.listdir(tmp_path), 5)  # its temporary directory too


def test_memory_limit():
    r = run_python("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", memory_mb=512)
    assert r.reason == "memory limit" and r.exit_code == 1
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout


def test_output_is_cut_at_the_limit_without_buffering_it():
    code = "import sys\nchunk = 'x' * 1_000_000\nfor _ in range(100):\n    sys.stdout.write(chunk)"
    tracemalloc.start()
    try:
        r = run_python(code, max_output_bytes=50_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert r.reason == "output limit" and r.exit_code is None
    assert r.stdout == "x" * 50_000
    assert peak < 4_000_000, peak  # 100 MB went through; we never held more than a few chunks


def test_wall_timeout():
    start = time.monotonic()
    r = run_python("print('started')\nimport time\ntime.sleep(10 ** 6)", wall_timeout_s=1)
    assert (r.reason, r.exit_code, r.stdout) == ("timeout", None, "started\n")
    assert time.monotonic() - start < 5


def test_cpu_time_limit():
    start = time.monotonic()
    r = run_python("while True:\n    pass", cpu_time_s=1, wall_timeout_s=20)
    assert r.reason == "cpu time limit" and not r.ok
    assert time.monotonic() - start < 8


def test_concurrent_sandboxes_keep_their_own_output():
    tokens = [uuid.uuid4().hex for _ in range(8)]
    code = "import time\nfor i in range(5):\n    print('{t}', i)\n    time.sleep(0.05)"
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda t: run_python(code.format(t=t)), tokens))
    for token, r in zip(tokens, results):
        assert r.ok, r
        assert r.stdout == "".join(f"{token} {i}\n" for i in range(5))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tfgrpo.tasks.sandbox", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_output_and_passes_exit_code(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(4)")
    p = cli(str(script))
    assert (p.returncode, p.stdout, p.stderr) == (4, "out\n", "err\n")


def test_cli_reports_timeout(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("print('hi')\nimport time\ntime.sleep(100)")
    p = cli("--timeout", "1", str(script))
    assert p.returncode != 0 and p.stdout == "hi\n"
    assert p.stderr.strip().splitlines()[-1] == "sandbox: timeout"


def world_readable(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in path.parents) and \
        os.stat(path).st_mode & 0o004


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_works_for_an_unprivileged_user():
    """As `nobody` (with the system Python, which nobody can read) the same guarantees hold."""
    system_python = "/usr/bin/python3"
    if not os.access(system_python, os.X_OK) or not world_readable(SANDBOX_FILE):
        pytest.skip("needs a world-readable system Python and checkout")
    code = textwrap.dedent("""
        import json, os, socket
        try:
            socket.create_connection(("127.0.0.1", 9), timeout=2)
            net = "connected"
        except OSError:
            net = "blocked"
        forks = 0
        try:
            while forks < 100:
                if os.fork() == 0:
                    import time; time.sleep(5); os._exit(0)
                forks += 1
        except OSError:
            pass
        status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        print(json.dumps({"net": net, "forks": forks, "root": os.path.exists("/root"),
                          "caps": status["CapEff"].strip()}))
    """)
    driver = (f"import json, sys; sys.path.insert(0, {str(SANDBOX_FILE.parent)!r}); "
              "import sandbox; "
              f"r = sandbox.run_python({code!r}, max_processes=8); "
              f"print(json.dumps([r.stdout, r.stderr, r.exit_code, r.reason]))")
    p = subprocess.run([system_python, "-I", "-c", driver], user=65534, group=65534,
                       extra_groups=[], cwd="/", capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    stdout, stderr, exit_code, reason = json.loads(p.stdout)
    assert (exit_code, reason) == (0, None), stderr
    seen = json.loads(stdout)
    assert seen == {"net": "blocked", "forks": seen["forks"], "root": False, "caps": "0" * 16}
    assert seen["forks"] < 8

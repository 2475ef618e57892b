"""Run untrusted (model-written, not malicious) Python in a child process with limits: wall and CPU
time, address space, output and file size, open files; an empty temporary working and home dir; no
network where the kernel lets an unprivileged process drop it (a new user + network namespace), and a
guard that disables process, file-removal and socket functions; all set up by a prelude that runs in
the child before the code (POSIX: it needs `resource`). Not a security
boundary against code written to escape: a seatbelt for code that loops, allocates or misbehaves."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PRELUDE = '''
import ctypes, resource
resource.setrlimit(resource.RLIMIT_CPU, ({cpu}, {cpu}))
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
resource.setrlimit(resource.RLIMIT_FSIZE, ({size}, {size}))
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
try:  # a new user and network namespace: no network at all (Linux, where unprivileged users may)
    ctypes.CDLL(None).unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET
except (OSError, AttributeError):
    pass
import builtins, os, shutil, socket, subprocess, sys
def _blocked(*args, **kwargs):
    raise PermissionError("blocked by the qlite sandbox")
for _name in ("system", "popen", "fork", "forkpty", "kill", "killpg", "remove", "unlink", "rmdir",
              "removedirs", "rename", "renames", "replace", "truncate", "chmod", "chown", "putenv",
              "setuid", "execv", "execve", "execvp", "execl", "spawnv", "spawnl", "_exit"):
    if hasattr(os, _name):
        setattr(os, _name, _blocked)
shutil.rmtree = shutil.move = _blocked
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = _blocked
socket.socket = socket.create_connection = _blocked
builtins.exit = builtins.quit = _blocked
del _name, _blocked, ctypes, resource
'''


@dataclass
class Limits:
    seconds: float = 10.0  # wall clock
    memory_mb: int = 512  # address space
    output_kb: int = 64  # stdout + stderr kept, and the largest file it may write


@dataclass
class RunResult:
    passed: bool
    reason: str  # "ok", "failed: AssertionError ...", "timeout", "memory", "output too large", ...
    output: str


def run_python(code: str, limits: Limits = Limits()) -> RunResult:
    """Run code (the answer followed by its tests) in a fresh interpreter inside the limits; passed
    when it runs to its end (a marker printed after the code) and exits 0: an early sys.exit(0)
    does not pass."""
    marker = f"qlite-sandbox-done-{secrets.token_hex(8)}"
    code = f"{code}\nprint({marker!r})\n"
    with tempfile.TemporaryDirectory(prefix="qlite-sandbox-") as work:
        work = Path(work)
        prelude = PRELUDE.format(cpu=int(limits.seconds) + 1, memory=limits.memory_mb << 20, size=limits.output_kb << 10)
        (work / "main.py").write_text(prelude + "\n" + code, encoding="utf-8")
        out_path = work / "output.txt"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "PYTHONHASHSEED": "0",
               "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
        with open(out_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "main.py"], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code_ = proc.wait(timeout=limits.seconds)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return RunResult(False, "timeout", _read(out_path, limits))
        _kill_group(proc)  # whatever it left running
        output = _read(out_path, limits)
        if out_path.stat().st_size >= limits.output_kb << 10:
            return RunResult(False, "output too large", output)
        if code_ == 0 and output.rstrip().endswith(marker):
            return RunResult(True, "ok", output.rstrip()[:-len(marker)])
        if code_ == 0:
            return RunResult(False, "exited before the tests ran", output)
        return RunResult(False, _reason(code_, output), output)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        pass
    proc.wait()


def _read(path: Path, limits: Limits) -> str:
    with open(path, "rb") as f:
        return f.read(limits.output_kb << 10).decode("utf-8", "replace")


def _reason(returncode: int, output: str) -> str:
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    last = output.strip().splitlines()[-1] if output.strip() else f"exit {returncode}"
    if "MemoryError" in last:
        return "memory"
    return f"failed: {last[:200]}"

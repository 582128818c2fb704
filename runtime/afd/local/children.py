"""Child processes of a local deployment, never outliving their parent.

Each child gets PR_SET_PDEATHSIG so the kernel kills it if the parent dies without
cleaning up (even on SIGKILL); `LocalProcesses` terminates everything on exit,
error or Ctrl-C, escalating from SIGTERM to SIGKILL after a grace period. Each child
runs in a session of its own: a terminal's Ctrl-C reaches the parent alone, which stops
the children in its own order with one SIGTERM each (a second signal reaching a child
already on its way out kills it: Python restores the default handlers as it finalizes).
PR_SET_PDEATHSIG fires when the *thread* that started the child ends: start children
from a thread that outlives them.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from afd.local.log_folders import LogFolder

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the parent's cleanup still applies


def threads_per_rank(num_ranks: int) -> dict[str, str]:
    """Env giving each of `num_ranks` local processes its share of the cores.

    Several torch processes each spinning one OpenMP thread per core oversubscribe
    the machine badly (measured: 4x slower serving on 2 cores with 3 ranks).
    An explicit OMP_NUM_THREADS from the user wins.
    """
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(num_ranks, 1)))}


class ChildFailed(RuntimeError):
    """A child process exited with an error; the message is its last error line."""


class LocalProcesses:
    """Start `python -m afd ...` children with their own env; stop them all on exit."""

    def __init__(self, grace_s: float = 5.0):
        self.grace_s = grace_s
        self._logs = LogFolder()  # kept after the run; older runs' folders are pruned (afd.local.log_folders)
        self.workdir = self._logs.path
        self.children: dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "LocalProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()
        self._logs.release()

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.log_path(name), "ab")
        child = subprocess.Popen(
            [sys.executable, "-m", "afd", *args],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            start_new_session=True,
        )
        log.close()
        self.children[name] = child
        return child

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def last_error(self, name: str) -> str:
        """The child's last `error:` line, else its last line, for a one-line report."""
        lines = self.log_path(name).read_text(errors="replace").strip().splitlines()
        errors = [line for line in lines if line.startswith("error:")]
        line = errors[-1] if errors else (lines[-1] if lines else f"exited with code {self.children[name].returncode}")
        return line.removeprefix("error: ")

    def wait(self, names: list[str], watch: list[str], timeout_s: float) -> None:
        """Wait until every child in `names` exits 0; fail fast if any of `names` or `watch` fails."""
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending:
            for name in list(pending) + watch:
                code = self.children[name].poll()
                if code is None:
                    continue
                if code != 0 or name in watch:
                    raise ChildFailed(f"{name}: {self.last_error(name)}")
                pending.discard(name)
            if time.monotonic() > deadline:
                raise ChildFailed(f"{', '.join(sorted(pending))} did not finish within {timeout_s:.0f} s")
            time.sleep(0.05)

    def stop(self, *names: str) -> None:
        """Stop these children together (SIGTERM, then SIGKILL after the grace period)."""
        self._terminate([self.children[name] for name in names])

    def stop_all(self) -> None:
        self._terminate(list(self.children.values()))

    def _terminate(self, children: list[subprocess.Popen]) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def exit_summary(codes: dict[str, int | None]) -> str:
    """How each child ended, in one line: `name exit N`, `name killed by SIGNAME` or `name still running`."""
    def ended(code: int | None) -> str:
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit {code}"

    return ", ".join(f"{name} {ended(code)}" for name, code in codes.items())


def free_port_block(count: int, host: str = "127.0.0.1") -> int:
    """A base port whose next `count` ports are free right now.

    Chosen below the kernel's ephemeral range, so that outgoing connections of the
    ranks started first cannot take a port before the later ranks bind it.
    """
    low, _ = _ephemeral_range()
    top = max(low - count, 2048)
    for _ in range(500):
        base = random.randrange(1024 if top <= 10000 else 10000, top)
        block = set(range(base, base + count))
        if not block & _handed_out and all(_is_free(host, port) for port in block):
            _handed_out.update(block)  # a later block never overlaps one not bound yet
            return base
    raise RuntimeError(f"no block of {count} free ports found on {host}")


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False

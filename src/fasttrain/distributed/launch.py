"""Start the same command under torchrun: ``--nproc N`` (and ``--nnodes``/``--rdzv-endpoint``).

The code path is the one a user gets by running torchrun themselves: every process runs the
command, rank 0 reports.

No process outlives the one that started it: every child fasttrain starts (torchrun, a
ladder's rung) and every rank torchrun starts asks the kernel for SIGTERM when its parent dies
(Linux's parent-death signal), so a SIGKILL of the top-level command ends the whole tree.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading

_PR_SET_PDEATHSIG = 1


def launched() -> bool:
    """Started by torchrun (or another launcher that sets WORLD_SIZE > 1). Here, not in
    ``env``, so that a command can ask before torch is imported."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def die_with_parent() -> None:
    """This process gets SIGTERM when its parent dies (Linux; elsewhere nothing). Used as a
    ``preexec_fn`` and by a rank torchrun started; a parent already gone ends it now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent == 1 or os.getppid() != parent:  # orphaned before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


def torchrun_prefix(nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None,
                    rdzv_id: str = "fasttrain") -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes > 1:
        if not rdzv_endpoint:
            raise ValueError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
        cmd += ["--nnodes", str(nnodes), "--rdzv_backend", "c10d", "--rdzv_endpoint",
                rdzv_endpoint, "--rdzv_id", rdzv_id]
    else:
        cmd += ["--standalone"]
    return cmd


def strip_launch_args(argv: list[str]) -> list[str]:
    """The command line without the launcher's own options (they must not recurse)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in ("--nproc", "--nnodes", "--rdzv-endpoint"):
            skip = "=" not in a
            continue
        out.append(a)
    return out


def child_env(extra: dict[str, str] | None = None, nproc: int = 1) -> dict[str, str]:
    """Environment of a child process: this source tree importable (also uninstalled), and one
    OpenMP thread per process when several share the machine."""
    env = {**os.environ, **(extra or {})}
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def relaunch(argv: list[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None) -> int:
    """Run ``fasttrain <argv>`` under torchrun; returns its exit status."""
    env = child_env(nproc=max(nproc, 2))
    cmd = torchrun_prefix(nproc, nnodes, rdzv_endpoint) + ["-m", "fasttrain",
                                                           *strip_launch_args(argv)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1,
                            preexec_fn=die_with_parent)
    relay = threading.Thread(target=_relay, args=(proc.stderr,), daemon=True)
    relay.start()
    got: list[int] = []

    def forward(signum, frame):  # torchrun passes it to every rank, which save and stop
        got.append(signum)
        proc.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
        relay.join(timeout=5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 + got[0] if got and code else code


_AGENT_LINE = re.compile(r"^([WEI]\d{4} |Traceback \(most recent call last\))")


def _relay(stream) -> None:
    """The ranks' and torchrun's stderr, passed on as it comes; once a rank has said why the
    run ended (a ``fasttrain:`` line), torchrun's own report of the same failure (its log lines
    and its ChildFailedError traceback, which names the first rank to exit, not the cause) is
    left out."""
    said = quiet = False
    for line in stream:
        quiet = quiet or (said and bool(_AGENT_LINE.match(line)))
        if not quiet:
            sys.stderr.write(line)
            sys.stderr.flush()
        said = said or line.startswith("fasttrain: ")

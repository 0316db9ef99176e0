"""The environment a result was measured in, and device peak rates for MFU."""
from __future__ import annotations

import datetime
import platform
import subprocess
from pathlib import Path

import torch

# Dense bf16 tensor-core peak, FLOP/s (vendor datasheets; SXM parts).
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12,
             "A800": 312e12, "L40S": 362e12, "B200": 2250e12}


def device_peak(device_name: str) -> float | None:
    """Dense bf16 peak for a CUDA device name; None when unknown (and always on CPU)."""
    for key, peak in PEAK_BF16.items():
        if key in device_name:
            return peak
    return None


def git_sha() -> str | None:
    """The checkout's commit (``FASTTRAIN_GIT_SHA`` where the tree travelled without .git)."""
    import os

    if os.environ.get("FASTTRAIN_GIT_SHA"):
        return os.environ["FASTTRAIN_GIT_SHA"]
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip()
        if sha:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "-uno"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def software(device: torch.device | str | None = None) -> dict:
    """The device and the software a compiled kernel depends on."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton_version,
        "cuda": torch.version.cuda, "python": platform.python_version(),
    }


def environment(device: torch.device | str | None = None) -> dict:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sw = software(dev)
    return {
        "device_name": sw.pop("device_name"),
        "device_count": torch.cuda.device_count() if dev.type == "cuda" else 1,
        **sw,
        "git_sha": git_sha(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

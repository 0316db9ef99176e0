"""Faults under torchrun on 2 GPUs (marker ``gpu``; skipped with fewer than 2): a rank hung
inside a training step is named by the per-step monitored barrier before NCCL's own timeout."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_rank_hung_inside_a_step_on_cuda_is_named_before_nccls_timeout(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "fasttrain", "train",
                           "tests.helpers:hang_in_step3_on_rank1", "--device", "cuda", "--nproc",
                           "2", "--steps", "6", "--warmup", "0", "--set", "dist_timeout=10",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    took = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "fasttrain: error: rank 1 hung: never reached step" in proc.stderr, proc.stderr[-3000:]
    assert "Watchdog caught collective operation timeout" not in proc.stderr
    assert took < 10 + 33, took  # before NCCL's timeout (dist_timeout + 33 s) would fire

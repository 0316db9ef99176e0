"""Export one inference rung of a workload and load it in a torch-only process, printing what
that process says (faulthandler on): the GPU check of ``fasttrain infer --export``.
usage: python benchmarks/runs/export_check.py WORKLOAD SIZE RUNG [DEVICE]"""
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from fasttrain.inference import bench
from fasttrain.inference.export import CHECK_SCRIPT, export_job
from fasttrain.inference.spec import RUNGS, InferSpec
from fasttrain.run.child import ChildSpec

workload, size, rung = sys.argv[1:4]
device = sys.argv[4] if len(sys.argv) > 4 else "cuda"
with tempfile.TemporaryDirectory() as tmp:
    pkg = Path(tmp) / "m.pt2"
    spec = InferSpec(workload=workload, size=size, rung=asdict(RUNGS[rung]), device=device,
                     batch=8, images=64, iters=5, warmup=2, workdir=tmp)
    print(export_job(ChildSpec(job="", workload=workload,
                               job_args={**spec.to_dict(), "package": str(pkg)})))
    print("package", pkg.stat().st_size)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for extra_env in ({}, {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}):
        proc = subprocess.run([sys.executable, "-X", "faulthandler", str(CHECK_SCRIPT), str(pkg),
                               str(Path(tmp) / bench.EVAL_FILE), str(Path(tmp) / "o.pt"), "8",
                               "5", "2", device], capture_output=True, text=True,
                              env={**env, **extra_env})
        print("env", list(extra_env), "rc", proc.returncode)
        print("\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))
        if proc.returncode == 0:
            print(torch.load(Path(tmp) / "o.pt", weights_only=True)["throughput"])

"""Which AOTInductor load crashes on this machine, with torch alone: a small MLP exported for
DEVICE, each package variant loaded in a fresh process (faulthandler on), its exit status shown.

    python benchmarks/runs/aoti_probe.py [DEVICE]

Variants: the default package and one with the kernel binaries embedded in its library, each
loaded as a package and as its shared library alone (``torch._export.aot_load``), then both
packages loaded in the exporting process itself. Also prints the toolchain the package was built
with (CUDA_HOME, nvcc) and what its library links against."""
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

LOAD = """
import faulthandler, sys, torch
faulthandler.enable()
path, device, how = sys.argv[1], sys.argv[2], sys.argv[3]
if device == "cuda":
    torch.zeros(1, device=device)
if how == "package":
    run = torch._inductor.aoti_load_package(path)
else:  # the package's shared library alone, through the runner the package loader wraps
    run = torch._export.aot_load(path, device)
print("loaded", flush=True)
out = run(torch.randn(4, 64, device=device))
print("ran", tuple(out.shape), flush=True)
"""

VARIANTS = {"default": {}, "embed-kernels": {"aot_inductor.embed_kernel_binary": True}}


def _load(pkg: str, device: str, how: str) -> None:
    try:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", "-c", LOAD, pkg, device, how],
                              capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        print(f"== {Path(pkg).name} by {how}: no answer in 90 s")
        return
    print(f"== {Path(pkg).name} by {how}: rc {proc.returncode}")
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if any(k in line for k in ("File ", "loaded", "ran ", "rror"))]
    print("\n".join(lines[-8:]))


def main(device: str = "cuda") -> None:
    print("torch", torch.__version__, "cuda", torch.version.cuda, "CUDA_HOME",
          os.environ.get("CUDA_HOME"), flush=True)
    nvcc = subprocess.run("nvcc --version | tail -2; which nvcc gcc", shell=True,
                          capture_output=True, text=True)
    print(nvcc.stdout.strip(), nvcc.stderr.strip()[-300:])
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, 10)).to(device).eval()
    ep = torch.export.export(model, (torch.randn(4, 64, device=device),))
    with tempfile.TemporaryDirectory() as tmp:
        packages = []
        for name, options in VARIANTS.items():
            pkg = str(Path(tmp) / f"{name}.pt2")
            try:
                torch._inductor.aoti_compile_and_package(ep, package_path=pkg,
                                                         inductor_configs=options)
            except Exception as e:  # an option this torch does not know
                print(name, "export failed:", type(e).__name__, str(e)[:300])
                continue
            packages.append(pkg)
            out = Path(tmp) / name
            with zipfile.ZipFile(pkg) as z:
                z.extractall(out)
            for lib in out.rglob("*.so"):
                dyn = subprocess.run(["readelf", "-d", str(lib)], capture_output=True,
                                     text=True).stdout
                print(name, lib.name, "links", [l.split("[")[-1].rstrip("]")
                                                for l in dyn.splitlines() if "NEEDED" in l])
                _load(str(lib), device, "so")
            _load(pkg, device, "package")
        print("== in the exporting process:", flush=True)
        for pkg in packages:
            out = torch._inductor.aoti_load_package(pkg)(torch.randn(4, 64, device=device))
            print(Path(pkg).name, "ran", tuple(out.shape), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

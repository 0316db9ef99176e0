"""The inference rungs that need a GPU (marker ``gpu``; skipped without one), each in process on
timm's miniature ViT and Swin: CUDA graphs, fasttrain's kernels, fp8 and INT8 against the fp32
reference.
A sibling of test_infer.py, which runs the CPU rungs. The exported package's GPU round trip
is not tested yet: on the GPU machines its torch-only check crashed or hung (docs/inference.md).
"""
from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from fasttrain.inference.spec import RUNGS, InferSpec
from fasttrain.run.child import ChildSpec

pytestmark = pytest.mark.gpu
CUDA = torch.cuda.is_available()
MODELS = ("timm:vit_base_patch16_224", "timm:swin_base_patch4_window7_224")


def _row(workload: str, rung: str, workdir) -> dict:
    from fasttrain.inference.job import infer_job

    spec = InferSpec(workload=workload, size="tiny", rung=asdict(RUNGS[rung]), device="cuda",
                     batch=16, images=64, iters=5, warmup=2, workdir=str(workdir))
    return infer_job(ChildSpec(job="", workload=workload, device="cuda",
                               job_args=spec.to_dict()))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("workload", MODELS)
def test_gpu_rungs_run_and_report_against_fp32(workload, tmp_path):
    pytest.importorskip("timm")
    ref = _row(workload, "eager-fp32", tmp_path)
    assert ref["error"] is None and ref["accuracy"]["agreement"] == 1.0
    fp8 = ("fp8",) if torch.cuda.get_device_capability() >= (8, 9) else ()
    for rung in ("graphs", "kernels", "gemm-gelu", "head-token", "captured", "int8") + fp8:
        row = _row(workload, rung, tmp_path)
        if rung == "head-token" and "swin" in workload:  # Swin's head averages every token
            assert row["skipped"].startswith("every token kept"), row
            continue
        assert row["error"] is None and not row.get("skipped"), (rung, row.get("error"))
        assert row["throughput"] > 0 and row["latency_ms"]["p50"] > 0
        acc = row["accuracy"]
        assert acc["images"] == 64 and acc["max_logit_dev"] < 1.0, (rung, acc)
        if rung in ("kernels", "gemm-gelu", "captured", "fp8", "int8"):  # on kernels
            assert "nothing converted" not in row["applied"]["convert"]
        if rung in ("gemm-gelu", "captured"):
            assert "in the GEMM epilogue ×" in row["applied"]["epilogue"]
        if rung == "captured":  # the class token alone on ViT, every token on Swin
            assert row["applied"]["head_tokens"]["blocks"] == (1 if "vit" in workload else 0)
        if "swin" in workload and rung in ("kernels", "gemm-gelu", "captured", "fp8", "int8"):
            assert "window attention layers" in row["applied"]["window_bias"]
        if rung == "captured":  # the throughput batch and batch 1, each its own graph
            capture = row["applied"]["capture"]
            assert capture.count("input ") == 2 and "stopped" not in capture, capture
        if rung in ("fp8", "int8"):
            assert row["applied"]["quant"]["quantized"] > 0
            assert row["applied"]["quant"]["backends"].get("reference", 0) == 0

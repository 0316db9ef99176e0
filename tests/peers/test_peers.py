"""Peer rungs (fasttrain.peers): rows from tiny public-code peers on CPU; errors are rows."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

from fasttrain.peers import PEERS, list_peers, run_peer
from fasttrain.measure.rows import ROW_KEYS

FAST = dict(tiny=True, steps=2, warmup=1, device="cpu")


def check_row(row: dict, unit: str) -> None:
    assert set(ROW_KEYS) <= set(row)
    assert row["error"] is None, row["error"]
    assert row["kind"] == "peer" and row["parity"] is None and row["applied"] == {}
    assert row["rung"] == f"peer {row['recipe']['peer_recipe']}"
    assert row["peer"].endswith(row["recipe"]["peer_recipe"])
    assert row["throughput_unit"] == unit and row["throughput"] > 0
    assert len(row["losses"]) == row["steps"] and all(math.isfinite(x) for x in row["losses"])
    assert row["model_flops"] > 0 and row["tflops"] > 0
    assert row["mfu"] is None and row["peak_allocated_gib"] is None  # CPU
    assert row["step_time_min_s"] <= row["step_time_s"] <= row["step_time_max_s"]
    assert row["warmup_s"] >= 0
    json.dumps(row)  # a JSONL row


@pytest.fixture
def fake_timm(monkeypatch):
    """A stand-in ``timm`` whose create_model returns a small conv classifier (timm not needed)."""
    calls = []

    def create_model(name, pretrained=True, num_classes=1000, img_size=224, **kwargs):
        calls.append((name, pretrained, num_classes, img_size))
        return nn.Sequential(nn.Conv2d(3, 8, 8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, num_classes))

    module = types.ModuleType("timm")
    module.create_model = create_model
    monkeypatch.setitem(sys.modules, "timm", module)
    return calls


def test_registry_names():
    assert {"vit", "swin", "sd", "llama", "llama-liger"} <= set(list_peers())
    assert PEERS["vit"][1] == "bf16+compile" and PEERS["llama-liger"][1] == "bf16"


@pytest.mark.parametrize("recipe", ["fp32", "tf32", "bf16", "bf16+compile"])
def test_timm_plumbing_every_recipe(fake_timm, recipe):
    flags = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    row = run_peer("swin", peer_recipe=recipe, batch=3, **FAST)
    check_row(row, "img/s")
    assert fake_timm == [("swin_base_patch4_window7_224", False, 10, 56)]
    assert row["batch"] == 3 and row["size"] == "tiny"
    assert row["recipe"]["compile"] is False  # CPU: eager unless compile_on_cpu
    assert row["recipe"]["optimizer"]["fused"] == recipe.startswith("bf16")
    assert (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32) == flags


@pytest.mark.parametrize("workload,module", [("vit", "timm"), ("sd", "diffusers"), ("llama", "transformers")])
def test_missing_package_is_an_error_row(monkeypatch, workload, module):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    row = run_peer(workload, **FAST)
    assert set(ROW_KEYS) <= set(row)
    assert row["error"] == f"peer needs {module} (not installed)"
    assert row["kind"] == "peer" and row["losses"] is None


def test_liger_missing_is_an_error_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    row = run_peer("llama-liger", **FAST)
    assert row["error"].startswith("peer needs") and row["rung"] == "peer bf16"


def test_size_tiny_means_tiny(fake_timm):
    row = run_peer("vit", size="tiny", steps=1, warmup=0, device="cpu")
    assert row["error"] is None and row["size"] == "tiny" and fake_timm[0][3] == 32


def test_bad_arguments_are_error_rows(fake_timm):
    assert run_peer("nope", **FAST)["error"].startswith("ValueError: unknown peer workload")
    assert "unknown peer_recipe" in run_peer("vit", peer_recipe="fp8", **FAST)["error"]
    assert "has no size" in run_peer("vit", size="huge", tiny=False, device="cpu")["error"]


def test_cli_prints_and_appends(fake_timm, tmp_path, capsys):
    from fasttrain.peers.__main__ import main

    out = tmp_path / "peers.jsonl"
    args = ["vit", "--tiny", "--steps", "2", "--warmup", "0", "--device", "cpu", "--out", str(out)]
    assert main(args) == 0
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["workload"] == "vit"
    assert json.loads(capsys.readouterr().out.splitlines()[0])["peer"].startswith("timm:vit_base_patch16_224")


def test_import_is_light():
    code = ("import sys, fasttrain.peers; "
            "print([m for m in ('timm', 'diffusers', 'transformers') if m in sys.modules])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "[]"


def test_llama_tiny():
    pytest.importorskip("transformers")
    row = run_peer("llama", **FAST)
    check_row(row, "tok/s")
    assert row["throughput"] == pytest.approx(2 * 64 / row["step_time_s"])
    assert row["recipe"]["model"]["attn_implementation"] == "sdpa"


def test_sd_tiny():
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    row = run_peer("sd", **FAST)
    check_row(row, "img/s")
    assert row["recipe"]["ema"] == {"decay": 0.9999, "foreach_lerp": True}
    assert row["recipe"]["model"]["frozen_dtype"] == "bfloat16"


@pytest.mark.parametrize("workload", ["vit", "swin"])
def test_timm_tiny(workload):
    pytest.importorskip("timm")
    check_row(run_peer(workload, **FAST), "img/s")


def test_gqa_flop_formulas_count_grouped_query_attention(monkeypatch):
    from torch.utils import flop_counter as fc

    from fasttrain.measure.flops import gqa_flop_formulas

    def strict(q, k, v):  # torch ≤ 2.12: equal heads asserted
        assert q[1] == k[1] == v[1]
        return 4 * q[0] * q[1] * q[2] * k[2] * q[3]

    def strict_bwd(g, q, k, v):
        assert q[1] == k[1] == v[1]
        return 10 * q[0] * q[1] * q[2] * k[2] * q[3]

    monkeypatch.setattr(fc, "sdpa_flop_count", strict)
    monkeypatch.setattr(fc, "sdpa_backward_flop_count", strict_bwd)
    q, kv, rep = (2, 32, 128, 64), (2, 8, 128, 64), (2, 32, 128, 64)
    with gqa_flop_formulas():
        assert fc.sdpa_flop(q, kv, kv) == strict(q, rep, rep)  # the registered formula sees the patch
        assert fc.sdpa_backward_flop(q, q, kv, kv) == strict_bwd(q, q, rep, rep)
    assert fc.sdpa_flop_count is strict and fc.sdpa_backward_flop_count is strict_bwd


def test_a_missing_dependency_of_the_peers_package_is_named(timm_without_torchvision):
    """timm installed without torchvision: the line names torchvision and how to get it."""
    from fasttrain.peers import unavailable

    assert unavailable("swin") == ("peer needs timm, which needs torchvision (not installed: "
                                   "pip install torchvision)")
    assert unavailable("examples.gpt:make_workload") is None  # the plain loop needs nothing


def test_a_ladder_with_a_peer_that_cannot_run_is_refused_before_its_rungs(monkeypatch, capsys,
                                                                          tmp_path):
    from fasttrain.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["ladder", "llama", "--peer", "--device", "cpu", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("fasttrain: error: --peer: the peer needs transformers (not installed); "
                   "install it, or run without --peer")
    assert not list(tmp_path.iterdir())  # no rung ran, no rows file left


def test_a_peer_package_that_breaks_as_it_imports_is_named_not_raised(monkeypatch):
    import importlib

    from fasttrain.peers import unavailable

    real = importlib.import_module

    def broken(name, package=None):
        if name == "transformers":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", broken)
    assert unavailable("llama") == ("peer cannot import transformers (RuntimeError: operator "
                                    "torchvision::nms does not exist)")

"""The inference ladder on the CPU: the rungs and their checks (spec.py), the measuring harness
(bench.py: accuracy gate, padded batches, timings' keys), one rung at a time in-process
(job.py) on timm's ViT and Swin (through the torchvision stub) and fasttrain's own ViT, serving
a ``fasttrain train --save`` checkpoint, the table (report/inference.py), the labelled pattern
images, and ``fasttrain infer`` end to end with ``--export`` (marked slow)."""
import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

from fasttrain.cli import main
from fasttrain.errors import FasttrainError
from fasttrain.inference import bench
from fasttrain.inference.job import infer_job
from fasttrain.inference.model import Classifier, check_device, load_classifier, prepare
from fasttrain.inference.spec import (GATE, RUNGS, InferRung, InferSpec, REFERENCE,
                                      nothing_added, rungs_named)
from fasttrain.report.inference import inference_table, line, notes
from fasttrain.run.checkpoint import model_weights
from fasttrain.run.child import ChildSpec
from fasttrain.workloads import load_workload
from fasttrain.workloads.data import write_pattern_images
from tests.converters.timm_stub import import_timm

TIMM = import_timm()  # timm's ViT and Swin with the torchvision stub (this process only)
CPU = torch.device("cpu")


# --- spec.py: the rungs ---

@pytest.mark.parametrize("names", [[], ["default"]])
def test_default_rungs_are_all_in_order_reference_first(names):
    got = [r.name for r in rungs_named(names)]
    assert got == list(RUNGS) and got[0] == REFERENCE == "eager-fp32"


def test_named_rungs_put_the_reference_first_once_and_drop_repeats():
    got = [r.name for r in rungs_named(["sdpa", "eager-fp32", "sdpa", "eager-fp16"])]
    assert got == ["eager-fp32", "sdpa", "eager-fp16"]
    assert [r.name for r in rungs_named(["int8"])] == ["eager-fp32", "int8"]


@pytest.mark.parametrize("names", [["warp"], ["sdpa", "warp"], ["peer-compile"]])
def test_unknown_rung_is_refused(names):
    with pytest.raises(FasttrainError, match="unknown inference rung"):
        rungs_named(names)


@pytest.mark.parametrize("field,value,needle", [
    ("dtype", "float64", "dtype 'float64' is not one of"),
    ("compile", "fast", "compile mode 'fast' is not one of"),
    ("quant", "int4", "quant 'int4' is not fp8 or int8"),
    ("adds", "epilogue", "adds 'epilogue' is not one of quant, head_tokens"),
    ("adds", "head_tokens", "it adds head_tokens, which it does not set"),
])
def test_bad_rung_fields_are_refused(field, value, needle):
    with pytest.raises(FasttrainError, match=needle):
        InferRung("bad", "a bad rung", **{field: value})


@pytest.mark.parametrize("rung, applied, why", [
    (InferRung("r", "x"), {}, None),
    (InferRung("q", "x", quant="int8"), {"quant": {"quantized": 0, "line": "int8: none"}},
     "int8: none"),
    (InferRung("q", "x", quant="int8"), {"quant": {"quantized": 3, "line": "int8: 3"}}, None),
    (InferRung("h", "x", convert=True, head_tokens=True, adds="head_tokens"),
     {"head_tokens": {"blocks": 0, "line": "every token kept: …"}}, "every token kept: …"),
    (InferRung("h", "x", convert=True, head_tokens=True, adds="head_tokens"), {},
     "head_tokens changed nothing"),
    (InferRung("c", "x", convert=True, head_tokens=True),  # carries the step, does not add it
     {"head_tokens": {"blocks": 0, "line": "every token kept: …"}}, None),
])
def test_a_rung_whose_step_changed_nothing_says_why(rung, applied, why):
    assert nothing_added(rung, applied) == why


def test_a_rung_without_graphs_keeps_everything_else():
    plain = RUNGS["captured"].without_graphs()
    assert (plain.compile, plain.capture) == ("default", False)
    assert plain.head_tokens and plain.gelu_epilogue and plain.convert
    assert RUNGS["graphs"].without_graphs().compile == "default"
    assert RUNGS["sdpa"].without_graphs().compile is None


def test_spec_round_trips_through_json():
    spec = InferSpec(workload="vit", size="tiny", rung=asdict(RUNGS["graphs"]))
    back = InferSpec(**json.loads(json.dumps(spec.to_dict())))  # requires: tuple → list → tuple
    assert back.rung_config() == RUNGS["graphs"]


def test_check_device_on_the_cpu():
    assert check_device(RUNGS["eager-fp32"], CPU) is None
    assert check_device(RUNGS["sdpa"], CPU) is None
    assert check_device(RUNGS["graphs"], CPU) == "needs a CUDA GPU"
    assert check_device(RUNGS["compile"], CPU).startswith("fp16 compiled on a CPU")
    assert check_device(InferRung("c", "x", dtype="float32", compile="default"), CPU) is None


# --- bench.py: accuracy ---

def _logits(n: int, classes: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, classes, generator=torch.Generator().manual_seed(seed))


def _flip(logits: torch.Tensor, i: int) -> torch.Tensor:
    """``logits`` with row ``i``'s argmax moved to another class."""
    out = logits.clone()
    top = int(out[i].argmax())
    out[i, (top + 1) % out.shape[1]] = out[i, top] + 1.0
    return out


def test_identical_logits_agree_fully():
    ref = _logits(50)
    acc = bench.accuracy(ref.clone(), ref, None, None)
    assert acc["agreement"] == 1.0 and acc["max_logit_dev"] == 0.0
    assert acc["mean_logit_dev"] == 0.0 and acc["passed"] and acc["images"] == 50
    assert acc["top1"] is None and acc["gate"] == GATE and "reason" not in acc


@pytest.mark.parametrize("n,passed", [(100, True), (200, True), (50, False), (10, False)])
def test_one_flipped_argmax_passes_only_at_the_gate(n, passed):
    ref = _logits(n)
    acc = bench.accuracy(_flip(ref, n // 2), ref, None, None)
    assert acc["agreement"] == pytest.approx((n - 1) / n)
    assert acc["passed"] is passed and ((n - 1) / n >= GATE) is passed
    assert acc["max_logit_dev"] > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_fail_with_a_reason(bad):
    ref = _logits(200)
    got = ref.clone()
    got[3, 0] = bad  # the argmax of every row may even agree: still a failure
    acc = bench.accuracy(got, ref, None, None)
    assert not acc["passed"] and acc["reason"] == "non-finite logits"


def test_logits_of_another_shape_are_refused():
    with pytest.raises(FasttrainError, match=r"logits \(8, 10\) do not match"):
        bench.accuracy(_logits(8), _logits(9), None, None)


def test_top1_against_labels():
    ref = _logits(20)
    labels = ref.argmax(-1).clone()
    labels[:5] = (labels[:5] + 1) % 10  # 15 of 20 right
    acc = bench.accuracy(ref, ref, labels, top1_ref=0.75)
    assert acc["top1"] == pytest.approx(0.75) and acc["top1_ref"] == 0.75


# --- bench.py: batches, timings, FLOPs, the reference file ---

class _PerImage(nn.Module):
    """uint8 (B, H, W, 3) → (B, 4), each image on its own; records the batch shapes it saw."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(4 * 4 * 3, 4)
        self.shapes = []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.proj(x.float().flatten(1) / 255)


def _images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, 4, 4, 3), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n,batch", [(13, 5), (3, 8), (10, 5)])
def test_all_logits_pad_the_last_chunk_and_crop_it(n, batch):
    fwd, images = _PerImage(), _images(n)
    with torch.no_grad():
        whole = fwd(images)
        fwd.shapes.clear()
        got = bench.all_logits(fwd, images, batch, CPU)
    assert got.shape == (n, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got, whole)
    assert set(fwd.shapes) == {(batch, 4, 4, 3)}  # one shape: a compiled graph is not rebuilt


def test_latency_and_throughput_keys():
    fwd, x = _PerImage(), _images(6)
    with torch.no_grad():
        lat = bench.latency_ms(fwd, x[:1], iters=4, warmup=1, device=CPU)
        one = bench.latency_ms(fwd, x[:1], iters=1, warmup=0, device=CPU)
        thr = bench.throughput(fwd, x, iters=3, warmup=1, device=CPU)
    assert set(lat) == {"p50", "p90", "batch"} and lat["batch"] == 1
    assert 0 < lat["p50"] <= lat["p90"] and one["p50"] == one["p90"] > 0
    assert {"throughput", "step_time_s", "step_time_min_s", "step_time_max_s"} <= set(thr)
    assert thr["throughput"] > 0
    assert thr["step_time_min_s"] <= thr["step_time_s"] <= thr["step_time_max_s"]
    assert "peak_allocated_gib" not in thr  # CUDA only


def test_count_flops_of_a_linear():
    fwd = _PerImage()
    assert bench.count_flops(fwd, _images(5)) == 2 * 5 * 48 * 4


def test_reference_file_round_trip(tmp_path):
    with pytest.raises(FasttrainError, match="the eager-fp32 rung did not finish"):
        bench.load_reference(tmp_path)
    bench.save_reference(tmp_path, _logits(6), 1234, 0.5)
    ref = bench.load_reference(tmp_path)
    torch.testing.assert_close(ref["logits"], _logits(6))
    assert ref["flops"] == 1234 and ref["top1"] == 0.5


# --- job.py: one rung in-process ---

def _job(workload: str, rung: InferRung, workdir: Path, **kw) -> dict:
    spec = InferSpec(workload=workload, size="tiny", rung=asdict(rung), batch=8, images=20,
                     iters=2, warmup=1, workdir=str(workdir), **kw)
    return infer_job(ChildSpec(job="", workload=spec.workload, job_args=spec.to_dict()))


def _measured(row: dict) -> None:
    assert not row.get("error") and not row.get("skipped"), row
    assert row["kind"] == "inference" and row["throughput"] > 0 and row["batch"] == 8
    assert row["latency_ms"]["batch"] == 1 and row["accuracy"]["images"] == 20
    assert row["accuracy"]["passed"] and row["parity"]["passed"]


WORKLOADS = ["timm:vit_base_patch16_224", "timm:swin_base_patch4_window7_224", "vit"]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_rungs_in_process(workload, tmp_path):
    if workload.startswith("timm:") and TIMM is None:
        pytest.skip("timm is not installed")
    ref = _job(workload, RUNGS[REFERENCE], tmp_path)
    _measured(ref)
    assert ref["accuracy"]["agreement"] == 1.0 and ref["accuracy"]["max_logit_dev"] == 0.0
    assert ref["model_flops"] > 0 and ref["accuracy"]["top1"] is None  # random labels
    assert (tmp_path / bench.REFERENCE_FILE).exists() and (tmp_path / bench.EVAL_FILE).exists()

    for name in ("eager-fp16", "sdpa"):
        row = _job(workload, RUNGS[name], tmp_path)
        _measured(row)
        assert 0 < row["accuracy"]["max_logit_dev"] < 0.1  # fp16 is not fp32
        assert row["model_flops"] == ref["model_flops"]  # read from the reference
    timm = workload.startswith("timm:")
    assert ("written-out" in row["applied"]["attention"]) is False
    assert ("SDPA attention in" in row["applied"]["attention"]) is timm

    conv = _job(workload, InferRung("c", "x", dtype="float32", convert=True), tmp_path)
    _measured(conv)
    assert conv["accuracy"]["agreement"] == 1.0
    assert ("timm ViT Block" if "vit_" in workload else
            "timm Swin block" if "swin" in workload else "LayerNorm") in conv["applied"]["convert"]

    epi = _job(workload, InferRung("e", "x", dtype="float32", convert=True, gelu_epilogue=True),
               tmp_path)
    _measured(epi)
    assert "in the GEMM epilogue ×" in epi["applied"]["epilogue"]
    assert epi["accuracy"]["agreement"] == 1.0  # the CPU's epilogue GELU is the erf one

    # INT8 on the converted model, as the quantized rungs run (fasttrain's layers take the
    # 8-bit linears through layers.linear.linear)
    quant = _job(workload, InferRung("q", "x", dtype="float32", convert=True, quant="int8"),
                 tmp_path)
    _measured(quant)
    assert quant["applied"]["quant"]["quantized"] > 0 and quant["applied"]["convert"]
    assert quant["applied"]["quant"]["mode"] == "int8"

    # the last block on the class token: ViTs (which pool by it) measured, Swin skipped
    head = _job(workload, InferRung("h", "x", dtype="float32", convert=True, head_tokens=True,
                                    adds="head_tokens"), tmp_path)
    if "swin" in workload:
        assert head["skipped"].startswith("every token kept: no ViT") and not head["throughput"]
    else:
        _measured(head)
        assert head["applied"]["head_tokens"]["blocks"] == 1
        assert head["accuracy"]["max_logit_dev"] < 1e-4

    skipped = _job(workload, RUNGS["graphs"], tmp_path)
    assert skipped["skipped"] == "needs a CUDA GPU" and skipped["throughput"] is None


def test_a_plain_pytorch_model_of_your_own_in_process(tmp_path):
    """examples/vit.py's ViT (no timm, no fasttrain in it), whose data set gives float images:
    the reference, fp16 with SDPA, and fasttrain's layers with the GELU epilogue in fp32."""
    wl = "examples.vit:make_workload"
    ref = _job(wl, RUNGS[REFERENCE], tmp_path)
    _measured(ref)
    saved = torch.load(tmp_path / bench.EVAL_FILE, weights_only=True)["images"]
    assert saved.dtype == torch.float32 and saved.shape == (20, 3, 32, 32)
    fp16 = _job(wl, RUNGS["sdpa"], tmp_path)
    _measured(fp16)
    assert 0 < fp16["accuracy"]["max_logit_dev"] < 0.1
    conv = _job(wl, InferRung("e", "x", dtype="float32", convert=True, gelu_epilogue=True),
                tmp_path)
    _measured(conv)
    assert conv["applied"]["convert"] and "in the GEMM epilogue ×" in conv["applied"]["epilogue"]
    assert conv["accuracy"]["agreement"] == 1.0


def test_a_cnn_of_your_own_with_features_and_head_runs_its_own_forward(tmp_path):
    """examples/cnn.py's model has ``features`` and ``head`` attributes, as fasttrain's ViT and
    Swin do, but its own forward (a pooling between them): the classifier calls that."""
    _measured(_job("examples.cnn:make_workload", RUNGS[REFERENCE], tmp_path))


def test_a_model_of_your_own_gets_its_input_in_the_rungs_dtype():
    """The input is cast to the rung's dtype, not to a parameter's: this model has none."""
    class Buffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(12, 5))

        def forward(self, x):
            return x.flatten(1) @ self.w

    model, _ = prepare(Classifier(Buffers()), InferRung("h", "fp16", fused_attention=None), CPU)
    assert model(torch.randn(2, 3, 2, 2)).dtype == torch.float16


@pytest.mark.parametrize("fwd,needle", [
    (lambda x: x.sum((1, 2, 3)), "the model's forward gave (4,) for 4 images, not logits "
                                 "(batch, classes)"),
    (lambda x: (x, x), "the model's forward gave tuple for 4 images, not logits"),
    (lambda x: x.flatten(1)[:2], "the model's forward gave (2, 12) for 4 images, not logits"),
    (lambda x, labels: x, "the model's forward does not take one batch of images (<lambda>() "
                          "missing 1 required positional argument: 'labels')"),
])
def test_a_forward_that_gives_no_logits_is_one_line(fwd, needle):
    with pytest.raises(FasttrainError, match=re.escape(needle)):
        bench.all_logits(fwd, torch.zeros(4, 3, 2, 2), 4, CPU)


def test_images_neither_uint8_nor_float_are_refused(tmp_path):
    from fasttrain import SimpleWorkload

    data = [{"images": torch.zeros(3, 4, 4, dtype=torch.int64), "labels": torch.tensor(0)}] * 4
    wl = SimpleWorkload(name="ints", build=nn.Identity, data=data, unit="img")
    with pytest.raises(FasttrainError, match=re.escape(
            "ints: its images are (4, 3, 4, 4) torch.int64, neither uint8 nor floating point")):
        bench.eval_images(wl, 4, tmp_path)


def test_compile_rung_in_process(tmp_path):
    _job("vit", RUNGS[REFERENCE], tmp_path)
    row = _job("vit", InferRung("k", "compiled", dtype="float32", compile="default"), tmp_path)
    _measured(row)
    assert row["applied"]["compile"] == "default" and row["accuracy"]["agreement"] == 1.0
    assert row["accuracy"]["max_logit_dev"] < 1e-3


def test_capture_under_reduce_overhead_is_refused():
    with pytest.raises(FasttrainError, match="capture records its own CUDA graphs; compile "
                                             "with mode default"):
        InferRung("bad", "two graph layers", compile="reduce-overhead", capture=True)


def test_captured_rung_needs_a_gpu():
    assert check_device(RUNGS["captured"], CPU) == "needs a CUDA GPU"


def test_a_rung_without_the_reference_is_an_error(tmp_path):
    with pytest.raises(FasttrainError, match="no fp32 reference logits"):
        _job("vit", RUNGS["sdpa"], tmp_path)


def test_labelled_data_gives_top1(tmp_path):
    data = write_pattern_images(tmp_path / "data", count=12, size=32, classes=10, seed=0)
    ref = _job("vit", RUNGS[REFERENCE], tmp_path, data=str(data))
    row = _job("vit", RUNGS["sdpa"], tmp_path, data=str(data))
    assert ref["accuracy"]["images"] == 12 == row["accuracy"]["images"]
    assert 0 <= ref["accuracy"]["top1"] <= 1 and row["accuracy"]["top1_ref"] == \
        ref["accuracy"]["top1"]


# --- a fasttrain train --save checkpoint ---

@pytest.fixture(scope="module")
def vit_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    argv = ["train", "vit", "--size", "tiny", "--device", "cpu", "--steps", "2", "--warmup",
            "0", "--batch", "4", "--save", str(tmp / "ckpt"), "--out", str(tmp / "out")]
    assert main(argv) == 0
    return tmp / "ckpt"


def test_checkpoint_weights_are_served(vit_checkpoint):
    wl = load_workload("vit", "tiny")
    saved = model_weights(vit_checkpoint, wl)
    served = load_classifier(wl, str(vit_checkpoint)).model.state_dict()
    fresh = load_classifier(wl).model.state_dict()
    assert saved and set(saved) <= set(served)
    for name, tensor in saved.items():
        torch.testing.assert_close(served[name], tensor.to(served[name].dtype), rtol=0, atol=0)
    assert any(not torch.equal(fresh[n], saved[n]) for n in saved)  # two steps moved them


def _light(workload: str, size: str):
    """The workload's name and size only: model_weights reads no more."""
    return type("W", (), {"name": workload, "size": size})()


@pytest.mark.parametrize("workload,size", [("swin", "tiny"), ("vit", "base")])
def test_checkpoint_of_another_workload_is_one_line(vit_checkpoint, workload, size):
    wl = load_workload(workload, size) if size == "tiny" else _light(workload, size)
    with pytest.raises(FasttrainError, match=f"holds vit tiny, not {workload} {size}") as err:
        model_weights(vit_checkpoint, wl)
    assert "\n" not in str(err.value)
    if size == "tiny":
        with pytest.raises(FasttrainError, match="holds vit tiny"):
            load_classifier(wl, str(vit_checkpoint))


# --- report/inference.py ---

def _rows() -> list[dict]:
    base = {"kind": "inference", "workload": "vit", "size": "tiny", "batch": 64, "peer": None,
            "error": None}
    acc = {"agreement": 0.998, "passed": True, "top1": 0.812, "top1_ref": 0.815}
    full = {**base, "rung": "sdpa", "throughput": 123456.7, "step_time_s": 0.0123,
            "latency_ms": {"p50": 1234.56, "p90": 2345.67, "batch": 1},
            "peak_allocated_gib": 12.3, "tflops": 456.7, "x_peer": 1.23, "latency_x_peer": 0.87,
            "accuracy": acc}
    return [
        {**full, "rung": "eager-fp32", "accuracy": {**acc, "agreement": 1.0}},
        {**base, "rung": "peer-compile", "peer": "fp16 torch.compile", "skipped":
         "needs a CUDA GPU", "throughput": None},
        full,
        {**full, "rung": "int8", "tflops": 3.2, "accuracy": {**acc, "agreement": 0.95,
                                                              "passed": False},
         "applied": {"quant": {"line": "int8: 12 linear layers quantized"}}},
        {**base, "rung": "kernels", "error": "RuntimeError: boom"},
    ]


def _render(rows: list[dict], width: int = 80) -> str:
    console = Console(width=width, record=True)
    console.print(inference_table(rows, title="inference · vit tiny · cpu", width=width))
    return console.export_text()


def test_table_renders_every_row_within_80_columns():
    text = _render(_rows())
    lines = text.splitlines()
    assert all(len(ln) <= 80 for ln in lines), text
    for row in _rows():
        assert any(ln.strip().startswith(row["rung"] + " ") for ln in lines), (row["rung"], text)
    for figure in ("123,457", "1234.56/2345.67", "✓ 99.8%", "✗ 95.0%", "-0.30", "1.23", "0.87"):
        assert figure in text, (figure, text)
    assert "…" not in text, text  # nothing cropped


def test_table_at_gpu_figures_fits_80_columns_and_keeps_all_columns_when_wide():
    acc = {"agreement": 1.0, "passed": True, "top1": 0.81, "top1_ref": 0.81}
    row = {"rung": "peer-eager-fp16", "throughput": 11721.0, "step_time_s": 0.00543,
           "latency_ms": {"p50": 0.65, "p90": 0.69}, "peak_allocated_gib": 0.2, "tflops": 414.0,
           "x_peer": 1.2, "latency_x_peer": 0.9, "accuracy": acc}
    narrow = _render([row])
    assert all(len(ln) <= 80 for ln in narrow.splitlines()), narrow
    assert "…" not in narrow and "11,721" in narrow and "peer-eager-fp16" in narrow, narrow
    wide = _render([row], width=140)
    assert all(col in wide for col in ("img/s", "ms", "GiB", "TFLOP/s", "agree")), wide
    assert "414" in wide and "…" not in wide


def test_notes_name_errors_skips_and_quantized_layers():
    got = notes(_rows())
    assert "batch 64" in got[0]
    assert "peer-compile: skipped: needs a CUDA GPU" in got
    assert "kernels: error: RuntimeError: boom" in got
    assert "int8: int8: 12 linear layers quantized" in got
    assert len(got) == 4


def test_notes_say_what_a_rung_adds_to_the_converted_layers():
    convert = "timm ViT Block ×12"
    rows = [{"rung": "kernels", "applied": {"convert": convert}},
            {"rung": "gemm-gelu", "applied": {"convert": convert, "epilogue": "fc1 ×12"}},
            {"rung": "captured", "applied": {"convert": convert, "epilogue": "fc1 ×12",
                                             "capture": "input 64: 24 … now kernels"}}]
    assert notes(rows)[1:] == ["kernels: timm ViT Block ×12", "gemm-gelu: fc1 ×12",
                               "captured: fc1 ×12; CUDA graphs: input 64: 24 … now kernels"]
    heads = {"blocks": 1, "line": "the last of 12 blocks …"}
    rows = [{"rung": "head-token", "applied": {"convert": convert, "head_tokens": heads}},
            {"rung": "captured", "applied": {"convert": convert, "head_tokens": {
                "blocks": 0, "line": "every token kept: …"}}}]
    assert notes(rows)[1:] == ["head-token: the last of 12 blocks …", "captured: " + convert]


def test_line_of_a_row():
    rows = _rows()
    assert line(rows[2]).startswith("rung sdpa  img/s 123,457")
    assert line(rows[1]) == "rung peer-compile  (skipped: needs a CUDA GPU)"


# --- write_pattern_images ---

def test_pattern_images_are_labelled_and_seeded(tmp_path):
    def write(name, seed):
        folder = write_pattern_images(tmp_path / name, count=10, size=16, classes=4, seed=seed)
        labels = json.loads((folder / "labels.json").read_text())
        images = sorted(p for p in folder.iterdir() if p.suffix == ".jpg")
        return labels, [p.read_bytes() for p in images]

    labels, images = write("a", 0)
    assert len(labels) == len(images) == 10 and all(0 <= c < 4 for c in labels)
    assert write("b", 0) == (labels, images)
    assert write("c", 1)[1] != images
    wl = load_workload("vit", "tiny", data=str(tmp_path / "a"))
    item = wl.dataset()[0]
    assert item["images"].dtype == torch.uint8 and int(item["labels"]) == labels[0]


# --- fasttrain infer, end to end ---

@pytest.mark.slow
def test_infer_end_to_end_with_export(capsys, tmp_path):
    out, package = tmp_path / "out", tmp_path / "vit.pt2"
    argv = ["infer", "vit", "--device", "cpu", "--images", "256", "--iters", "5", "--warmup",
            "2", "--batch", "8", "--rungs", "eager-fp16,sdpa", "--out", str(out), "--export",
            str(package)]
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 0, cap.out + cap.err
    assert "Traceback" not in cap.out + cap.err
    (rows_file,) = out.glob("infer-vit-tiny-*.jsonl")
    rows = [json.loads(x) for x in rows_file.read_text().splitlines()]
    names = [r["rung"] for r in rows]
    assert names == ["eager-fp32", "peer-eager-fp16", "peer-compile", "eager-fp16", "sdpa",
                     "export"]
    assert rows[2]["skipped"] == "needs a CUDA GPU" and rows[2]["peer"]
    for row in rows[:2] + rows[3:5]:
        assert not row.get("error") and row["accuracy"]["passed"], row
        assert row["env"]["torch"]
    assert rows[1]["peer"] == "fp16 eager"
    export = rows[-1]
    assert not export.get("error") and export["exported_from"] in ("eager-fp32", "eager-fp16",
                                                                   "sdpa")
    assert export["accuracy"]["passed"] and export["accuracy"]["images"] == 256
    if export["exported_from"] == "eager-fp32":
        assert export["accuracy"]["agreement"] == 1.0
    assert package.is_file() and export["size_mb"] > 0 and export["package"] == str(package)
    assert not list(tmp_path.glob("*.partial.pt2"))
    assert "inference · vit tiny · cpu" in cap.out  # the table
    assert "peer-compile: skipped: needs a CUDA GPU" in cap.out
    assert f"rows: {rows_file}" in cap.out


@pytest.mark.parametrize("body,needle", [
    ("import faulthandler, os, signal\nfaulthandler.enable()\nos.kill(os.getpid(), "
     "signal.SIGSEGV)\n",
     "did not run on its own: its process died of SIGSEGV (Fatal Python error: Segmentation "
     "fault)"),
    ("import sys\nprint('first', file=sys.stderr)\nraise SystemExit('the last line')\n",
     "did not run on its own: the last line"),
    ("import faulthandler, os, signal\nfaulthandler.enable()\ndef _load_aoti():\n"
     "    os.kill(os.getpid(), signal.SIGSEGV)\n_load_aoti()\n",
     "did not run on its own: its process died of SIGSEGV inside torch's AOTInductor loader"),
])
def test_a_package_whose_check_process_fails_is_named_by_how(tmp_path, monkeypatch, body,
                                                             needle):
    """A crash in the package's native code (a signal) says which signal and faulthandler's
    line, and a crash inside torch's package loader says so; an error exit gives its last line."""
    from fasttrain.errors import FasttrainError
    from fasttrain.inference import export

    script = tmp_path / "check.py"
    script.write_text(body)
    monkeypatch.setattr(export, "CHECK_SCRIPT", script)
    with pytest.raises(FasttrainError, match=re.escape(needle)):
        export.check_package(tmp_path / "p.pt2", tmp_path, 1, 1, 0, "cpu", 60)


def test_a_crash_in_torchs_loader_stops_the_export_at_the_first_rung(tmp_path, monkeypatch):
    """When torch's own loader crashes, no other rung is exported (each export is minutes on a
    GPU, and its package would meet the same loader); a rung whose package fails for its own
    reason still lets the next one try."""
    from fasttrain.inference import export
    from fasttrain.inference.runner import InferLadder

    exported = []
    monkeypatch.setattr(export, "run_in_child", lambda child, *a, **k: exported.append(
        child.job_args["rung"]["name"]) or {"error": None, "applied": {}})
    spec = InferLadder(workload="vit", out=tmp_path / "rows.jsonl")
    passed = [{"rung": name, "peer": None, "throughput": t, "accuracy": {"passed": True}}
              for name, t in (("kernels", 3.0), ("graphs", 2.0), ("sdpa", 1.0))]

    def crash(*a, **k):
        raise export.LoaderCrash("did not run on its own: SIGSEGV inside torch's loader")

    monkeypatch.setattr(export, "check_package", crash)
    row = export.export_best(spec, passed, tmp_path / "m.pt2", tmp_path)
    assert exported == ["kernels"] and "inside torch's loader" in row["error"]
    assert row["tried"][-1].startswith("2 other passing rung(s) not tried")
    assert "loader_crash" not in row and not (tmp_path / "m.pt2").exists()

    exported.clear()
    monkeypatch.setattr(export, "check_package", lambda *a, **k: (_ for _ in ()).throw(
        export.FasttrainError("did not run on its own: KeyError: 'x'")))
    row = export.export_best(spec, passed, tmp_path / "m.pt2", tmp_path)
    assert exported == ["kernels", "graphs", "sdpa"] and len(row["tried"]) == 3

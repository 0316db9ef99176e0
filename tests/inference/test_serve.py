"""``fasttrain.serve``: a model of your own prepared as an inference rung, in your process. On the
CPU: timm's miniature ViT (through the torchvision stub) converted with the GELU epilogue against
the unconverted model, the input cast, and every refusal; on CUDA (marker ``gpu``), the
``captured`` rung against fp32."""
import copy
import re

import pytest
import torch
from torch import nn

import fasttrain
from fasttrain.errors import FasttrainError
from fasttrain.inference.spec import InferRung
from fasttrain.workloads import load_workload
from tests.converters.timm_stub import import_timm

TIMM = import_timm()
CUDA = torch.cuda.is_available()


def _timm_vit() -> nn.Module:
    if TIMM is None:
        pytest.skip("timm is not installed")
    torch.manual_seed(0)
    return load_workload("timm:vit_base_patch16_224", "tiny").build_model().model.eval()


def test_serve_converts_in_place_and_keeps_the_outputs():
    model = _timm_vit()
    reference = copy.deepcopy(model)
    rung = InferRung("mine", "fp32, fasttrain's layers, the GELU epilogue", dtype="float32",
                     convert=True, gelu_epilogue=True)
    served = fasttrain.serve(model, rung, device="cpu")
    assert "timm ViT Block" in served.applied["convert"]
    assert "in the GEMM epilogue ×" in served.applied["epilogue"]
    assert not any(p.requires_grad for p in model.parameters())
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)  # cast to the rung's float32
    with torch.no_grad():
        want = reference(x.float())
    got = served(x)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_named_rung_serves_in_fp16():
    served = fasttrain.serve(nn.Sequential(nn.Linear(8, 4)), "eager-fp16", device="cpu")
    out = served(torch.randn(2, 8))
    assert out.dtype == torch.float16 and served.rung.name == "eager-fp16"


def test_integer_inputs_are_passed_as_they_are():
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, ids):
            return self.emb(ids)

    served = fasttrain.serve(Embed(), "eager-fp32", device="cpu")
    assert served(torch.tensor([[1, 2, 3]])).shape == (1, 3, 4)


@pytest.mark.parametrize("args,needle", [
    (("not a model",), "serve takes a torch.nn.Module, not str"),
    ((nn.Linear(2, 2), "fastest"), "unknown inference rung 'fastest': use one of eager-fp32"),
    ((nn.Linear(2, 2), "captured", "cpu"),
     "rung captured cannot serve on cpu: needs a CUDA GPU; pick a rung that runs there"),
    ((nn.Sequential(nn.ReLU()), InferRung("q", "x", dtype="float32", quant="int8"), "cpu"),
     "rung q adds nothing to Sequential (int8: matched nothing (no nn.Linear in the model); "
     "nothing quantized); serve it with the rung before"),
    ((nn.Sequential(nn.Linear(2, 2)), InferRung("h", "x", dtype="float32", convert=True,
                                                 head_tokens=True, adds="head_tokens"), "cpu"),
     "rung h adds nothing to Sequential (every token kept: no ViT of timm's or fasttrain's"),
])
@pytest.mark.filterwarnings("ignore:quantize_linears")
def test_bad_input_is_one_line(args, needle):
    with pytest.raises(FasttrainError, match=re.escape(needle)):
        fasttrain.serve(*args)


@pytest.mark.skipif(CUDA, reason="the refusal of a machine without a GPU")
def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(FasttrainError, match="device cuda: this machine has no CUDA GPU; serve "
                                             "on device='cpu'"):
        fasttrain.serve(nn.Linear(2, 2), "eager-fp32", device="cuda")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_gpu_index_past_the_machines_is_one_line():
    n = torch.cuda.device_count()
    with pytest.raises(FasttrainError, match=f"device cuda:{n}: this machine has {n} GPU"):
        fasttrain.serve(nn.Linear(2, 2), "eager-fp32", device=f"cuda:{n}")


def test_a_capture_rung_of_your_own_is_refused_on_the_cpu():
    rung = InferRung("mine", "captured eagerly", dtype="float32", capture=True)
    with pytest.raises(FasttrainError, match="rung mine cannot serve on cpu: needs a CUDA GPU"):
        fasttrain.serve(nn.Linear(2, 2), rung, device="cpu")


def test_a_call_with_no_tensor_is_refused():
    served = fasttrain.serve(nn.Linear(2, 2), "eager-fp32", device="cpu")
    with pytest.raises(FasttrainError, match="a served model takes one tensor \\(a batch\\), "
                                             "not list"):
        served([1.0, 2.0])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_captured_rung_serves_a_timm_vit():
    model = _timm_vit()
    reference = copy.deepcopy(model).cuda()
    served = fasttrain.serve(model, "captured")
    x = torch.randn(8, 3, 32, 32, device="cuda")
    with torch.no_grad():
        want = reference(x)
    got = served(x)
    assert got.dtype == torch.float16
    assert served.applied["capture"].startswith("input 8×3×32×32 float16: ")
    assert (got.float() - want).abs().max() < 1.0  # fp16 and the tanh GELU, as the ladder's bound

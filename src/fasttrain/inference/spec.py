"""The inference ladder's rungs and what one inference run is asked to do.

Each rung is a complete configuration of the same forward pass (not a patch on the previous
one), so any subset runs on its own; in the default order each adds one thing to the rung
before it, after the Swin article's inference half: fp32 → fp16, the source's baseline → fused
attention → compile → CUDA graphs → fasttrain's forward-only kernels → fc1's bias and GELU in
its GEMM → the last block on the class token alone (where the head reads nothing else) →
fasttrain's own CUDA graphs (memsets as kernel nodes); fp8 or INT8 linears each go on the
kernels rung. The two peer rungs are what a user gets from PyTorch alone on the same
model: eager fp16 as the library ships it, and ``torch.compile(mode="reduce-overhead")``; they
use no fasttrain code but the measuring harness and the image normalisation every rung shares.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..errors import FasttrainError

DTYPES = ("float32", "float16", "bfloat16")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs")
QUANT_MODES = (None, "fp8", "int8")
GATE = 0.99
"""Top-1 agreement with the fp32 model a rung must reach to pass (as parity gates training)."""


ADDS = {"quant": "quantized", "head_tokens": "blocks"}
"""The steps a rung can add to the one before it (``InferRung.adds``), each with the key of its
``applied`` entry that counts what it changed."""


@dataclass(frozen=True)
class InferRung:
    """One configuration of the forward pass."""

    name: str
    summary: str
    dtype: str = "float16"
    """Weights and activations: float32, float16 or bfloat16."""
    fused_attention: bool | None = True
    """The model's own attention through ``F.scaled_dot_product_attention`` (timm's
    ``fused_attn``); False computes it as written out (softmax(QKᵀ)V), the source's baseline;
    None leaves it as the library ships it (timm: SDPA for ViT, written out for Swin, whose
    49-token masked windows compile faster that way)."""
    compile: str | None = None
    """``torch.compile`` mode, or None for eager."""
    convert: bool = False
    """fasttrain's layers and their forward kernels in place of the library modules."""
    gelu_epilogue: bool = False
    """fc1's bias and GELU in fc1's GEMM (cuBLASLt's epilogue, the tanh GELU), on fasttrain's
    MLPs (with ``convert``)."""
    head_tokens: bool = False
    """The last block computes only the class token, where the model's head reads nothing else
    (a ViT pooling by its class token: ``inference/head_tokens.py``); other models keep every
    token."""
    capture: bool = False
    """fasttrain's own CUDA graph per input shape (``inference/capture.py``), in place of
    compile's ``reduce-overhead`` graphs: a plain replay, without cudagraph trees' host checks at
    every call, and the small memsets cuBLAS and cuDNN issue before their kernels rewritten as
    kernel nodes, which the next kernel follows sooner."""
    quant: str | None = None
    """fp8 or int8 linear layers (the sensitive ones kept in 16-bit), or None."""
    peer: str | None = None
    """What PyTorch-only configuration this is, for the peer rungs; None for fasttrain's."""
    requires: tuple[str, ...] = ()
    """``cuda``, or ``sm89`` (float8 matmuls need Ada/Hopper)."""
    adds: str | None = None
    """The step of ``prepare`` this rung adds to the rung before it (``quant`` or
    ``head_tokens``): where that step changes nothing on a model, the rung would measure the
    one before again, and is skipped with the step's reason."""

    @property
    def cuda_only(self) -> bool:
        """Whether it needs a CUDA GPU: ``requires`` says so, or it replays CUDA graphs
        (compile's ``reduce-overhead`` or fasttrain's ``capture``)."""
        return "cuda" in self.requires or self.capture or self.compile == "reduce-overhead"

    def without_graphs(self) -> "InferRung":
        """This rung with no CUDA graphs of either kind (compiled with compile's default mode
        where it compiles): the kernels its graphs replay, for a profiler to see."""
        return replace(self, compile="default" if self.compile else None, capture=False)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise FasttrainError(f"rung {self.name}: dtype {self.dtype!r} is not one of "
                                 f"{', '.join(DTYPES)}")
        if self.compile not in COMPILE_MODES:
            raise FasttrainError(f"rung {self.name}: compile mode {self.compile!r} is not one of "
                                 f"{', '.join(str(m) for m in COMPILE_MODES)}")
        if self.capture and self.compile == "reduce-overhead":
            raise FasttrainError(f"rung {self.name}: capture records its own CUDA graphs; "
                                 "compile with mode default, not reduce-overhead")
        if self.adds is not None and self.adds not in ADDS:
            raise FasttrainError(f"rung {self.name}: adds {self.adds!r} is not one of "
                                 f"{', '.join(ADDS)}")
        if self.adds is not None and not getattr(self, self.adds):
            raise FasttrainError(f"rung {self.name}: it adds {self.adds}, which it does not "
                                 f"set")
        if self.head_tokens and not self.convert:
            raise FasttrainError(f"rung {self.name}: head_tokens works on fasttrain's blocks; "
                                 "it needs convert")
        if self.quant not in QUANT_MODES:
            raise FasttrainError(f"rung {self.name}: quant {self.quant!r} is not fp8 or int8")


RUNGS: dict[str, InferRung] = {r.name: r for r in (
    InferRung("eager-fp32", "the fp32 model: the accuracy reference", dtype="float32"),
    InferRung("eager-fp16", "fp16, attention written out (the source's PyTorch FP16 baseline)",
              fused_attention=False),
    InferRung("sdpa", "fp16 + fused attention (F.scaled_dot_product_attention)"),
    InferRung("compile", "+ torch.compile", compile="default"),
    InferRung("graphs", "+ CUDA graphs (torch.compile mode reduce-overhead)",
              compile="reduce-overhead", requires=("cuda",)),
    InferRung("kernels", "+ fasttrain's layers and forward kernels (converted in place)",
              compile="reduce-overhead", convert=True, requires=("cuda",)),
    InferRung("gemm-gelu", "+ fc1's bias and GELU in its GEMM (cuBLASLt epilogue, tanh GELU)",
              compile="reduce-overhead", convert=True, gelu_epilogue=True, requires=("cuda",)),
    InferRung("head-token", "+ the last block on the class token alone (the head reads "
              "nothing else; ViTs that pool by it)", compile="reduce-overhead", convert=True,
              gelu_epilogue=True, head_tokens=True, requires=("cuda",), adds="head_tokens"),
    InferRung("captured", "+ fasttrain's own CUDA graphs, cuBLAS's workspace memsets as kernel "
              "nodes", compile="default", convert=True, gelu_epilogue=True, head_tokens=True,
              capture=True, requires=("cuda",)),
    # The quantized rungs build on kernels: fasttrain's fused layers run their linear layers
    # through layers.linear.linear, which takes the 8-bit layers too (BiasApart), so the fused
    # bias + GELU and norm kernels stay around the quantized GEMMs.
    InferRung("fp8", "kernels + float8 linears (e4m3 weights per channel, activations per "
              "token)",
              compile="reduce-overhead", convert=True, quant="fp8", requires=("cuda", "sm89"),
              adds="quant"),
    InferRung("int8", "kernels + INT8 linears (weights per channel, activations per token)",
              compile="reduce-overhead", convert=True, quant="int8", requires=("cuda",),
              adds="quant"),
)}
DEFAULT_RUNGS = tuple(RUNGS)


def nothing_added(rung: InferRung, applied: dict) -> str | None:
    """Why ``rung`` measures nothing new on this model, where the step it adds to the rung
    before it (``adds``; a quantizing rung's quantization, always) changed nothing there (its
    ``applied`` line), else None."""
    step = rung.adds or ("quant" if rung.quant else None)
    if step is None:
        return None
    done = applied.get(step) or {}
    if done.get(ADDS[step]):
        return None
    return done.get("line") or f"{step} changed nothing"


PEERS: dict[str, InferRung] = {r.name: r for r in (
    InferRung("peer-eager-fp16", "the library model in fp16, as it ships",
              peer="fp16 eager"),
    InferRung("peer-compile", "the library model in fp16 under torch.compile(reduce-overhead)",
              compile="reduce-overhead", peer="fp16 torch.compile(reduce-overhead)",
              requires=("cuda",)),
)}
REFERENCE = "eager-fp32"
"""The rung whose logits every other rung is compared against; it always runs first."""


def rungs_named(names: list[str]) -> list[InferRung]:
    """The rungs of ``--rungs`` (``default`` for all), the fp32 reference first."""
    if names in ([], ["default"]):
        names = list(DEFAULT_RUNGS)
    unknown = [n for n in names if n not in RUNGS]
    if unknown:
        raise FasttrainError(f"unknown inference rung {unknown[0]!r}: use "
                             f"{', '.join(RUNGS)} or default")
    return [RUNGS[REFERENCE]] + [RUNGS[n] for n in dict.fromkeys(names) if n != REFERENCE]


@dataclass(frozen=True)
class InferSpec:
    """One inference run of one rung, in a fresh process."""

    workload: str
    size: str
    rung: dict[str, Any]
    """``asdict`` of the :class:`InferRung`."""
    device: str = "cpu"
    batch: int = 64
    """The throughput batch (latency is measured at batch 1)."""
    images: int = 1024
    """Held-out images the accuracy is measured on."""
    iters: int = 50
    """Timed forward calls per measurement (after warm-up)."""
    warmup: int = 10
    data: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    """A ``fasttrain train --save`` folder whose model weights are loaded."""
    workdir: str = "."
    """Where the reference logits and the decoded evaluation images are shared between rungs."""

    def rung_config(self) -> InferRung:
        return InferRung(**{**self.rung, "requires": tuple(self.rung.get("requires", ()))})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

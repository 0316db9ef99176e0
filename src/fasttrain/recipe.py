"""Recipe: every switch of a training run in one frozen, typed, validated dataclass.

Recipes come from code (presets derive from the base with ``replace``), from TOML files, and
from ``--set key=value`` overrides. An impossible combination is a :class:`FasttrainError`
naming the switch — one line, never a traceback.
"""
from __future__ import annotations

import dataclasses
import difflib
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import FasttrainError

PRECISIONS = ("fp32", "tf32", "fp16-mixed", "bf16-mixed", "bf16-true")
ATTENTION = ("math", "flash", "efficient", "cudnn", "auto")
OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine")
CHECKPOINTING = ("none", "full", "selective")
OFFLOAD = ("none", "optimizer", "params")
SHARDING = ("auto", "none", "ddp", "zero1", "zero2", "zero3")
INIT = ("device", "host")
ALLOCATOR = ("default", "expandable")
OPTIMIZER_IMPLS = ("forloop", "foreach", "fused", "triton")
OPTIMIZER_STATES = ("fp32", "bf16")
KERNELS = ("none", "fused")
KERNEL_FAMILIES = ("patch", "loss", "window", "layernorm", "rmsnorm", "gelu", "swiglu", "rope",
                   "groupnorm", "attention", "conv")
"""What ``kernels`` may name besides none | fused (all of them): see techniques/kernels.py."""
FP8 = ("none", "large", "linear")
STREAM_DTYPES = ("auto", "bf16")
EMA_MODES = ("auto", "none", "per-tensor", "foreach", "side-stream")
COMPILE = ("none", "model", "regional")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead")


@dataclass(frozen=True)
class Recipe:
    """Every switch of a run. Field docstrings say what each does and what it costs."""

    precision: str = "fp32"
    """fp32 (TF32 off) | tf32 | fp16-mixed (autocast + GradScaler) | bf16-mixed | bf16-true."""
    attention: str = "math"
    """SDPA backend: math (plain matmul+softmax) | flash | efficient | cudnn | auto (SDPA picks).
    A named fused backend is preferred with math as the last resort; the run reports which ran."""
    optimizer: str = "adamw"
    """adamw (two fp32 moments per weight) | sgd (momentum 0.9: one state tensor, the lean one)."""
    schedule: str = "constant"
    """Learning-rate schedule over the run: constant | cosine (to 0 at the last step). Works
    under cuda_graphs with adamw: the rate is then a device tensor that the schedule writes
    between replays of the captured step."""
    lr_warmup: int = 0
    """Linear warm-up of the learning rate over its first N optimizer steps (lr·1/N, lr·2/N, …
    up to lr), then the schedule over the steps left: constant, or cosine to 0. Like the
    schedule, it works under cuda_graphs with adamw."""
    optimizer_impl: str = "forloop"
    """forloop (one kernel per tensor per op) | foreach (multi-tensor) | fused (PyTorch's fused
    AdamW) | triton (fasttrain's one-launch AdamW with the gradient clipping and the EMA folded
    in: adamw, fp32 weights, CUDA; elsewhere it falls back to fused and says why)."""
    optimizer_state: str = "fp32"
    """AdamW's two moments: fp32 | bf16 (both moments stored in bf16 and rounded
    stochastically, so that their small per-step changes survive in expectation: 8 bytes less
    optimizer traffic and 4 bytes less memory per weight; the weights and their masters stay
    fp32). Needs optimizer_impl=triton. Numerics: each store rounds by up to one bf16 step
    (2⁻⁷ relative), unbiased; in the second moment, which keeps 0.999 of itself a step, the
    noise builds up to ~4% (std) and the update m/√v moves by ~2% of its size (a CPU
    simulation of 6,000 steps; no bias). The parity gate checks the loss."""
    lr: float = 0.0
    """Learning rate (constant); 0 = the workload's reference rate (1e-4; SD 1e-5 as in the
    Hugging Face text-to-image recipe)."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """clip_grad_norm_ max norm; 0 turns clipping off."""
    ema: str = "auto"
    """EMA of the trainable weights: auto (the workload's reference: per-tensor where it keeps an
    EMA, else none) | none | per-tensor | foreach | side-stream (foreach on its own CUDA stream).
    With optimizer_impl=triton any EMA is folded into the optimizer's kernel instead."""
    ema_decay: float = 0.9999
    """EMA decay."""
    workers: int = 0
    """DataLoader worker processes (0 = load in the training process)."""
    pin_memory: bool = False
    """Page-locked host batches, so host→device copies can be asynchronous."""
    non_blocking: bool = False
    """Asynchronous host→device copies (effective with pin_memory)."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    device_prefetch: bool = False
    """Copy the next step's batch to the GPU on a side stream while this step computes."""
    pad_multiple: int = 0
    """Variable-length batches: pad the sequence length up to a multiple of N (0: to the batch's
    longest item), so lengths take at most max/N shapes: fewer recompiles, less allocator churn."""
    gemm_pad: int = 0
    """GEMM-friendly widths: the output width of plain linear layers and of an LM head's
    vocabulary, where it is not a multiple of N, padded up to one for the GEMMs (zero rows of
    the weight added in the forward, the extra outputs sliced off or masked out of the loss):
    0 (off) or a multiple of 8. An odd width (a 50,257-token vocabulary) gives cuBLAS unaligned
    leading dimensions. Numerics: none."""
    compile: str = "none"
    """torch.compile: none | model (whole model) | regional (each repeated block; faster warm-up)."""
    compile_mode: str = "default"
    """torch.compile mode."""
    compile_backend: str = "inductor"
    """torch.compile backend (eager / aot_eager are for debugging and tests)."""
    compile_cache: bool = False
    """Keep torch.compile's results (Inductor kernels, AOTAutograd graphs, autotuning) in one
    file per workload, batch, recipe, torch and GPU under ``$FASTTRAIN_CACHE/compile`` after
    the run, and load it before the next: a later run, on this machine or another with a copy
    of the folder, skips most of the compile warm-up."""
    autotune_reductions: bool = False
    """Inductor autotunes the split size of its mix-order reductions (a norm's backward that
    sums the weight gradients per split in the same kernel, then finishes them with an eager sum
    over the splits): fewer, larger splits; longer warm-up. Needs compile (inductor)."""
    pdl: bool = False
    """Inductor's Triton kernels use programmatic dependent launch (Hopper and newer): each may
    start while the kernel before it finishes and waits on the GPU for its inputs, which hides
    part of the gap between the thousand small kernels of a step. Needs compile (inductor) and
    a GPU of compute capability 9.0 or newer; left off with a warning elsewhere."""
    combo_kernels: bool = False
    """Inductor's combo kernels: kernels that do not depend on each other (a backward's
    bias-gradient sums, small pointwise ops side by side) run as one launch. Needs compile
    (inductor)."""
    cuda_graphs: bool = False
    """Capture the whole training step (forward, backward, clip, optimizer) in one CUDA graph.
    A cosine schedule and an lr_warmup follow the replays with adamw (its rate is on the
    device); sgd keeps the captured rate, so it is refused with either."""
    graph_memset_kernels: bool = False
    """With cuda_graphs: the small memsets that cuBLAS and cuDNN issue before many of their
    kernels (a few bytes of workspace zeroed) become kernel nodes of the captured graph that
    store the same bytes; a kernel after a memset node starts later than one after a kernel.
    Numerics: none."""
    channels_last: bool = False
    """NHWC memory format for convolution workloads."""
    convert: bool = False
    """Swap the public model classes fasttrain recognises (timm's ViT and Swin blocks, attention,
    MLP, patch embedding; transformers' Llama, Mistral and Qwen2 decoder, RMSNorm, MLP, LM head
    loss) for fasttrain layers that compute the same function and carry the fused paths, so
    that ``kernels``, ``stream_dtype`` and ``master_weights`` reach them. Parameters keep their
    names, shapes and dtypes. Numerics: none."""
    stream_dtype: str = "auto"
    """The residual stream of transformer blocks (ViT, Swin, Llama): auto (as precision leaves
    it: fp32 under bf16-mixed) | bf16 (cast once after the embeddings, as Megatron-LM does by
    default: the residual adds and the fused add + norm kernels move half the bytes; the norms'
    statistics stay fp32). Needs bf16-mixed. Numerics: the stream is rounded to bf16 after
    every add."""
    checkpointing: str = "none"
    """Activation checkpointing of the repeated blocks: none | full | selective (keeps matmul
    and attention outputs, recomputes the elementwise ops)."""
    checkpoint_every: int = 1
    """Checkpoint every k-th block only (1 = all)."""
    master_weights: bool = False
    """The optimizer updates fp32 copies of bf16 weights. With bf16-true: of every weight. With
    bf16-mixed (optimizer_impl=triton, one process, accumulation=1): the weights and biases of
    linear and convolution layers, which autocast would cast to bf16 on every step, are stored
    in bf16 and the one-launch AdamW keeps their fp32 masters; the casts of those weights and of
    their gradients disappear (the matmuls see the same bf16 values), gradients stay bf16."""
    offload: str = "none"
    """none | optimizer: optimizer state and fp32 master weights live in pinned CPU memory; the
    update runs on the CPU (ZeRO-Offload style) | params: FSDP2's CPU offload of parameters,
    gradients and optimizer state (zero2/zero3 only)."""
    sharding: str = "auto"
    """Data parallelism across torchrun processes: auto (none on one process, ddp on more) |
    none | ddp | zero1 (DDP + sharded optimizer state) | zero2 (FSDP2, no reshard after forward)
    | zero3 (FSDP2, full resharding)."""
    dist_timeout: float = 600.0
    """Seconds a collective may wait before the run fails naming the missing ranks."""
    init: str = "device"
    """device: weights created on the target device in the target dtype | host: on the CPU in
    fp32, then moved and cast (the usual default, with its extra copies)."""
    kernels: str = "none"
    """fasttrain's fused kernels where a model has a fused path: none | fused (every family) |
    a comma-separated list of families: patch (patch embedding as one GEMM), loss (the
    cross-entropy in one Triton kernel that writes the logits' gradient in the forward: less
    time, +1.4 GiB peak on Llama-1B), window (Swin window attention in Triton, on the unpartitioned
    map), layernorm (the blocks' LayerNorms with the residual add before them: Swin, ViT, SD's
    UNet transformers), rmsnorm (the same for Llama's RMSNorms, the final norm adding the last
    block's MLP branch), gelu (bias + GELU), swiglu (SiLU·up), rope (rotary embedding of q and
    k in one kernel), groupnorm (GroupNorm + SiLU reading channels-last activations in place: SD's UNet and
    VAE), attention (ViT's self-attention in Triton straight from the qkv projection's layout,
    odd lengths padded to 16 not 64), conv (a frozen convolution over few input channels, SD's
    VAE input, in one Triton pass: forward only)."""
    fp8: str = "none"
    """none | large | linear: the linear layers of the trainable repeated blocks multiply in
    float8 (e4m3 forward, e5m2 gradients, per-tensor dynamic scales) — all of them (linear) or
    only those of at least 2²⁴ weights (large: where float8 beats bf16 on an H200, see
    kernels/fp8_linear.py). Needs bf16 precision and, on CUDA, an sm89+ GPU. Heads and
    embeddings stay in bf16."""
    allocator: str = "default"
    """CUDA caching allocator: default | expandable (expandable_segments; set before CUDA starts)."""
    accumulation: int = 1
    """Micro-batches per optimizer step; ``batch`` is split into this many equal parts."""
    batch: int = 0
    """Samples per optimizer step (0 = the workload's default)."""
    seed: int = 0
    """Seed for weights and data order; every rung of a ladder uses the same."""

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Recipe":
        return with_overrides(self, changes)

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def scheduled(self) -> bool:
        """Whether the learning rate moves during the run (a cosine, a warm-up or both)."""
        return self.schedule != "constant" or self.lr_warmup > 0


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise FasttrainError(f"recipe: {name}={value!r} is not one of {', '.join(allowed)}")


def kernel_families(value: str) -> frozenset[str]:
    """The kernel families a ``kernels`` value switches on (none → empty, fused → all)."""
    if value in KERNELS:
        return frozenset(KERNEL_FAMILIES if value == "fused" else ())
    names = [n.strip() for n in value.split(",")]
    bad = [n for n in names if n not in KERNEL_FAMILIES]
    if bad or not names:
        raise FasttrainError(f"recipe: kernels={value!r} is not none, fused or a comma-separated "
                             f"list of {', '.join(KERNEL_FAMILIES)}")
    return frozenset(names)


def _validate_graphs(r: Recipe) -> None:
    """What a whole-step CUDA graph cannot capture, and what needs one."""
    if not r.cuda_graphs:
        if r.graph_memset_kernels:
            raise FasttrainError("recipe: graph_memset_kernels rewrites the captured step's "
                                 "CUDA graph; set cuda_graphs=true")
        return
    if r.offload != "none" or (r.master_weights and r.precision != "bf16-mixed"):
        raise FasttrainError("recipe: cuda_graphs captures a device-only step; turn off "
                             "offload and (unless bf16-mixed) master_weights")
    if r.scheduled and r.optimizer != "adamw":
        what = f"schedule={r.schedule}" if r.schedule != "constant" else \
            f"lr_warmup={r.lr_warmup}"
        raise FasttrainError(f"recipe: cuda_graphs with {what} needs optimizer=adamw, whose "
                             f"learning rate the schedule writes on the device between replays "
                             f"({r.optimizer} keeps the captured rate); use adamw, or a "
                             "constant rate without warm-up")
    if r.precision == "fp16-mixed":
        raise FasttrainError("recipe: cuda_graphs cannot capture fp16-mixed (GradScaler syncs "
                             "with the host); use bf16-mixed")
    if r.accumulation != 1:
        raise FasttrainError("recipe: cuda_graphs captures one micro-batch per step; "
                             "set accumulation=1")
    if r.compile_mode in ("reduce-overhead", "max-autotune"):
        raise FasttrainError(f"recipe: cuda_graphs with compile_mode={r.compile_mode} would "
                             "capture graphs twice; use default or max-autotune-no-cudagraphs")


PYTORCH_ADAMW = MappingProxyType({"optimizer_impl": "fused", "master_weights": False,
                                   "optimizer_state": "fp32"})
"""The switches that hand AdamW to PyTorch's fused one: the one-launch AdamW off, and with it
what only fasttrain's optimizers keep (master weights, bf16 moments). For the places that must
fall back (a device or a user's own optimizer the one-launch AdamW cannot serve)."""


def _validate_optimizer(r: Recipe) -> None:
    _choice("optimizer", r.optimizer, OPTIMIZERS)
    _choice("optimizer_impl", r.optimizer_impl, OPTIMIZER_IMPLS)
    _choice("optimizer_state", r.optimizer_state, OPTIMIZER_STATES)
    if r.optimizer_state != "fp32" and r.optimizer_impl != "triton":
        raise FasttrainError(f"recipe: optimizer_state={r.optimizer_state} keeps AdamW's "
                             f"moments in the one-launch AdamW; set optimizer_impl=triton "
                             f"(not {r.optimizer_impl})")
    if r.optimizer_impl == "triton" and (r.optimizer != "adamw" or r.offload == "optimizer" or (
            r.master_weights and r.precision != "bf16-mixed")):
        raise FasttrainError("recipe: optimizer_impl=triton is an AdamW step over the model's own "
                             "weights on the GPU; it takes optimizer=adamw without "
                             "offload=optimizer, and master_weights only with bf16-mixed")


def _validate_mixed_masters(r: Recipe) -> None:
    """bf16-mixed master weights: the one-launch AdamW steps them, gradients stay bf16."""
    if r.optimizer_impl != "triton":
        raise FasttrainError("recipe: master_weights with bf16-mixed keeps the fp32 masters in "
                             "the one-launch AdamW; set optimizer_impl=triton")
    if r.accumulation != 1:
        raise FasttrainError("recipe: master_weights with bf16-mixed keeps bf16 gradients, which "
                             "accumulation would sum in bf16; set accumulation=1")
    if r.sharding not in ("auto", "none"):
        raise FasttrainError(f"recipe: master_weights with bf16-mixed runs on one process, not "
                             f"with sharding={r.sharding}")


def validate(r: Recipe) -> None:
    """One-line errors for values and combinations that cannot work."""
    _choice("precision", r.precision, PRECISIONS)
    _choice("attention", r.attention, ATTENTION)
    kernel_families(r.kernels)
    _choice("fp8", r.fp8, FP8)
    _choice("stream_dtype", r.stream_dtype, STREAM_DTYPES)
    _validate_bf16_switches(r)
    _validate_optimizer(r)
    _choice("schedule", r.schedule, SCHEDULES)
    _choice("checkpointing", r.checkpointing, CHECKPOINTING)
    _choice("offload", r.offload, OFFLOAD)
    _choice("init", r.init, INIT)
    _choice("allocator", r.allocator, ALLOCATOR)
    if r.checkpoint_every < 1:
        raise FasttrainError(f"recipe: checkpoint_every must be >= 1, got {r.checkpoint_every}")
    if r.master_weights and r.precision not in ("bf16-true", "bf16-mixed"):
        raise FasttrainError(f"recipe: master_weights needs precision=bf16-true or bf16-mixed, "
                             f"not {r.precision}")
    if r.master_weights and r.precision == "bf16-mixed":
        _validate_mixed_masters(r)
    _choice("sharding", r.sharding, SHARDING)
    if r.offload == "params" and r.sharding not in ("zero2", "zero3"):
        raise FasttrainError("recipe: offload=params is FSDP2's CPU offload; use sharding=zero2 "
                             "or zero3")
    if r.sharding in ("zero1", "zero2", "zero3") and r.offload == "optimizer":
        raise FasttrainError(f"recipe: offload=optimizer does not combine with "
                             f"sharding={r.sharding}; use offload=params with zero2/zero3")
    if r.dist_timeout <= 0:
        raise FasttrainError("recipe: dist_timeout must be > 0 seconds")
    if r.offload != "none" and r.precision == "fp16-mixed":
        raise FasttrainError("recipe: offload with fp16-mixed is not supported; use bf16-mixed")
    _choice("ema", r.ema, EMA_MODES)
    _choice("compile", r.compile, COMPILE)
    _choice("compile_mode", r.compile_mode, COMPILE_MODES)
    for switch, what in (("compile_cache", "keeps torch.compile's results"),
                         ("autotune_reductions", "tunes torch.compile's kernels"),
                         ("pdl", "changes how torch.compile's kernels launch"),
                         ("combo_kernels", "changes how torch.compile groups its kernels")):
        if getattr(r, switch) and r.compile == "none":
            raise FasttrainError(f"recipe: {switch} {what}; set compile=model or "
                                 "compile=regional")
    for name in ("workers", "batch", "lr_warmup"):
        if getattr(r, name) < 0:
            raise FasttrainError(f"recipe: {name} must be >= 0, got {getattr(r, name)}")
    if r.accumulation < 1:
        raise FasttrainError(f"recipe: accumulation must be >= 1, got {r.accumulation}")
    if r.batch and r.batch % r.accumulation:
        raise FasttrainError(
            f"recipe: batch={r.batch} is not divisible by accumulation={r.accumulation}")
    for bad, rule in ((r.lr < 0, f"lr must be >= 0 (0: the workload's own), not {r.lr}"),
                      (r.grad_clip < 0, f"grad_clip must be >= 0 (0: off), not {r.grad_clip}"),
                      (not 0.0 <= r.ema_decay < 1.0,
                       f"ema_decay must be in [0, 1), not {r.ema_decay}")):
        if bad:
            raise FasttrainError(f"recipe: {rule}")
    if r.prefetch_factor < 1:
        raise FasttrainError("recipe: prefetch_factor must be >= 1")
    _validate_padding(r)
    _validate_graphs(r)


def _validate_bf16_switches(r: Recipe) -> None:
    """Switches that only exist under a bf16 precision."""
    bf16 = r.precision in ("bf16-mixed", "bf16-true")
    if r.stream_dtype == "bf16" and not bf16:
        raise FasttrainError(f"recipe: stream_dtype=bf16 needs precision=bf16-mixed, "
                             f"not {r.precision}")
    if r.fp8 != "none" and not bf16:
        raise FasttrainError(f"recipe: fp8={r.fp8} needs precision=bf16-mixed or bf16-true "
                             f"(its matmuls return bf16), not {r.precision}")


def _validate_padding(r: Recipe) -> None:
    if r.pad_multiple < 0:
        raise FasttrainError("recipe: pad_multiple must be >= 0 (0 pads to the longest item)")
    if r.gemm_pad < 0 or r.gemm_pad % 8:
        raise FasttrainError(f"recipe: gemm_pad must be 0 (off) or a multiple of 8, "
                             f"not {r.gemm_pad}")


_ON, _OFF = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def switch_value(text: str) -> bool | None:
    """A switch written out: ``true``/``yes``/``on``/``1`` is True, ``false``/``no``/``off``/``0``
    False (any case, spaces around ignored); anything else None."""
    word = text.strip().lower()
    return True if word in _ON else False if word in _OFF else None


def _coerce(name: str, raw: Any, kind: type) -> Any:
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    if not isinstance(raw, str):
        if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        raise FasttrainError(f"recipe: {name} expects {kind.__name__}, got {raw!r}")
    text = raw.strip()
    try:
        if kind is bool:
            if (on := switch_value(text)) is None:
                raise ValueError
            return on
        return kind(text)
    except ValueError:
        raise FasttrainError(f"recipe: {name} expects {kind.__name__}, got {raw!r}") from None


_TYPES = {"str": str, "int": int, "float": float, "bool": bool}


def with_overrides(base: Recipe, changes: dict[str, Any]) -> Recipe:
    """A new recipe with ``changes`` applied (values may be strings, as from ``--set``)."""
    known = {f.name: _TYPES[str(f.type)] for f in fields(Recipe)}
    clean: dict[str, Any] = {}
    for key, raw in changes.items():
        key = key.replace("-", "_")
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            hint = (f"did you mean {near[0]!r}?" if near else
                    "docs/recipe.md lists the switches")
            raise FasttrainError(f"recipe: unknown switch {key!r}: {hint}")
        clean[key] = _coerce(key, raw, known[key])
    return dataclasses.replace(base, **clean)


def parse_sets(items: list[str] | None) -> dict[str, str]:
    """``["precision=bf16-mixed", "workers=4"]`` → dict; one-line error on a malformed item."""
    out: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise FasttrainError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def load_toml(path: str | Path, base: Recipe | None = None) -> Recipe:
    """A recipe from a TOML file: top-level keys, or a ``[recipe]`` table."""
    p = Path(path)
    if not p.is_file():
        raise FasttrainError(f"recipe file {p} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise FasttrainError(f"recipe file {p}: {err}") from None
    data = data.get("recipe", data)
    return with_overrides(base or Recipe(), data)


def to_toml(recipe: Recipe, comment: str = "") -> str:
    """TOML text of the switches that differ from the base recipe."""
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    lines.append("[recipe]")
    default = Recipe()
    for f in fields(Recipe):
        value = getattr(recipe, f.name)
        if value != getattr(default, f.name):
            text = ("true" if value else "false") if isinstance(value, bool) else (
                f'"{value}"' if isinstance(value, str) else repr(value))
            lines.append(f"{f.name} = {text}")
    return "\n".join(lines) + "\n"

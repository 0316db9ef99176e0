"""The fast search: switches tried one at a time on top of the best recipe so far, each kept
only where it gains; its verdict written as a recipe file next to the rows, with a ``kind: fast``
row saying which candidate won and by how much."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import FasttrainError
from ..measure.files import write_atomic
from ..measure.rows import append_row, make_row
from ..recipe import Recipe, kernel_families, to_toml
from ..report.table import on_cpu
from ..techniques import technique_of
from ..workloads.base import Workload
from .rungs import Rung, build_ladder


SEARCHED_KERNELS = ("window", "attention", "patch", "gelu", "layernorm", "rmsnorm", "rope",
                    "loss", "groupnorm", "conv")
"""Kernel families the fast search tries, one rung each, in this order: those whose kernels
beat Inductor's fusion of the plain code in the microbenchmark's CUDA-graph replay
(kernels-micro-activations-rope-norms-20261121-0833: bias + GELU 0.31 vs 0.47 ms on ViT-B,
0.12 vs 0.16 on Swin-B; RoPE 0.056 vs 0.120 ms on Llama-1B; GroupNorm + SiLU on SD's
channels-last VAE activations 0.45 vs 1.55 ms, kernels-micro-groupnorm-20261121-1145), plus
window, patch and loss. SwiGLU is left out: it ties with compile (0.257 vs 0.255 ms), so a rung
for it would measure noise. LayerNorm was left out while its tiled kernels tied with Inductor's
fused norms (kernels-micro-norms-20261121-1352; Swin-B 2,776 against 2,790 img/s,
train-map-window-20261121-1411); with software-pipelined backward loads its add + norm runs
10-19% faster (launch-tune-20261121-1633) and took a whole Swin-B step 1.2% faster (2,878
against 2,843 and 2,847 img/s, train-launch-20261121-1643). ViT's self-attention kernel runs
its layer 18% faster than compiled SDPA (kernels-micro-attention-20261122-0300) and a ViT-B step
2.6% faster (train-attention-vit-20261122-0212). The frozen narrow convolution (SD's VAE input)
runs in 0.209 ms against the compiled gather + GEMM's 0.497 (kernels-micro-conv-20261122-1321)
and took an SD step 0.5% faster (train-conv-sd-20261122-1332). Llama's add + RMSNorm runs the
LayerNorm's kernels without the mean; before their pipelined loads it measured 0.155-0.163 ms
against compiled 0.142 (kernels-micro-norms-20261121-1352); with them, in Llama-1B's fast step
+1.3% (train-llama-items-20261126-0052)."""


def fast_axes(workload: Workload) -> list[tuple[str, str, Any]]:
    """The switches whose gain depends on the model and the device, in the order the ``fast``
    search tries them: (label, recipe field, value tried). The model is built once, on the meta
    device, to see which layers it has."""
    import torch

    from ..layers.conv import frozen_narrow
    from ..techniques.fp8 import fp8_targets
    from ..techniques.gemm_pad import odd_widths
    from ..converters.torch_blocks import is_pre_norm_block
    from ..layers.fused import StreamCarrier, fused_layers

    from .traits import converts, prefers_channels_last

    with torch.device("meta"):
        model = workload.build_model()
    # a pre-norm block of the user's own is recognised only by a check that needs its weights:
    # on the meta device it stays as it is (its norms converted), and the real run decides
    own_blocks = any(is_pre_norm_block(m) for m in model.modules())
    if converts(workload):  # the search starts at the convert rung: it tunes the converted layers
        from ..converters import convert

        convert(model, check=False)
    axes: list[tuple[str, str, Any]] = [("graphs", "cuda_graphs", True)]
    # clipping, AdamW and the EMA in one launch: a memory-bound step, so it pays where the
    # weights are many for the FLOPs (SD's 860 M with an EMA; Llama's optimizer step)
    axes.append(("one-launch optimizer", "optimizer_impl", "triton"))
    # on top of it (only where it was kept), the linear/conv weights in bf16 with fp32 masters
    # in its kernel: no per-step casts of the weights and their gradients (Swin-B +2.1%,
    # SD +3.9%, ViT-B +0.7%: train-master-weights-20261121-1849, -sd-20261121-1907)
    axes.append(("bf16 master weights", "master_weights", True))
    # and (again only on the one-launch AdamW) its two moments in bf16, rounded stochastically:
    # 8 of the 28 bytes a weight in the optimizer step; changes the numerics, so parity decides
    axes.append(("bf16 moments", "optimizer_state", "bf16"))
    # float8 only pays on large layers (kernels-micro-fp8-20261121-0549: slower below 2^24
    # weights); where the model has some, all layers in fp8 are tried next, since compile
    # fuses the casts of the small ones into their neighbours (ladder-llama-base-...-060458).
    # Frozen parts (SD's encoders) are never converted.
    if fp8_targets(workload.regional_blocks(model), "large")[0]:
        axes += [("fp8 large", "fp8", "large"), ("fp8", "fp8", "linear")]
    if "math" in getattr(workload, "attention_candidates", ()):
        axes.append(("math attention", "attention", "math"))
    present = {m.fused_kind for m in fused_layers(model)}
    if any(frozen_narrow(m) for m in model.modules()):
        present.add("conv")  # a frozen narrow convolution: kernels=conv makes it a GemmConv2d
    axes += [(f"kernels {kind}", "kernels", kind) for kind in SEARCHED_KERNELS if kind in present]
    # the residual stream in bf16 (models that carry one: ViT, Swin, Llama), after the norm kernels
    # that have launch settings of their own for a 16-bit stream: ViT-B +3.3% on an H200
    # (train-stream-vit-20261125-0714), Swin-B +2.3% on an H100 (train-stream-swin-20261125-2133),
    # Llama-1B +2.0% on an H200 (train-llama-items-20261126-0052)
    if own_blocks or any(isinstance(m, StreamCarrier) for m in model.modules()):
        axes.append(("bf16 stream", "stream_dtype", "bf16"))
    if odd_widths(model, 8):  # a linear width (a vocabulary) off the multiple of 8 tensor
        axes.append(("GEMM widths padded", "gemm_pad", 64))  # cores want: 64, as nanoGPT's
    if prefers_channels_last(workload):
        axes.append(("no NHWC", "channels_last", False))
    elif any(isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) for m in model.modules()):
        # the norms' backward is where Inductor makes mix-order reductions (Swin: +1.4%,
        # inductor-mix-order-20261121-0855); it costs a longer warm-up, so only where they are
        axes.append(("autotuned reductions", "autotune_reductions", True))
    # how Inductor's kernels launch: the gaps between a step's ~1,250 kernels are ~1 ms of
    # Swin-B's 22 (profile-swin-base-20261121-213447 against its graphed step). Programmatic
    # dependent launch and combo kernels measured +0.9% and +1.0% there in single runs
    # (train-inductor-launch-20261121-2139), both together +0.6% in runs A, B, B, A
    # (train-launch-switches-20261121-2149); on ViT-B -0.5% and +0.3%: the search decides
    axes += [("dependent launch", "pdl", True), ("combo kernels", "combo_kernels", True)]
    # the libraries' small memsets in the captured graph as kernel nodes: SD +0.5% (261 a step,
    # train-graph-memsets-sd-20261125-0045), ViT-B +0.1% (98, -vit-20261125-0050) and, on the
    # bf16 stream, +1.5% (train-switches-vit-20261126-0117); needs graphs
    axes.append(("memsets as kernels", "graph_memset_kernels", True))
    return axes


def fast_start(workload: Workload, base: Recipe) -> tuple[Rung, Recipe]:
    """The fast search's first candidate: the default ladder's recipe up to compile."""
    recipe = dict((r.name, rec) for r, rec in build_ladder(workload, None, base))["compile"]
    return Rung("fast: compile", {}, "fast preset search: the default ladder up to compile"), \
        recipe


def fast_plan(workload: Workload, base: Recipe) -> list[tuple[Rung, Recipe]]:
    """The ladder ``--rungs fast`` starts with: the fp32 parity base and the search's first
    candidate; the search adds a rung per switch as results come in."""
    first = build_ladder(workload, None, base)[0][0]
    return [(first, base.replace(**first.changes)), fast_start(workload, base)]


MIN_GAIN = 0.005
"""How much faster a switch's rung must measure to be kept: run-to-run differences of one
recipe are 0.1–0.3 % (two Llama searches: 70.7 k and 70.5 k tok/s), and a switch that changes
numerics is not worth a tie."""


def _ran_and_passed(row: dict) -> bool:
    return bool(not row.get("error") and not row.get("skipped")
                and (row.get("parity") or {}).get("passed"))


def _gains(row: dict, best: dict | None) -> bool:
    return best is None or row["throughput"] > best["throughput"] * (1 + MIN_GAIN)


def _kept(row: dict, best: dict | None) -> bool:
    """A candidate is kept where it ran, passed parity, changed something (not ``effect:
    none``: a gain would be noise) and gained ``MIN_GAIN`` over ``best``."""
    return _ran_and_passed(row) and row.get("effect") != "none" and _gains(row, best)


class FastSearch:
    """The ``fast`` preset's greedy search. It starts from the default ladder's recipe up to
    compile (every PyTorch technique that always helps), then tries one switch at a time on top
    of the best recipe so far — CUDA graphs, fp8 (large layers, then all), math attention where
    the workload's attention is small enough for compile's fused softmax (Swin's 49-token
    windows), fasttrain's kernels, NHWC off — and keeps a
    switch only when its rung passed parity, changed something and measured at least
    ``MIN_GAIN`` faster; a switch whose technique matched nothing in an earlier trial (the
    row's ``no_effect``) is not measured. One rung per switch instead of every combination:
    n + 1 rungs, not 2ⁿ."""

    def __init__(self, workload: Workload, base: Recipe, processes: int = 1):
        self.start = fast_start(workload, base)
        self.recipe = self.start[1]
        self.parts: dict[str, str] = {}  # switch → label, of the best recipe so far
        self._pending: dict[str, str] = {}  # the same, of the candidate being measured
        self.axes = fast_axes(workload)
        self.best: dict | None = None
        self.skipped: list[tuple[str, str]] = []  # switches not tried, and why
        self.idle: dict[str, str] = {}  # techniques that matched nothing in a trial → why
        if processes > 1:  # a valid recipe that the run refuses on several ranks
            self.skipped += [(label, f"master_weights with bf16-mixed runs on one process, this "
                                     f"ladder on {processes}")
                             for label, key, _ in self.axes if key == "master_weights"]
            self.axes = [a for a in self.axes if a[1] != "master_weights"]

    def drain_skipped(self) -> list[tuple[str, str]]:
        """(label, reason) of the switches passed over since the last call."""
        out, self.skipped = self.skipped, []
        return out

    @staticmethod
    def _name(parts: dict[str, str]) -> str:
        return "fast: " + " + ".join(["compile", *parts.values()])

    def first(self) -> tuple[Rung, Recipe]:
        return self.start

    def next(self, row: dict, recipe: Recipe) -> tuple[Rung, Recipe] | None:
        """Take the result of the last candidate; the next candidate, or None when done."""
        if _kept(row, self.best):
            self.best, self.recipe, self.parts = row, recipe, self._pending
        # what matched nothing in one trial matches nothing in the next: the axes are only those
        # the model has layers for, so a technique idles for the device (no float8 tensor cores:
        # fp8 large, then fp8) or the model (no SDPA call for math attention). Not kernels: a
        # family whose Triton kernel cannot run idles where the next family may not.
        self.idle.update({k: v for k, v in (row.get("no_effect") or {}).items()
                          if k != "kernels"})
        while self.axes:
            label, key, value = self.axes.pop(0)
            if (tech := technique_of(key)) in self.idle:
                self.skipped.append((label, f"{tech} had no effect in an earlier trial: "
                                            f"{self.idle[tech]}"))
                continue
            if key == "kernels" and self.recipe.kernels != "none":  # families add up
                value = ",".join(sorted(kernel_families(self.recipe.kernels) | {value}))
                label = f"kernels {value}"
            try:
                candidate = self.recipe.replace(**{key: value})
            except FasttrainError as err:  # needs a switch the search did not keep (master
                self.skipped.append((label, str(err)))  # weights without the one-launch AdamW)
                continue
            self._pending = {**self.parts, key: label}  # a later value of a switch replaces it
            best = self._name(self.parts).removeprefix("fast: ")
            return (Rung(self._name(self._pending), {key: value},
                         f"fast preset search: the best so far ({best}) with {key}={value}"),
                    candidate)
        return None


def pick_fast(rows: list[dict]) -> dict | None:
    """The search's result from its rows, in the order they ran: the last candidate that ran,
    passed parity, had an effect and gained ``MIN_GAIN`` over the one kept before it (None if
    none ran);
    the repeats that confirm the ratio to the peer are not candidates."""
    best = None
    for row in rows:
        if str(row.get("rung", "")).startswith("fast: ") and not row.get("repeat_of") \
                and _kept(row, best):
            best = row
    return best



def write_fast_preset(workload: str, size: str, rows: list[dict], out: Path,
                      search_s: float | None = None) -> str:
    """Write ``fast-<workload>-<size>.toml`` beside ``out`` and append the ``kind: fast`` row
    to ``out``; its ratio to the peer is the confirmed one where the rows hold it, ``search_s``
    the search's wall time (every rung, the fp32 base and the peer included). Returns the line
    to tell the user."""
    best = pick_fast(rows)
    if best is None:
        return "fast preset: no candidate ran and passed parity; nothing written"
    recipe = Recipe().replace(**best["recipe"])
    path = out.with_name(f"fast-{Path(workload.split(':')[0]).name}-{size}.toml")
    write_atomic(path, to_toml(recipe, comment=f"fasttrain fast preset for {workload} {size}: "
                                              f"{best['rung']}, {best['throughput']:,.1f} "
                                              f"{best['throughput_unit']}"))
    peer = next((r for r in rows if r.get("kind") == "peer" and not r.get("error")), None)
    ratio = next((r for r in rows if r.get("kind") == "ratio" and r.get("ratio")
                  and r["rung"] == best["rung"]), None)
    vs_peer = ratio["ratio"] if ratio else best["throughput"] / peer["throughput"] if peer else None
    append_row(out, make_row("fast", workload, size, best["rung"], recipe=best["recipe"],
                             throughput=best["throughput"],
                             throughput_unit=best["throughput_unit"],
                             speedup=best.get("speedup"), vs_peer=vs_peer,
                             vs_peer_steady=ratio["steady"] if ratio else None,
                             recipe_file=str(path), search_s=search_s, env=best.get("env")))
    gain = f", {best['speedup']:.2f}x fp32" if best.get("speedup") and not on_cpu(best) else ""
    took = "" if search_s is None else (f", found in {search_s:.0f} s" if search_s < 60
                                        else f", found in {search_s / 60:.1f} min")
    return (f"fast preset: {best['rung']} ({best['throughput']:,.1f} {best['throughput_unit']}"
            f"{gain}{took}) → {path} (run it: fasttrain ladder {workload} --recipe {path})")

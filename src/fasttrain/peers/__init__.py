"""Peer rungs: "PyTorch best practice" on the public model code a user would otherwise run.

``run_peer("vit")`` builds timm's ``vit_base_patch16_224`` (random weights, synthetic batch on the
device), trains it with bf16 autocast + fused AdamW + ``torch.compile`` and returns one result
row (``kind: "peer"``, DESIGN.md "Result rows"). The recipes of the TARGETS.md table are
selectable by ``peer_recipe``: ``fp32``, ``tf32``, ``bf16``, ``bf16+compile``. Errors (a missing
package, CUDA OOM, a compile failure) come back as a row with ``error`` set; nothing raises.
The caller adds ``env``.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from ..measure.rows import blank_row

# workload → (module, default peer recipe, what it is)
PEERS: dict[str, tuple[str, str, str]] = {
    "vit": ("timm_peers", "bf16+compile", "timm vit_base_patch16_224 / vit_large_patch16_224"),
    "swin": ("timm_peers", "bf16+compile", "timm swin_base_patch4_window7_224 / swin_large_…"),
    "sd": ("diffusers_peer", "bf16+compile", "diffusers SD v1 UNet + CLIP text encoder + VAE encoder, EMA"),
    "llama": ("hf_llama_peer", "bf16+compile", "transformers LlamaForCausalLM, Llama-3.2-1B shapes, sdpa"),
    # TARGETS.md: Liger's kernels fail under torch.compile, so its peer runs eager.
    "llama-liger": ("hf_llama_peer", "bf16", "the llama peer + Liger-Kernel (rope, rms_norm, swiglu, FLCE)"),
}


def peer_entry(workload: str) -> tuple[str, str, str] | None:
    """(module, default peer recipe, what it is) of a peer workload; ``timm:NAME`` for any timm
    model (the peer of the ``timm:NAME`` workload)."""
    if workload.startswith("timm:") and workload != "timm:":
        return ("timm_peers", "bf16+compile", f"timm {workload[5:]}")
    if workload == "diffusers:sd-v1":
        return ("diffusers_peer", "bf16+compile", "diffusers SD v1 (the diffusers:sd-v1 workload's)")
    if workload == "hf:llama":
        return ("hf_llama_peer", "bf16+compile", "transformers causal LM (the hf:llama workload's)")
    return PEERS.get(workload)


# peer module, or a peer workload that needs more than its module, → (module, package) pairs
# it imports; checked before a ladder starts
PACKAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "timm_peers": (("timm", "timm"),),
    "diffusers_peer": (("diffusers", "diffusers"), ("transformers", "transformers")),
    "hf_llama_peer": (("transformers", "transformers"),),
    "llama-liger": (("liger_kernel.transformers", "liger-kernel"),),
}


def unavailable(workload: str) -> str | None:
    """Why the peer of ``workload`` cannot run here (a package it needs does not import), or
    None; a ladder asks before its first rung rather than after its last."""
    from .loop import PeerUnavailable, require

    entry = peer_entry(workload)
    needs = (PACKAGES.get(entry[0], ()) if entry else ()) + PACKAGES.get(workload, ())
    for module, package in needs:
        try:
            require(module, package)
        except PeerUnavailable as err:
            return str(err)
        except Exception as err:  # installed but broken (timm against another torchvision)
            from ..errors import describe_error

            return f"peer cannot import {module} ({describe_error(err, 160)})"
    return None


def list_peers() -> dict[str, str]:
    """Peer workload names and what each runs."""
    return {name: what for name, (_, _, what) in PEERS.items()}


def _builder(workload: str) -> Callable:
    return importlib.import_module(f"{__name__}.{peer_entry(workload)[0]}").build


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    msg = lines[0] if lines else ""
    name = type(err).__name__
    if name == "PeerUnavailable" or msg.startswith("CUDA out of memory"):
        return msg[:300]
    return f"{name}: {msg}"[:300]


def run_peer(workload: str, size: str = "base", batch: int | None = None, steps: int = 20,
             warmup: int = 5, peer_recipe: str | None = None, device: str | None = None,
             tiny: bool = False, compile_on_cpu: bool = False, seed: int = 0,
             options: dict | None = None) -> dict:
    """Train one peer for ``warmup`` + ``steps`` steps and return its result row (never raises).

    ``peer_recipe`` defaults to the workload's best practice ("bf16+compile"; "bf16" for
    llama-liger). ``tiny`` builds miniatures of the same public classes; on CPU they run eager
    unless ``compile_on_cpu``. ``options``: the workload's options that shape the public model
    (``timm:NAME``: ``drop_path_rate``; ``hf:llama``: ``config``, ``seq_len``).
    """
    import torch

    from .loop import RECIPES, precision_flags

    entry = peer_entry(workload)
    peer_recipe = peer_recipe or (entry[1] if entry else "bf16+compile")
    if size == "tiny":  # the ladder's size name for the miniature
        size, tiny = "base", True
    row = blank_row("peer", workload, "tiny" if tiny else size, f"peer {peer_recipe}",
                    peer=f"{workload} {peer_recipe}", batch=batch, steps=steps, applied={},
                    recipe={"peer_recipe": peer_recipe})
    try:
        if entry is None:
            raise ValueError(f"unknown peer workload {workload!r} (known: {', '.join(PEERS)}, "
                             "timm:NAME, hf:llama)")
        if peer_recipe not in RECIPES:
            raise ValueError(f"unknown peer_recipe {peer_recipe!r} (known: {', '.join(RECIPES)})")
        if steps < 1 or warmup < 0:
            raise ValueError("steps must be ≥ 1 and warmup ≥ 0")
        recipe = RECIPES[peer_recipe]
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        compile_ = recipe.compile and (dev.type != "cpu" or compile_on_cpu)
        torch.manual_seed(seed)
        with precision_flags(recipe):
            build = _builder(workload)
            extra = {"options": options or {}} if workload.startswith(("timm:", "hf:")) else {}
            spec = build(workload, size, batch, dev, tiny, recipe, **extra)
            row.update(peer=f"{spec.public} {peer_recipe}", batch=spec.batch)
            measure_into(row, spec, recipe, dev, steps, warmup, compile_, seed)
    except Exception as err:  # noqa: BLE001 — an error is a row, never an abort
        row["error"] = _one_line(err)
    return row


def measure_into(row: dict, spec, recipe, device, steps: int, warmup: int, compile_: bool,
                 seed: int) -> None:
    """Measure a built peer (``loop.measure``) into its row: what it did in ``recipe``, the
    measured fields beside it."""
    from .loop import measure

    row["recipe"] = _recipe_dict(recipe, spec, device, compile_, warmup, seed)
    measured = measure(spec, recipe, device, steps, warmup, compile_)
    row["recipe"]["compiled_modules"] = measured.pop("compiled")
    row["recipe"]["patched"] = measured.pop("prepared")
    row.update(measured)


def _recipe_dict(recipe, spec, device, compile_: bool, warmup: int, seed: int) -> dict:
    """What the peer did, in words a reader can check against TARGETS.md."""
    from .loop import LR, WEIGHT_DECAY

    out = {
        "peer_recipe": recipe.name,
        "public_code": spec.public,
        "device": str(device),
        "tf32": recipe.tf32,
        "autocast": "bfloat16" if recipe.autocast else None,
        "params_dtype": "float32",
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY,
                      "fused": recipe.fused_adam, "foreach": None if recipe.fused_adam else "default"},
        "clip_grad_norm": 1.0,
        "zero_grad": "set_to_none",
        "compile": compile_,
        "ema": None,
        "warmup_steps": warmup,
        "seed": seed,
        "model": spec.info,
    }
    if recipe.compile and not compile_:
        out["compile_skipped"] = "cpu (pass compile_on_cpu=True to compile)"
    if spec.ema_decay is not None:
        out["ema"] = {"decay": spec.ema_decay, "foreach_lerp": recipe.foreach_ema}
    return out


def peer_job(spec: Any) -> dict:
    """The ladder's peer rung in a fresh process: ``spec`` is the ``run.child.ChildSpec`` of job
    ``fasttrain.peers:peer_job``; the workload's default peer recipe at ``spec.batch``."""
    return run_peer(spec.workload, size=spec.size, batch=spec.batch, steps=spec.steps,
                    warmup=spec.warmup, device=spec.device,
                    peer_recipe=spec.recipe.get("peer_recipe"), options=spec.options)

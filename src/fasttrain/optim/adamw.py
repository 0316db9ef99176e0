"""AdamW over every parameter in one Triton kernel, with gradient clipping and the EMA folded in
(the optimizer; its Triton launches are ``kernels/adamw.py``, the kernels ``kernels/_adamw_step.py``).

What is fused
    ``clip_grad_norm_`` + ``AdamW.step`` + an EMA of the weights is, in PyTorch's fastest form,
    a multi-tensor norm, a multi-tensor multiply of every gradient by the clip factor, the fused
    AdamW kernels and a multi-tensor lerp for the EMA: each a pass over memory, several launches
    each (a multi-tensor launch covers ~100 tensors). Per parameter that is 52 bytes of traffic
    (norm 4; clip 8; AdamW 28; EMA 12). Here the norm is one launch of sums of squares over the
    same table (4 bytes, 2 for a bf16 gradient; 19% less time than PyTorch's multi-tensor norm
    on SD's and Llama's gradients, ``NORM_LAUNCH``), and everything else is one launch that
    reads the gradient, the weight, both moments and the EMA once and writes weight, moments
    and EMA once (36 bytes; 40 a weight in all); the clip factor is applied to the gradient in
    registers, so the gradients are not rewritten.

    The kernel reaches every tensor through a table of where it is (weights and gradients live
    wherever the model and autograd put them), kept as element offsets from the flat state
    buffer so that 16-byte alignment is provable and whole blocks load as vectors; the moments
    and the EMA live in flat buffers the optimizer owns, each tensor's slice aligned to 64
    bytes. The state seen from outside is
    PyTorch's AdamW state (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter), as views into
    those buffers, so ``state_dict``/``load_state_dict`` and DCP checkpoints work as usual.

When it helps
    Models with many parameters relative to their FLOPs: a UNet with an EMA (SD: 860 M fp32
    weights), an LLM's optimizer step. It saves memory passes, not FLOPs, and launches.

CUDA graphs
    The gradients' places are written into a pinned host table that a small kernel copies to
    the device in the step; under capture that kernel is a graph node reading the host table at
    replay, where the graph's gradients have the captured addresses (the table used in a capture
    is kept and never written again; pinned memory is allocated only outside captures). The
    step counts live on the device (``capturable``), so no host sync. The learning rate is a
    device tensor, the parameter group's own "lr", read by the kernel: a scheduler stepped
    between replays writes it in place, so a captured step follows the schedule.

Numerics
    fp32 arithmetic in PyTorch's fused AdamW order (decoupled decay, then moments, then the
    bias-corrected update), clip factor ``min(1, max_norm / (norm + 1e-6))`` as
    ``clip_grad_norm_``, EMA as ``lerp_(w, 1 - decay)``. The norm's squares are summed in
    fp32 per program (``NORM_LAUNCH``) and the programs' sums by ``torch.sum``: a different
    order from ``clip_grad_norm_``'s norm of per-tensor norms, the same norm within a few
    ulps. Bias corrections use ``exp2`` of the step times ``log2(beta)``: within an ulp or two
    of ``pow``.

bf16 weights with fp32 masters
    A bf16 weight (``master_weights`` under bf16-mixed: the weights autocast would cast) gets
    an fp32 master in a flat buffer of the optimizer's, at the tensor's state offsets
    (``state[p]["master"]``, saved and loaded with the rest; a state dict without one resets
    it from the weight). The kernel reads the bf16 gradient, steps the master and writes the
    weight back rounded to nearest even; the EMA follows the master. The clip norm is
    accumulated in fp32 for every gradient dtype.

bf16 moments (``state_dtype=torch.bfloat16``)
    Both moments are kept in bf16 and used in fp32: 8 bytes less traffic and 4 bytes less memory
    per weight (28 → 20 bytes a step for an fp32 weight without EMA; Llama-1B's whole step on an
    H100 lost 3.4 ms, the 8/28 of its ~12 ms optimizer step). Rounded to nearest, bf16's 8
    mantissa bits would lose the second moment's updates: ``0.999·v`` rounds back to ``v``, so
    it could neither decay nor take in a small ``g²``. Each store is therefore rounded
    stochastically (up with the probability of the remainder; noise from a hash of the element's
    state offset and the step, so a run is reproducible), which keeps every update in
    expectation, as in Gopher's and torchao's bf16 optimizers. The weights, their fp32 masters
    and the EMA stay fp32. Numerics: each store rounds by up to one bf16 step (2⁻⁷ relative),
    unbiased. The second moment keeps 0.999 of itself a step, so its noise builds up, to ~4%
    (std) of ``v``, and the update ``m / sqrt(v)`` moves by ~2% of its size (a CPU simulation,
    6,000 steps of Gaussian gradients; the mean of ``v`` unbiased to 1e-4). Noise repeats for
    elements 2³² state slots apart (the hash takes 32 bits of the offset): correlated, still
    unbiased. A state dict holds them in bf16; one saved in fp32 loads into bf16 moments rounded
    to nearest, and the other way round exactly.

Limits
    One parameter group; fp32 weights, or bf16 ones with fp32 masters, on one device; dense
    gradients in the weight's dtype (others are converted first). A parameter without a gradient
    is skipped in that step (its step count does not advance), as in PyTorch; its EMA still
    moves, as a foreach lerp over all weights would (also in a step where no weight has a
    gradient; not in a step that GradScaler skips, which never calls ``step``). Tensors of up to
    2³¹ − 8,193 elements; a tensor whose weight or gradient does not start on 16 bytes (a DDP
    bucket view, say) takes the kernel's scalar path. Parameters missing from a loaded state
    dict keep their state; ``maximize`` and ``amsgrad`` are not supported.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from ..errors import FasttrainError
from ..kernels._triton import runs_on
from ..kernels.adamw import LAUNCH, NORM_LAUNCH, adamw_step, fetch_table, grad_sumsq, norm_programs

__all__ = ["FlatAdamW", "LAUNCH", "NORM_LAUNCH", "runs_on"]

_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_ALIGN = 16  # elements: each tensor's slice of the flat state starts on a 64-byte boundary
_MAX_NUMEL = 2 ** 31 - 1 - 8192  # the kernel's in-tensor offsets are int32


def _chunks(sizes: list[int], block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tensor index, first element) of every block of ``block`` elements: a kernel's
    programs."""
    per = [-(-n // block) for n in sizes]
    tensor = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(per))
    start = torch.cat([torch.arange(k) * block for k in per])
    return tensor.to(torch.int32), start.to(torch.int32)


def dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill exactly ``numel`` consecutive slots of memory, in any order
    (``empty_like`` keeps the strides of exactly such tensors)."""
    return torch.empty_like(t).stride() == t.stride()


def _view(flat: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The slice of ``flat`` at ``offset`` shaped and strided like the dense tensor ``like``
    (element k of ``like``'s memory is element k of the slice)."""
    return flat.as_strided(like.shape, like.stride(), offset)


def _checked(params: Iterable[torch.Tensor], betas: tuple[float, float]) -> list[torch.Tensor]:
    """The parameters as a list, or a one-line error for what FlatAdamW cannot step."""
    params = list(params)
    if params and isinstance(params[0], dict):
        raise FasttrainError("FlatAdamW takes one list of parameters, not parameter groups")
    if not params:
        raise FasttrainError("FlatAdamW got no parameters")
    if not 0.0 < betas[0] < 1.0 or not 0.0 < betas[1] < 1.0:
        raise FasttrainError(f"FlatAdamW: betas must lie in (0, 1), got {betas}")
    if len({id(p) for p in params}) != len(params):
        raise FasttrainError("FlatAdamW got the same parameter twice")
    device = params[0].device
    for p in params:
        if p.dtype not in _WEIGHT_DTYPES or p.device != device or p.is_sparse:
            raise FasttrainError(
                f"FlatAdamW needs dense fp32 or bf16 weights on one device; got {p.dtype} on "
                f"{p.device}")
        if not dense(p):
            raise FasttrainError(f"FlatAdamW needs dense weights; one of shape "
                                 f"{tuple(p.shape)} has strides {p.stride()}")
        if p.numel() > _MAX_NUMEL:
            raise FasttrainError(f"FlatAdamW takes tensors of up to {_MAX_NUMEL:,} elements; "
                                 f"one has {p.numel():,}")
    if not runs_on(params[0]):
        raise FasttrainError("FlatAdamW runs its Triton kernel on CUDA (or on the CPU "
                             "under TRITON_INTERPRET=1)")
    return params


class FlatAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose step is one Triton launch over every parameter,
    with ``max_grad_norm`` clipping inside the step and optionally the EMA (``attach_ema``).

    A drop-in for ``torch.optim.AdamW(params, lr, betas, eps, weight_decay)`` followed by
    ``clip_grad_norm_(params, max_grad_norm)``: call ``step()`` after ``backward()`` and do not
    clip separately (``clips_gradients`` says so to the training loop). ``state_dtype``
    bfloat16 keeps both moments in bf16, rounded stochastically (module docstring)."""

    clips_gradients = True

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, max_grad_norm: float = 0.0,
                 masters: Iterable[torch.Tensor | None] | None = None,
                 state_dtype: torch.dtype = torch.float32):
        params = _checked(params, betas)
        if state_dtype not in _STATE_DTYPES:
            raise FasttrainError(f"FlatAdamW keeps its moments in fp32 or bf16, not "
                                 f"{state_dtype}")
        masters = [None] * len(params) if masters is None else list(masters)
        if len(masters) != len(params):
            raise FasttrainError(f"FlatAdamW got {len(masters)} master weights for "
                                 f"{len(params)} parameters")
        device = params[0].device
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      capturable=True, foreach=False, fused=False,
                                      maximize=False, amsgrad=False, differentiable=False))
        self.params, self.max_grad_norm, self.device = params, float(max_grad_norm), device
        # the learning rate the kernel reads: a device tensor, the group's own "lr", which a
        # scheduler writes in place (so it reaches the replays of a captured step)
        self._lr = torch.tensor(float(lr), dtype=torch.float32, device=device)
        self.param_groups[0]["lr"] = self._lr
        sizes = [p.numel() for p in params]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        self._chunk_tensor, self._chunk_start = (t.to(device)
                                                 for t in _chunks(sizes, LAUNCH["block"]))
        self._norm_tensor, self._norm_start = (
            (self._chunk_tensor, self._chunk_start) if NORM_LAUNCH["block"] == LAUNCH["block"]
            else (t.to(device) for t in _chunks(sizes, NORM_LAUNCH["block"])))  # the same blocks
        self._numel = torch.tensor(sizes, dtype=torch.int32, device=device)
        self._offsets = torch.tensor(offsets, dtype=torch.int64, device=device)
        self._exp_avg = torch.zeros(total, dtype=state_dtype, device=device)
        self._exp_avg_sq = torch.zeros(total, dtype=state_dtype, device=device)
        self._steps = torch.zeros(len(params), dtype=torch.float32, device=device)
        self._slot = offsets
        # bf16 weights: the fp32 master copies the kernel steps, at the state's offsets
        self._half = [p.dtype == torch.bfloat16 for p in params]
        self._master: torch.Tensor | None = None
        self._anchor = torch.empty(8, dtype=torch.bfloat16, device=device)  # bf16 origin
        self._origin = torch.empty(4, dtype=torch.float32, device=device)  # fp32 origin
        if any(self._half):
            self._master = torch.zeros(total, dtype=torch.float32, device=device)
            for i, (p, m) in enumerate(zip(params, masters)):
                if self._half[i]:
                    src = p.detach() if m is None else m.detach()
                    if src.shape != p.shape:
                        raise FasttrainError(f"FlatAdamW: a master weight of shape "
                                             f"{tuple(src.shape)} for a weight of shape "
                                             f"{tuple(p.shape)}")
                    _view(self._master, offsets[i], p).copy_(src)
        self._ema: torch.Tensor | None = None
        self._ema_weight = 0.0
        self._bind_state()
        # where the weights, then the gradients, are, then whether both are 16-byte aligned,
        # then whether the weight is bf16; fetched to the device when they change. Eager steps alternate between two pinned
        # host tables (a table is rewritten only after the fetch that read it has run); a
        # capture takes a spare one, made outside it, and a device table of its own.
        self._table = torch.zeros(4 * len(params), dtype=torch.int64, device=device)
        self._hosts = [self._new_host_table(), self._new_host_table()]
        self._fetched: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._spare: torch.Tensor | None = self._new_host_table()
        self._last: list[int] | None = None
        self._captured: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._partials: torch.Tensor | None = None  # the clip norm's per-program sums
        self._patterns: dict[tuple[bool, ...], torch.Tensor] = {}

    # ------------------------------------------------------------------ state
    def _bind_state(self) -> None:
        for i, p in enumerate(self.params):
            self.state[p] = {"step": self._steps[i],
                             "exp_avg": _view(self._exp_avg, self._slot[i], p),
                             "exp_avg_sq": _view(self._exp_avg_sq, self._slot[i], p)}
            if self._half[i]:
                self.state[p]["master"] = _view(self._master, self._slot[i], p)

    @property
    def masters(self) -> list[torch.Tensor | None]:
        """The fp32 master copy of each bf16 weight (views into the flat buffer), None for an
        fp32 weight (its own master)."""
        return [_view(self._master, off, p) if half else None
                for off, p, half in zip(self._slot, self.params, self._half)]

    def load_state_dict(self, state_dict: dict) -> None:
        # torch's loader casts floating state to the weight's dtype (bf16 for a bf16 weight):
        # take the saved tensors as they are, and let it load the rest (the groups' settings)
        saved = state_dict["state"]
        ids = state_dict["param_groups"][0]["params"] if state_dict["param_groups"] else []
        super().load_state_dict(state_dict)
        self._bind_state()
        self._lr_tensor(self.param_groups[0])  # the loaded rate into the kernel's tensor
        for p, pid in zip(self.params, ids):
            mine, theirs = self.state[p], saved.get(pid, {})
            for key, value in theirs.items():
                if key in mine:
                    mine[key].copy_(value)
            if "master" in mine and "master" not in theirs:
                mine["master"].copy_(p.detach())  # saved without one: the weight as it is

    def attach_ema(self, decay: float) -> list[torch.Tensor]:
        """Keep an fp32 EMA of the weights, updated by the step kernel; its tensors (views)."""
        self._ema = torch.empty_like(self._exp_avg, dtype=torch.float32)
        shadow = [_view(self._ema, off, p) for off, p in zip(self._slot, self.params)]
        for s, p, m in zip(shadow, self.params, self.masters):
            s.copy_(p.detach() if m is None else m)
        self._ema_weight = 1.0 - float(decay)
        return shadow

    # ------------------------------------------------------------------ step
    def _new_host_table(self) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.zeros(4 * len(self.params), dtype=torch.int64, pin_memory=pin)

    def add_param_group(self, param_group: dict) -> None:
        if self.param_groups:
            raise FasttrainError("FlatAdamW steps one parameter group; build another FlatAdamW")
        super().add_param_group(param_group)

    def _grads(self) -> list[torch.Tensor | None]:
        grads = []
        for p in self.params:
            g = p.grad
            if g is not None and g.is_sparse:
                raise FasttrainError("FlatAdamW does not take sparse gradients")
            if g is not None and (g.dtype != p.dtype or g.stride() != p.stride()):
                g = torch.empty_like(p).copy_(g)  # the weight's dtype and memory order
            grads.append(g)
        return grads

    def _upload(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Where the weights and gradients are, into a device table (see the module docstring
        on graphs); the table the kernel reads."""
        origins = (self._origin.data_ptr(), self._anchor.data_ptr())
        p_at, g_at, aligned = [], [], []
        for p, g, half in zip(self.params, grads, self._half):
            origin, size = origins[half], p.element_size()
            p_at.append((p.data_ptr() - origin) // size)
            g_at.append((g.data_ptr() - origin) // size if g is not None else 0)
            vector = 16 // size  # elements in 16 bytes (origins are 16-byte aligned)
            aligned.append(int(p_at[-1] % vector == 0 and g_at[-1] % vector == 0))
        ptrs = p_at + g_at + aligned + [int(h) for h in self._half]
        if self.device.type != "cuda":
            self._table.copy_(torch.tensor(ptrs, dtype=torch.int64))
            return self._table
        if torch.cuda.is_current_stream_capturing():
            # pinned memory cannot be allocated during a capture: the spare was made before
            if self._spare is None:
                raise FasttrainError("FlatAdamW: a second CUDA-graph capture without an eager "
                                     "step in between; run one step eagerly first")
            host, self._spare = self._spare, None
            table = torch.empty_like(self._table)  # the graph's own: replays leave ours alone
            self._fetch(host, table, ptrs)
            self._captured.append((host, table))  # read by every replay: never rewritten
            return table
        if self._spare is None:  # for the next capture
            self._spare = self._new_host_table()
        if ptrs == self._last:
            return self._table
        self._turn ^= 1
        if self._fetched[self._turn] is not None:
            self._fetched[self._turn].synchronize()  # the fetch that read it has run
        self._fetch(self._hosts[self._turn], self._table, ptrs)
        self._fetched[self._turn] = torch.cuda.Event()
        self._fetched[self._turn].record()
        self._last = ptrs
        return self._table

    @staticmethod
    def _fetch(host: torch.Tensor, table: torch.Tensor, ptrs: list[int]) -> None:
        fetch_table(host, table, ptrs)

    def _lr_tensor(self, group: dict) -> torch.Tensor:
        """The device tensor the kernel reads the learning rate from. Where the group's "lr" is
        something else now (a number set by hand, a tensor from a loaded state dict), its value
        is written into that tensor, which becomes the group's "lr" again; under a CUDA-graph
        capture that would fix the rate of every replay, so it is refused there."""
        lr = group["lr"]
        if lr is self._lr:
            return lr
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise FasttrainError("FlatAdamW: the learning rate was replaced while a CUDA graph "
                                 "was being captured; change it in place (a scheduler, or "
                                 "param_groups[0]['lr'].fill_(value)) instead")
        self._lr.fill_(float(lr))
        group["lr"] = self._lr
        return self._lr

    def _increments(self, grads) -> torch.Tensor:
        """1.0 for each weight with a gradient this step, else 0.0 (one device tensor per
        pattern, built once, so a graph capture needs no host copy)."""
        key = tuple(g is not None for g in grads)
        if key not in self._patterns:
            self._patterns[key] = torch.tensor(key, dtype=torch.float32).to(self.device)
        return self._patterns[key]

    def _grad_norm(self, table: torch.Tensor, increments: torch.Tensor) -> torch.Tensor:
        """``clip_grad_norm_``'s total 2-norm of the gradients in ``table``: one launch of fp32
        sums of squares over ``NORM_LAUNCH``'s blocks (bf16 gradients: of their exact values,
        as autocast's fp32 gradients would give), a sum of those partials, its square root."""
        progs = norm_programs(self._norm_tensor.numel())
        if self._partials is None or self._partials.numel() != progs:
            self._partials = torch.empty(progs, dtype=torch.float32, device=self.device)
        grad_sumsq(table, len(self.params), self._norm_tensor, self._norm_start, self._numel,
                   increments, self._partials, self._origin, self._anchor,
                   half=self._master is not None)
        return self._partials.sum().sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = self._grads()
        present = [g for g in grads if g is not None]
        if not present and self._ema is None:
            return loss
        group = self.param_groups[0]
        guard = torch.cuda.device(self.device) if self.device.type == "cuda" else \
            contextlib.nullcontext()
        with guard:
            increments = self._increments(grads)
            self._steps.add_(increments)
            table = self._upload(grads)
            coef = None
            if self.max_grad_norm > 0 and present:
                norm = self._grad_norm(table, increments)
                coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
            adamw_step(table, len(self.params), self._chunk_tensor, self._chunk_start,
                       self._numel, self._offsets, self._steps, increments, self._exp_avg,
                       self._exp_avg_sq, self._ema, coef, self._master, self._origin,
                       self._anchor,
                       self._lr_tensor(group), group["betas"], group["eps"],
                       group["weight_decay"],
                       self._ema_weight)
        return loss

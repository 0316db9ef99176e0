"""A captured CUDA graph's small memsets as kernel nodes.

cuBLAS and cuDNN (convolutions, SDPA) zero a few bytes of their workspace with
``cudaMemsetAsync`` before many of their launches: an SD step captures 265 such memset nodes,
260 of them 4 bytes (profile-sd-base-20261125-000314). On the GPU a kernel that waits on a
memset node starts about 3 µs after the previous kernel, one that waits on a kernel about
0.4 µs after it; the memsets cost the SD step about 1 ms of its 84 in gaps alone.

:func:`rewrite` takes a graph captured with ``keep_graph=True`` before it is instantiated and
replaces every memset node of at most ``max_bytes`` by a kernel node that stores the same bytes
(a one-block PTX kernel, loaded once per device), with the memset's dependencies and dependents:
the same bytes land before the same kernels, only the node type changes. Numerics: none.
Everything goes through the CUDA driver API (``libcuda``) with ``ctypes``; a driver call that
fails raises :class:`GraphRewriteError` with the call's name, and the caller keeps the graph as
captured (a node is only destroyed after its replacement and every edge are in place).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

_MEMSET = 2  # CU_GRAPH_NODE_TYPE_MEMSET
_BLOCK = 256

# One thread per byte: row = i / width_bytes, byte within the row = i % width_bytes; the byte
# stored is that byte of the element (little-endian), as cuMemsetD{8,16,32}2D writes it.
_PTX = rb"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry fasttrain_memset(
    .param .u64 p_dst, .param .u64 p_pitch, .param .u32 p_value, .param .u32 p_esize,
    .param .u64 p_wbytes, .param .u64 p_total)
{
    .reg .pred %p;
    .reg .b32 %r<8>;
    .reg .b64 %rd<10>;
    ld.param.u64 %rd1, [p_dst];
    ld.param.u64 %rd2, [p_pitch];
    ld.param.u32 %r1, [p_value];
    ld.param.u32 %r2, [p_esize];
    ld.param.u64 %rd3, [p_wbytes];
    ld.param.u64 %rd4, [p_total];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mul.wide.u32 %rd5, %r3, %r4;
    cvt.u64.u32 %rd6, %r5;
    add.u64 %rd5, %rd5, %rd6;
    setp.ge.u64 %p, %rd5, %rd4;
    @%p bra DONE;
    div.u64 %rd7, %rd5, %rd3;
    rem.u64 %rd8, %rd5, %rd3;
    mad.lo.u64 %rd9, %rd7, %rd2, %rd1;
    add.u64 %rd9, %rd9, %rd8;
    cvt.u32.u64 %r6, %rd8;
    rem.u32 %r6, %r6, %r2;
    shl.b32 %r6, %r6, 3;
    shr.u32 %r7, %r1, %r6;
    st.global.u8 [%rd9], %r7;
DONE:
    ret;
}
"""


class GraphRewriteError(RuntimeError):
    """A driver call of the rewrite failed; the graph keeps the nodes not yet replaced."""


class _MemsetParams(ctypes.Structure):  # CUDA_MEMSET_NODE_PARAMS
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t),
                ("value", ctypes.c_uint), ("elementSize", ctypes.c_uint),
                ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]

    @property
    def row_bytes(self) -> int:
        return self.width * self.elementSize

    @property
    def bytes(self) -> int:
        return self.row_bytes * self.height


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS (v1)
    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint),
                ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p)]


@dataclass
class RewriteResult:
    rewritten: int  # memset nodes now kernel nodes
    kept: int  # memset nodes larger than max_bytes, left as they were
    nodes: int  # all nodes of the graph before the rewrite


_lib: ctypes.CDLL | None = None
_functions: dict[int, ctypes.c_void_p] = {}  # device index -> the loaded kernel (kept loaded)


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        try:
            _lib = ctypes.CDLL("libcuda.so.1")
        except OSError as err:
            raise GraphRewriteError(f"the CUDA driver library libcuda.so.1 did not load ({err})")
    return _lib


def _call(name: str, *args) -> None:
    rc = getattr(_driver(), name)(*args)
    if rc != 0:
        raise GraphRewriteError(f"{name} failed with CUresult {rc}")


def _function() -> ctypes.c_void_p:
    """The memset kernel, loaded into the current device's context once (the driver first: it
    names what is missing before any CUDA call)."""
    _driver()
    dev = torch.cuda.current_device()
    if dev not in _functions:
        module, func = ctypes.c_void_p(), ctypes.c_void_p()
        _call("cuModuleLoadData", ctypes.byref(module), ctypes.c_char_p(_PTX + b"\0"))
        _call("cuModuleGetFunction", ctypes.byref(func), module, b"fasttrain_memset")
        _functions[dev] = func
    return _functions[dev]


def _nodes(name: str, *lead) -> list[ctypes.c_void_p]:
    """A node list from one of the driver's (…, array, count) queries."""
    count = ctypes.c_size_t(0)
    _call(name, *lead, None, ctypes.byref(count))
    if not count.value:
        return []
    arr = (ctypes.c_void_p * count.value)()
    _call(name, *lead, arr, ctypes.byref(count))
    return [ctypes.c_void_p(arr[i]) for i in range(count.value)]


def _array(nodes: list[ctypes.c_void_p]):
    return (ctypes.c_void_p * max(len(nodes), 1))(*[n.value for n in nodes])


def _replace(graph: ctypes.c_void_p, node: ctypes.c_void_p, p: _MemsetParams,
             func: ctypes.c_void_p) -> None:
    """One memset node → a kernel node with the same edges."""
    deps = _nodes("cuGraphNodeGetDependencies", node)
    outs = _nodes("cuGraphNodeGetDependentNodes", node)
    total = p.bytes
    args = [ctypes.c_uint64(p.dst), ctypes.c_uint64(p.pitch), ctypes.c_uint32(p.value),
            ctypes.c_uint32(p.elementSize), ctypes.c_uint64(p.row_bytes), ctypes.c_uint64(total)]
    ptrs = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p)
                                           for a in args])
    kp = _KernelParams(func=func, gridDimX=max(1, -(-total // _BLOCK)), gridDimY=1, gridDimZ=1,
                       blockDimX=_BLOCK, blockDimY=1, blockDimZ=1, sharedMemBytes=0,
                       kernelParams=ctypes.cast(ptrs, ctypes.c_void_p), extra=None)
    new = ctypes.c_void_p()
    _call("cuGraphAddKernelNode", ctypes.byref(new), graph, _array(deps),
          ctypes.c_size_t(len(deps)), ctypes.byref(kp))
    if outs:
        try:
            _call("cuGraphAddDependencies", graph, _array([new] * len(outs)), _array(outs),
                  ctypes.c_size_t(len(outs)))
        except GraphRewriteError:  # unordered against the kernels after it: never leave it
            _driver().cuGraphDestroyNode(new)
            raise
    # Should this fail, memset and kernel both store the same bytes before the same kernels.
    _call("cuGraphDestroyNode", node)


def _memset_params(node: ctypes.c_void_p) -> _MemsetParams | None:
    """The node's memset parameters, or None for a node of another type."""
    kind = ctypes.c_int(-1)
    _call("cuGraphNodeGetType", node, ctypes.byref(kind))
    if kind.value != _MEMSET:
        return None
    p = _MemsetParams()
    _call("cuGraphMemsetNodeGetParams", node, ctypes.byref(p))
    return p


def memsets(graph: torch.cuda.CUDAGraph) -> list[int]:
    """Bytes of each memset node of ``graph`` (captured with ``keep_graph=True``)."""
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    params = map(_memset_params, _nodes("cuGraphGetNodes", raw))
    return [p.bytes for p in params if p is not None]


def rewrite(graph: torch.cuda.CUDAGraph, max_bytes: int = 4096) -> RewriteResult:
    """Replace the memset nodes of at most ``max_bytes`` of ``graph`` (captured with
    ``keep_graph=True``, instantiated afterwards) by kernel nodes."""
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    func = _function()
    nodes = _nodes("cuGraphGetNodes", raw)
    done = kept = 0
    for node in nodes:
        p = _memset_params(node)
        if p is None:
            continue
        if p.bytes > max_bytes or p.elementSize not in (1, 2, 4):
            kept += 1
            continue
        _replace(raw, node, p, func)
        done += 1
    return RewriteResult(rewritten=done, kept=kept, nodes=len(nodes))


def rewrite_then_instantiate(graph: torch.cuda.CUDAGraph) -> str:
    """Rewrite ``graph``'s small memsets (captured with ``keep_graph=True``), instantiate it, and
    say what the rewrite did; a driver call that fails leaves the nodes not yet replaced as
    memsets, and the line says where it stopped."""
    try:
        r = rewrite(graph)
        note = (f"no memsets among the graph's {r.nodes} nodes" if not r.rewritten + r.kept else
                f"{r.rewritten} of the graph's {r.nodes} nodes were memsets, now kernels"
                + (f"; {r.kept} larger memsets kept" if r.kept else ""))
    except GraphRewriteError as err:
        note = f"rewrite stopped ({err}); the rest of the graph as captured"
    graph.instantiate()
    return note

"""The inference path: the same model, forward only.

An inference ladder (16-bit, fused attention, compile, CUDA graphs, fasttrain's forward-only
kernels, fp8 and INT8), each rung in a fresh process, whose rows carry batch-1 latency,
throughput, peak memory and the accuracy against the fp32 model; the fastest passing rung
exports as a package that loads without fasttrain.
"""

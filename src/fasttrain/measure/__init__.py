"""The measurement floor: what every command's numbers are made of.

Result rows (their kinds and keys, one schema) and how they are written (atomically, one line
at a time), the phase timer, steadiness of repeated runs, loss parity, model FLOPs and the
environment a row was measured in. It imports nothing of fasttrain's upper floors, so every
tool above it (train, ladder, fit, profile, peers, scaling) builds its rows the same way.
"""

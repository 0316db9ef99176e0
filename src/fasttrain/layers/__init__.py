"""Shared building blocks. Fused kernels swap in here, behind recipe switches, in one place."""

"""What a user's model is made of, for the rungs it gets: a ladder offers channels-last to a
convolution network and a convert rung to a model with classes fasttrain converts. Registered
and public workloads say so themselves; a ``SimpleWorkload`` is looked at: its model is built
once on the meta device (no memory, no weights) and its modules counted."""
from __future__ import annotations

import torch

from ..workloads.base import SimpleWorkload, Workload


def _traits(workload: SimpleWorkload) -> tuple[bool, bool]:
    """(convolution network, has convertible classes), looked at once per workload object."""
    if "_traits" not in vars(workload):
        vars(workload)["_traits"] = _look(workload)
    return vars(workload)["_traits"]


def _look(workload: SimpleWorkload) -> tuple[bool, bool]:
    from ..converters import convertible
    from ..layers.conv import conv_network

    try:
        with torch.device("meta"):
            model = workload.build_model()
    except Exception:  # noqa: BLE001 — a model that cannot be built on meta gets the plain rungs
        return False, False
    return conv_network(model), convertible(model)


def prefers_channels_last(workload: Workload) -> bool:
    if isinstance(workload, SimpleWorkload):
        return _traits(workload)[0]
    return bool(getattr(workload, "prefers_channels_last", False))


def converts(workload: Workload) -> bool:
    if isinstance(workload, SimpleWorkload):
        return _traits(workload)[1]
    return bool(workload.converts)

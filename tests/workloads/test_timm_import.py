"""What a timm workload says when timm, or what timm imports, is missing."""
import sys

import pytest

from fasttrain.errors import FasttrainError
from fasttrain.workloads import load_workload


def test_timm_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(FasttrainError, match=r"need timm \(not installed: pip install timm\)$"):
        load_workload("timm:vit_base_patch16_224", "tiny")


def test_timm_without_torchvision_names_torchvision(timm_without_torchvision):
    with pytest.raises(FasttrainError, match=r"need timm, which needs torchvision \(not "
                                             r"installed: pip install torchvision\)$"):
        load_workload("timm:vit_base_patch16_224", "tiny")

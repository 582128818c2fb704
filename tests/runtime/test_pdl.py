"""Programmatic dependent launch (afd.kernels.pdl): off unless AFD_PDL is set, never on a CPU or before Hopper;
where on, a launch gets both the kernel's GDC constant and Triton's launch_pdl."""

import pytest
import torch

from afd.kernels import pdl


@pytest.fixture(autouse=True)
def fresh():
    pdl.enabled.cache_clear()
    yield
    pdl.enabled.cache_clear()


@pytest.mark.parametrize("setting, capability, want", [
    (None, (9, 0), {}), ("false", (9, 0), {}), ("true", (8, 0), {}),
    ("true", (9, 0), {"GDC": 2, "launch_pdl": True}), ("1", (10, 0), {"GDC": 2, "launch_pdl": True})])
def test_only_a_hopper_or_later_gpu_with_the_setting_on_launches_dependently(monkeypatch, setting, capability, want):
    if setting is None:
        monkeypatch.delenv("AFD_PDL", raising=False)
    else:
        monkeypatch.setenv("AFD_PDL", setting)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    assert pdl.launch_options(torch.device("cuda", 0)) == want


def test_a_gemm_waits_but_does_not_release_the_next_kernel_early(monkeypatch):
    monkeypatch.setenv("AFD_PDL", "true")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    assert pdl.launch_options(torch.device("cuda", 0), release_early=False) == {"GDC": 1, "launch_pdl": True}


def test_a_cpu_tensor_never_does(monkeypatch):
    monkeypatch.setenv("AFD_PDL", "true")
    assert pdl.launch_options(torch.device("cpu")) == {}


def test_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("AFD_PDL", "sometimes")
    with pytest.raises(Exception, match="AFD_PDL"):
        pdl.launch_options(torch.device("cuda", 0))

"""Triton kernels compiled while serving are logged and counted (`afd.kernels.compile_watch`); warm-up's are not."""

import logging

import pytest
from prometheus_client import CollectorRegistry

from afd.config import AFDConfig
from afd.kernels.compile_watch import CompileWatch, describe
from afd.metrics.wiring import export_kernel_compiles

triton = pytest.importorskip("triton")
knobs = pytest.importorskip("triton.knobs")


@pytest.fixture
def hook_slot():
    """Triton's process-wide cache-miss hook, put back as it was after the test."""
    before = knobs.runtime.jit_cache_hook
    yield knobs.runtime
    knobs.runtime.jit_cache_hook = before


def call_hook(runtime, name="_gate_up_kernel"):
    """What Triton's JITFunction passes its cache hook on a new specialization (keyword arguments)."""
    return runtime.jit_cache_hook(key="k", repr=f"{name}[num_warps=4](x: *bf16, n: i32)", fn=None,
                                  compile={}, is_manual_warmup=False, already_compiled=False)


def compiles_metric(registry):
    return registry.get_sample_value("afd_kernel_compiles_total", {"role": "monolithic", "rank": "0"})


def test_warm_up_compiles_are_counted_apart_and_serving_ones_are_logged_and_exported(hook_slot, caplog):
    watch, registry = CompileWatch(), CollectorRegistry()
    assert watch.install()
    export_kernel_compiles(registry, AFDConfig(role="monolithic", model="m").group, watch)
    call_hook(hook_slot)
    call_hook(hook_slot, "_down_kernel")
    assert watch.warmup_compiles == 2 and watch.serving_compiles == [] and compiles_metric(registry) == 0
    with caplog.at_level(logging.INFO, logger="afd.kernels.compile_watch"):
        watch.set_serving()
        call_hook(hook_slot, "_decode_kernel")
    assert watch.serving_compiles == ["_decode_kernel[num_warps=4](x: *bf16, n: i32)"]
    assert compiles_metric(registry) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "_decode_kernel[num_warps=4](x: *bf16, n: i32)" in warnings[0]
    assert any("warm-up compiled 2 Triton kernel specializations" in r.getMessage() for r in caplog.records)


def test_a_step_marked_warm_up_puts_compiles_back_in_the_warm_up_count(hook_slot):
    """The FFN rank says before each step whether it serves: a later warm-up (a peer's capture) is not serving."""
    watch = CompileWatch()
    watch.install()
    watch.set_serving(True)
    call_hook(hook_slot)
    watch.set_serving(False)
    call_hook(hook_slot)
    assert len(watch.serving_compiles) == 1 and watch.warmup_compiles == 1


def test_a_hook_set_before_is_still_called_and_its_answer_kept(hook_slot):
    seen = []

    def earlier(**kwargs):
        seen.append(kwargs["repr"])
        return True  # Triton: skip the compile

    hook_slot.jit_cache_hook = earlier
    watch = CompileWatch()
    assert watch.install() and watch.install()  # a second install does not hook twice
    assert call_hook(hook_slot) is True
    assert len(seen) == 1 and watch.warmup_compiles == 1


def test_the_description_falls_back_to_the_function_name():
    class Info:
        name = "_routing_kernel"

    compiled = {"signature": {"q_ptr": "*bf16", "lens_ptr": "*i32", "heads": "i32", "LATENT": "constexpr"},
                "configs": [{(0,): [["tt.divisibility", 16]]}], "constants": {(3,): 512}}
    assert describe({"fn": Info(), "compile": compiled, "repr": "ignored"}) == \
        "_routing_kernel(q_ptr: *bf16 %16, lens_ptr: *i32, heads: i32, LATENT=512)"  # lens_ptr: not 16-byte aligned
    assert describe({"repr": "k[num_warps=8]()"}) == "k[num_warps=8]()"
    assert describe({"fn": Info()}) == "_routing_kernel"
    assert describe({}) == "an unnamed kernel"

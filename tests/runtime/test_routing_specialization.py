"""The routing kernel takes the token count unspecialized, read off the compiled function (no GPU needed)."""

import pytest

triton = pytest.importorskip("triton")


def test_the_token_count_is_not_specialized():
    """A decode batch's token count changes step to step: compiled apart (1, multiples of 16) it would compile
    mid-serving (issue 33), so the routing kernel takes it unspecialized."""
    from afd.kernels import routing

    if not isinstance(routing._select_kernel, triton.runtime.jit.JITFunction):
        pytest.skip("the interpreter does not specialize")
    assert "num_tokens" in routing._select_kernel.do_not_specialize

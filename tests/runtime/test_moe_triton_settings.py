"""The Triton MoE equals the per-expert reference under every kind of kernel setting.

On a GPU the kernels run there in bf16. Without one they run in Triton's CPU interpreter
when it is on (TRITON_INTERPRET=1 before Triton is imported; Triton 3.7 — 3.6's cannot run
the alignment's `tl.range` loops) in float16: the interpreter's bf16 `tl.dot` is wrong.
Otherwise these tests skip.
"""

import pytest
import torch

from tests.kernel_device import KERNEL_DTYPES, NO_KERNEL_DEVICE, LaunchRecorder, kernel_device

DEVICE = kernel_device()
DTYPE = KERNEL_DTYPES.get(DEVICE)
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_KERNEL_DEVICE)

if DEVICE is not None:  # a kernel's helpers resolve through its module's globals
    import triton
    import triton.language as tl

    from afd.kernels.moe_tiles import tile_and_col

    @triton.jit
    def order_kernel(out_ptr, num_tiles, num_cols, group_m):
        """Writes each program's (tile, column block)."""
        tile, col = tile_and_col(tl.program_id(0), num_tiles, num_cols, group_m)
        tl.store(out_ptr + tl.program_id(0) * 2 + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, tile, col))


def kernel(block_n=32, block_k=32, **new_keys):
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4, "num_stages": 3, **new_keys}


SETTINGS = {  # id → a table entry; the new keys: a kernel's own BLOCK_M, GROUP_M, TMA, PERSISTENT, GATHER,
    # ONE_DOT and HALVES (gate_up)
    "old-entry": {"BLOCK_M": 16, "gate_up": kernel(), "down": kernel()},
    "grouped-tma-down": {"BLOCK_M": 32, "gate_up": kernel(BLOCK_M=16, GROUP_M=2),
                         "down": kernel(64, BLOCK_M=32, GROUP_M=0, TMA=True)},
    "tma-gate-up-small-down-tiles": {"BLOCK_M": 64, "gate_up": kernel(16, 64, GROUP_M=1, TMA=True),
                                     "down": kernel(block_k=16, BLOCK_M=16, GROUP_M=3)},
    "all-tma-half-tiles": {"BLOCK_M": 32, "gate_up": kernel(BLOCK_M=16, GROUP_M=5, TMA=True),
                           "down": kernel(BLOCK_M=16, GROUP_M=2, TMA=True)},
    "gather-tma-half-tiles": {"BLOCK_M": 32, "gate_up": kernel(BLOCK_M=16, GROUP_M=2, TMA=True, GATHER=True),
                              "down": kernel(64, TMA=True)},
    "gather-pointers": {"BLOCK_M": 64, "gate_up": kernel(16, 64, GROUP_M=1, GATHER=True),
                        "down": kernel(block_k=16, BLOCK_M=16, GROUP_M=3)},
    "gather-tma-layout-tiles": {"BLOCK_M": 16, "gate_up": kernel(64, 16, TMA=True, GATHER=True), "down": kernel()},
    "persistent-pointers": {"BLOCK_M": 16, "gate_up": kernel(PERSISTENT=1), "down": kernel(PERSISTENT=1, GROUP_M=2)},
    "persistent-gather-tma-half-tiles": {"BLOCK_M": 32,
                                         "gate_up": kernel(BLOCK_M=16, TMA=True, GATHER=True, PERSISTENT=1),
                                         "down": kernel(64, BLOCK_M=16, TMA=True, PERSISTENT=2, GROUP_M=3)},
    "one-dot-half-tiles": {"BLOCK_M": 32, "gate_up": kernel(BLOCK_M=16, GROUP_M=2, TMA=True, ONE_DOT=True),
                           "down": kernel(64, TMA=True)},
    "one-dot-gather-persistent": {"BLOCK_M": 16, "gate_up": kernel(TMA=True, GATHER=True, ONE_DOT=True, PERSISTENT=1),
                                  "down": kernel()},
    "halves-pointers-half-tiles": {"BLOCK_M": 32, "gate_up": kernel(BLOCK_M=16, GROUP_M=2, HALVES=True),
                                   "down": kernel(64, BLOCK_M=16, TMA=True)},  # (a 32-row down reads act rows
    # that no half tile wrote: uninitialised, finite or not, in padding rows it never stores)
    "halves-tma-gather-persistent": {"BLOCK_M": 16, "gate_up": kernel(64, TMA=True, GATHER=True, HALVES=True,
                                                                      PERSISTENT=1, MAX_REGS=168),
                                     "down": kernel(MAX_REGS=128)},
}


@pytest.mark.parametrize("tokens", [1, 37, 130])
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_triton_moe_equals_the_reference_under_each_setting(name, tokens, monkeypatch):
    from afd.kernels import moe
    from afd.kernels.moe import add_shared
    from afd.models.layers import Experts

    routed, num_shared, top_k, hidden, inter = 8, 2, 3, 64, 48  # inter: not a multiple of BLOCK_N or BLOCK_K
    monkeypatch.setattr(moe, "device_table", lambda *args: {1: SETTINGS[name]})
    monkeypatch.setenv("AFD_MOE_SMALL_TOKENS", "0")  # one token too through the aligned path these settings shape
    torch.manual_seed(tokens)
    experts = Experts(routed + num_shared, hidden, inter).requires_grad_(False).double()
    experts.gate_up.normal_(0, 0.1)
    experts.down.normal_(0, 0.1)
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    weights, ids = torch.rand(tokens, routed, dtype=torch.float64).topk(top_k, dim=-1)
    reference = experts(x, *add_shared(weights, ids, routed, num_shared))  # float64, one matmul per expert

    def on_device(tensor):
        return tensor.to(DEVICE, DTYPE)

    out = moe.experts_triton(on_device(x), on_device(weights), ids.to(DEVICE), on_device(experts.gate_up),
                             on_device(experts.down), num_shared)
    assert float((out.double().cpu() - reference).norm() / reference.norm()) < 1e-2


def test_a_kernel_tile_that_does_not_divide_the_layouts_is_refused():
    from afd.kernels.moe_launch import kernel_settings

    assert kernel_settings(kernel(), 64) == {**kernel(), "BLOCK_M": 64, "GROUP_M": 0, "TMA": False, "GATHER": False,
                                             "ONE_DOT": False, "HALVES": False, "PERSISTENT": 0,
                                             "MAX_REGS": 0}
    with pytest.raises(ValueError, match="divide the layout's BLOCK_M 64"):
        kernel_settings(kernel(BLOCK_M=48), 64)
    with pytest.raises(ValueError, match="PERSISTENT -1 must be 0"):
        kernel_settings(kernel(PERSISTENT=-1), 64)
    with pytest.raises(ValueError, match="ONE_DOT .* needs TMA on"):
        kernel_settings(kernel(ONE_DOT=True), 64)
    with pytest.raises(ValueError, match="HALVES .* BLOCK_N 16 must be a multiple of 32, and ONE_DOT off"):
        kernel_settings(kernel(16, HALVES=True), 64)
    with pytest.raises(ValueError, match="HALVES .* ONE_DOT off"):
        kernel_settings(kernel(TMA=True, ONE_DOT=True, HALVES=True), 64)
    with pytest.raises(ValueError, match="MAX_REGS 300 must be 0"):
        kernel_settings(kernel(MAX_REGS=300), 64)
    with pytest.raises(ValueError, match="FP8 gate_up with HALVES needs BLOCK_N 128"):
        kernel_settings(kernel(256, 128, HALVES=True), 64, fp8=True, kernel="gate_up")


@pytest.mark.parametrize("tokens", [1, 37, 130])
def test_the_layout_counts_the_tiles_with_a_real_row(tokens):
    """A persistent kernel loops over `used_tiles` tiles: exactly those with a real row, which come first."""
    from afd.kernels import moe_align

    routed, num_shared, top_k, layout_m = 8, 2, 3, 32
    torch.manual_seed(tokens)
    ids = torch.rand(tokens, routed).topk(top_k, dim=-1).indices.to(DEVICE)
    pairs, tile_expert, used_tiles = moe_align.align(ids, num_shared, routed + num_shared, layout_m)
    has_real = (pairs < tokens * (top_k + num_shared)).view(-1, layout_m).any(dim=1)
    used = int(used_tiles.item())
    assert used == int(has_real.sum()) and bool(has_real[:used].all())
    assert bool((tile_expert[:used] >= 0).all()) and bool((tile_expert[used:] == -1).all())


@pytest.mark.parametrize("layout_m", [16, 64])
@pytest.mark.parametrize("tokens", [37, 1000])
def test_the_layout_holds_every_pair_once_in_tiles_of_its_expert(tokens, layout_m):
    """Past 1,024 rows the offsets kernel runs as several programs; together they must still mark every
    tile's expert and every padding row."""
    from afd.kernels import moe_align

    routed, num_shared, top_k = 8, 2, 3
    num_pairs = tokens * (top_k + num_shared)
    torch.manual_seed(tokens)
    ids = torch.rand(tokens, routed).topk(top_k, dim=-1).indices
    layout = moe_align.align(ids.to(DEVICE), num_shared, routed + num_shared, layout_m)
    pairs, tile_expert = layout.pairs.cpu().long(), layout.tile_expert.cpu().long()
    assert pairs.shape[0] > 1024 or tokens == 37
    real = pairs < num_pairs
    assert sorted(pairs[real].tolist()) == list(range(num_pairs))
    assert bool((pairs[~real] == num_pairs).all())
    expert_of_pair = torch.cat((ids, torch.arange(routed, routed + num_shared).expand(tokens, -1)), 1).reshape(-1)
    row_tile = torch.arange(pairs.shape[0]) // layout_m
    assert torch.equal(tile_expert[row_tile[real]], expert_of_pair[pairs[real]])


@pytest.mark.parametrize("tokens", [1, 37, 300, 1000])
def test_the_one_program_layout_equals_the_four_launch_layout(tokens, monkeypatch):
    """A decode step's alignment runs as one program (issue 33): the same tiles, experts, tile count and pairs of
    each expert as the four launches lay out (the order inside an expert's run follows atomics in both)."""
    from afd.kernels import moe_align

    routed, num_shared, top_k, layout_m = 8, 2, 3, 16
    torch.manual_seed(tokens)
    ids = torch.rand(tokens, routed).topk(top_k, dim=-1).indices.to(DEVICE)
    layouts = []
    for one_program in (8192, 0):  # every case as one program, then as four launches
        monkeypatch.setattr(moe_align, "ONE_PROGRAM_PAIRS", one_program)
        layouts.append(moe_align.align(ids, num_shared, routed + num_shared, layout_m))
    (one, four), num_pairs = layouts, tokens * (top_k + num_shared)
    assert torch.equal(one.tile_expert.cpu(), four.tile_expert.cpu())
    assert int(one.used_tiles.item()) == int(four.used_tiles.item())
    row_expert = one.tile_expert.cpu().repeat_interleave(layout_m)
    for expert in range(routed + num_shared):
        mine = row_expert == expert
        assert sorted(one.pairs.cpu()[mine].tolist()) == sorted(four.pairs.cpu()[mine].tolist())
    assert bool((one.pairs.cpu()[row_expert < 0] == num_pairs).all())


@pytest.mark.parametrize("dtype", ["input", "float32"])
@pytest.mark.parametrize("tokens, hidden", [(1, 64), (37, 1100)])
def test_the_slot_sum_adds_each_tokens_rows_in_float32_in_slot_order(tokens, hidden, dtype):
    from afd.kernels import moe_rows

    slots = 5
    torch.manual_seed(tokens)
    rows = torch.randn(tokens * slots, hidden).to(DEVICE, DTYPE)
    out_dtype = DTYPE if dtype == "input" else torch.float32
    got = moe_rows.sum_slots(rows, slots, out_dtype)
    per_slot = rows.view(tokens, slots, hidden).float()
    want = per_slot[:, 0]
    for slot in range(1, slots):
        want = want + per_slot[:, slot]
    assert got.dtype == out_dtype and torch.equal(got, want.to(out_dtype))


@pytest.mark.parametrize("routed_slots", [0, 3])
def test_the_slot_sum_adds_the_shared_rows_kept_apart_in_float32_last(routed_slots):
    """Shared experts' rows come apart, in float32 ([T·S, H]), and are added after the routed ones, unrounded."""
    from afd.kernels import moe_rows

    tokens, hidden, shared = 5, 300, 2
    torch.manual_seed(routed_slots)
    rows = torch.randn(tokens * routed_slots, hidden).to(DEVICE, DTYPE)
    shared_rows = (torch.randn(tokens * shared, hidden) / 3).to(DEVICE)
    got = moe_rows.sum_slots(rows, routed_slots + shared, torch.float32, shared_rows, shared)
    want = torch.zeros(tokens, hidden)
    for slot in range(routed_slots):
        want = want + rows.view(tokens, routed_slots, hidden)[:, slot].float().cpu()
    for slot in range(shared):
        want = want + shared_rows.view(tokens, shared, hidden)[:, slot].cpu()
    assert torch.equal(got.cpu(), want)
    with pytest.raises(ValueError, match="shared rows"):
        moe_rows.sum_slots(rows, routed_slots + shared, torch.float32, shared_rows[:-1], shared)


GATE_UP_LAYOUT_M = 32


def gate_up_problem(tokens: int):
    """(x, gate_up weights, layout, slots, pairs) of a small routed + shared MoE whose width (48) is not a
    multiple of the kernels' BLOCK_N (32)."""
    from afd.kernels import moe_align

    routed, num_shared, top_k, hidden, inter = 8, 2, 3, 64, 48
    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden).to(DEVICE, DTYPE)
    w_gate_up = (0.1 * torch.randn(routed + num_shared, 2 * inter, hidden)).to(DEVICE, DTYPE)
    ids = torch.rand(tokens, routed).topk(top_k, dim=-1).indices.to(DEVICE)
    layout = moe_align.align(ids, num_shared, routed + num_shared, GATE_UP_LAYOUT_M)
    return x, w_gate_up, layout, top_k + num_shared, tokens * (top_k + num_shared)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("tokens", [1, 37, 130])
def test_gate_up_on_pre_gathered_rows_writes_every_row_as_before(tokens, tma):
    """GATHER changes where gate_up reads its rows, not a value of `act`, padding rows included; the
    buffer holds each real row's token row and zeros in the padding of tiles with real rows."""
    from afd.kernels import moe_triton

    x, w_gate_up, layout, slots, num_pairs = gate_up_problem(tokens)
    hidden, inter, layout_m = x.shape[1], w_gate_up.shape[1] // 2, GATE_UP_LAYOUT_M
    pairs = layout.pairs
    x_rows = torch.full((pairs.shape[0], hidden), float("nan"), dtype=DTYPE, device=DEVICE)
    acts = {}
    for gather in (False, True):
        acts[gather] = torch.full((pairs.shape[0], inter), 7.0, dtype=DTYPE, device=DEVICE)  # kept where no tile writes
        moe_triton.launch_gate_up(x, w_gate_up, acts[gather], layout, num_pairs, slots, layout_m,
                                  kernel(BLOCK_M=16, TMA=tma, GATHER=gather), x_rows)
    torch.testing.assert_close(acts[True], acts[False], rtol=1e-2, atol=1e-3)
    real = pairs < num_pairs
    used = real.view(-1, layout_m)[:, :1].expand(-1, layout_m).reshape(-1)  # rows of tiles with a real row
    assert 0 < int(real.sum()) < int(used.sum())  # there is padding to get right
    assert torch.equal(x_rows[real], x[pairs[real].long() // slots])
    assert not x_rows[used & ~real].any()


@pytest.mark.parametrize("form", [{"TMA": True, "ONE_DOT": True}, {"HALVES": True}, {"TMA": True, "HALVES": True}],
                         ids=["one-dot", "halves-pointers", "halves-tma"])
@pytest.mark.parametrize("tokens", [1, 37, 130])
def test_gate_up_in_one_dot_or_halves_writes_what_two_dots_write(tokens, form):
    """ONE_DOT and HALVES change how gate and up blocks are loaded and multiplied, not a value of a real row of
    `act` (the last column block is partial: inter 48, BLOCK_N 32; HALVES' second half of it lies past inter)."""
    from afd.kernels import moe_triton

    x, w_gate_up, layout, slots, num_pairs = gate_up_problem(tokens)
    acts = {}
    for name, settings in (("two dots", {"TMA": form.get("TMA", False)}), ("form", form)):
        acts[name] = torch.zeros((layout.pairs.shape[0], w_gate_up.shape[1] // 2), dtype=DTYPE, device=DEVICE)
        moe_triton.launch_gate_up(x, w_gate_up, acts[name], layout, num_pairs, slots, GATE_UP_LAYOUT_M,
                                  kernel(BLOCK_M=16, **settings))
    real = layout.pairs < num_pairs
    assert acts["form"][real].abs().sum() > 0
    torch.testing.assert_close(acts["form"][real], acts["two dots"][real], rtol=1e-2, atol=1e-3)


def test_gather_without_its_buffer_is_refused():
    from afd.kernels import moe_align, moe_triton

    with pytest.raises(ValueError, match="GATHER needs x_rows"):
        moe_triton.launch_gate_up(torch.zeros(1, 64), torch.zeros(1, 96, 64), None,
                                  moe_align.Layout(torch.zeros(16, dtype=torch.int32), None, None), 1, 1, 16,
                                  kernel(GATHER=True))


@pytest.mark.parametrize("tiles, cols, group_m", [(7, 3, 7), (7, 3, 1), (7, 3, 3), (10, 4, 4), (5, 2, 8)])
def test_the_program_order_visits_every_tile_and_column_once(tiles, cols, group_m):
    out = torch.empty(tiles * cols, 2, dtype=torch.int32, device=DEVICE)
    order_kernel[(tiles * cols,)](out, tiles, cols, group_m)
    visited = [tuple(pair) for pair in out.tolist()]
    assert sorted(visited) == [(tile, col) for tile in range(tiles) for col in range(cols)]
    first_group = visited[: min(group_m, tiles) * cols]  # a group's tiles sweep every column first
    assert {tile for tile, _ in first_group} == set(range(min(group_m, tiles)))
    if group_m >= tiles:  # one group: the column-major order of old
        assert visited == [(tile, col) for col in range(cols) for tile in range(tiles)]


@pytest.mark.parametrize("persistent", [0, 1])
def test_no_compile_time_constant_follows_the_token_count(persistent, monkeypatch):
    """Serving meets every batch size: each distinct constexpr compiles a kernel, so none may follow the tokens."""
    from afd.kernels import moe_align, moe_triton

    launched = {}
    monkeypatch.setattr(moe_triton, "gate_up_kernel", LaunchRecorder(launched, "gate_up"))
    monkeypatch.setattr(moe_triton, "down_kernel", LaunchRecorder(launched, "down"))
    routed, num_shared, top_k, hidden, inter, layout_m = 8, 2, 3, 64, 48, 32
    cfg = kernel(BLOCK_M=16, TMA=True, PERSISTENT=persistent)
    for tokens in (37, 130, 1000):
        ids = torch.rand(tokens, routed).topk(top_k, dim=-1).indices.to(DEVICE)
        layout = moe_align.align(ids, num_shared, routed + num_shared, layout_m)
        rows, num_pairs, slots = layout.pairs.shape[0], tokens * (top_k + num_shared), top_k + num_shared
        act = torch.empty(rows, inter, dtype=DTYPE, device=DEVICE)
        moe_triton.launch_gate_up(torch.zeros(tokens, hidden, dtype=DTYPE, device=DEVICE),
                                  torch.zeros(routed + num_shared, 2 * inter, hidden, dtype=DTYPE, device=DEVICE),
                                  act, layout, num_pairs, slots, layout_m, cfg)
        moe_triton.launch_down(act, torch.zeros(routed + num_shared, hidden, inter, dtype=DTYPE, device=DEVICE),
                               torch.empty(num_pairs, hidden, dtype=DTYPE, device=DEVICE), layout,
                               torch.ones(tokens, top_k, dtype=DTYPE, device=DEVICE), num_pairs, top_k, slots,
                               layout_m, cfg)
    for name, constants in launched.items():
        assert len(constants) == 3 and constants[0] == constants[1] == constants[2], (name, constants)
        assert constants[0]["PERSISTENT"] == bool(persistent)

"""Batched attention over a paged KV cache, for prefill and decode in one step.

A step's tokens arrive flattened ([T, ...]); `AttentionBatch` says which sequence
each token belongs to, its position, and where in the cache its key and value live
(block table × block size, flattened). The kernel writes the new keys and values,
then attends: sequences that add one token read the cache through the paged kernel on
CUDA (on CPU: keys gathered, padded to the longest of them, one SDPA), and the sequences
that add several (prompts, or chunks of them) attend causally, each to its own keys and
lower-right aligned (a chunk's queries are its last keys): on CUDA all in one
variable-length kernel call, elsewhere one SDPA each. A step mixing decodes and a prefill
never pads every decode to the prompt's length (that padding cost gigabytes at 64 sequences).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from afd.kernels import triton_available
from afd.models.kv_dtype import store_rows
from afd.step.host_copy import host_to_device


PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class AttentionBatch:
    """Where each flattened token of a step sits: sequence, position and cache row."""

    positions: torch.Tensor  # [T] absolute position of each token
    write_index: torch.Tensor  # [T] cache row receiving each token's key and value
    token_seq: torch.Tensor  # [T] index of each token's sequence in this batch
    token_col: torch.Tensor  # [T] index of each token among its sequence's new tokens
    key_index: torch.Tensor  # [B, max_len] cache row of each sequence's j-th key (0 past its end)
    seq_lens_host: tuple[int, ...]  # keys per sequence, new tokens included
    new_lens_host: tuple[int, ...]  # new tokens per sequence (their queries)
    last_token: torch.Tensor  # [B] flat index of each sequence's last new token
    max_len: int
    max_new: int
    # decode on CUDA (one new token per sequence): the paged kernel reads these instead
    block_table: torch.Tensor | None = None  # [B, W] int32 cache blocks of each sequence
    seq_lens: torch.Tensor | None = None  # [B] int32 keys per sequence, new token included
    block_size: int = 0
    # the sequences that add one token, for the gathered path (built once per step, not per layer)
    single_seqs: torch.Tensor | None = None  # [S] their indices in the batch
    single_lens: torch.Tensor | None = None  # [S] keys of each, new token included
    single_longest: int = 0
    single_table: torch.Tensor | None = None  # [S, W] int32 their cache blocks: on CUDA the paged kernel reads them
    prompts: "PromptLayout | None" = None  # the sequences that add several tokens, for one varlen attention call

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.key_index.shape[0])

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        context_lens: Sequence[int],
        new_lens: Sequence[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionBatch":
        """Metadata for sequences that already cached `context_lens` tokens and add `new_lens`.

        `block_tables[s]` lists the cache blocks of sequence s, in order; each holds
        `block_size` consecutive positions.
        """
        if not (len(block_tables) == len(context_lens) == len(new_lens)) or not block_tables:
            raise ValueError("an attention batch needs one block table, context length and new length per sequence")
        if min(new_lens) < 1:
            raise ValueError("every sequence in a step must add at least one token")
        new = torch.tensor(new_lens, dtype=torch.long)
        context = torch.tensor(context_lens, dtype=torch.long)
        token_seq = torch.repeat_interleave(torch.arange(len(block_tables)), new)
        starts = torch.cumsum(new, 0) - new
        token_col = torch.arange(int(new.sum())) - starts[token_seq]
        positions = context[token_seq] + token_col
        total = context + new
        max_len, max_new = int(total.max()), int(new.max())
        key_pos = torch.arange(max_len)
        width = -(-max_len // block_size)
        if any(len(table) * block_size < length for table, length in zip(block_tables, total.tolist())):
            raise ValueError("a block table is too short for its sequence")
        tables = torch.tensor([list(t[:width]) + [0] * (width - len(t[:width])) for t in block_tables], dtype=torch.long)
        key_index = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [B, max_len]
        key_index = key_index.masked_fill(key_pos[None, :] >= total[:, None], 0)
        device = torch.device(device)
        paged = {}
        if max_new == 1 and device.type == "cuda" and _paged_kernel_available():
            paged = dict(
                block_table=host_to_device(tables.to(torch.int32), device),
                seq_lens=host_to_device(total.to(torch.int32), device),
                block_size=block_size,
            )
        prompts = PromptLayout.build(key_index, new, total, starts, device)
        single = torch.nonzero(new == 1).flatten()
        single_total = total[single]
        if max_new > 1 and len(single) and device.type == "cuda" and _paged_kernel_available():
            paged = dict(single_table=host_to_device(tables[single].to(torch.int32), device), block_size=block_size)
        return cls(
            positions=host_to_device(positions, device),
            write_index=host_to_device(key_index[token_seq, positions], device),
            token_seq=host_to_device(token_seq, device),
            token_col=host_to_device(token_col, device),
            key_index=host_to_device(key_index, device),
            seq_lens_host=tuple(total.tolist()),
            new_lens_host=tuple(int(n) for n in new_lens),
            last_token=host_to_device(starts + new - 1, device),
            max_len=max_len,
            max_new=max_new,
            single_seqs=host_to_device(single, device),
            single_lens=host_to_device(single_total.to(torch.int32) if "single_table" in paged else single_total, device),
            single_longest=int(single_total.max()) if len(single) else 0,
            prompts=prompts,
            **paged,
        )

    @classmethod
    def for_decode(cls, positions, write_index, block_table, seq_lens, block_size: int) -> "AttentionBatch":
        """A decode batch over static device buffers (CUDA graphs): one new token per sequence."""
        seqs = torch.arange(block_table.shape[0], device=block_table.device)
        empty = torch.empty(0, dtype=torch.long, device=block_table.device)
        return cls(positions, write_index, seqs, torch.zeros_like(seqs), empty, (), (), seqs, 0, 1,
                   block_table, seq_lens, block_size)


def cached_attention(
    q: torch.Tensor,  # [T, Hq, Dk]
    k: torch.Tensor,  # [T, Hkv, Dk]
    v: torch.Tensor | None,  # [T, Hkv, Dv]; None: the values are the keys' first Dv columns
    cache_k: torch.Tensor,  # [cache rows, Hkv, Dk]
    cache_v: torch.Tensor,  # [cache rows, Hkv, Dv] (a view of cache_k when v is None)
    batch: AttentionBatch,
    scale: float,
    stored: bool = False,  # k/v are in the cache already (written by the projections' glue kernel)
) -> torch.Tensor:
    """Store k/v in their cache rows, then attend each query to its sequence's keys: [T, Hq, Dv].
    Nothing here copies from the host (that would wait for the device at every layer)."""
    if not stored:
        store_rows(cache_k, batch.write_index, k)
        if v is not None:
            store_rows(cache_v, batch.write_index, v)
    if batch.block_table is not None:  # decode: one query per sequence, keys through block tables
        if q.is_cuda and _paged_kernel_available():
            return _paged_kernel(q, cache_k, cache_v, batch.block_table, batch.seq_lens, batch.block_size, scale,
                                 values_in_keys=v is None)
        return _paged_decode_reference(q, cache_k, cache_v, batch, scale)
    out = q.new_empty(q.shape[0], q.shape[1], cache_v.shape[-1])
    if batch.single_longest:
        tokens = single_tokens(batch)
        out[tokens] = one_token_attention(q[tokens], cache_k, cache_v, batch, scale, values_in_keys=v is None)
    if batch.prompts is not None:
        layout = batch.prompts
        out[layout.tokens] = prompts_attention(q[layout.tokens], cache_k[layout.key_rows],
                                               cache_v[layout.key_rows], layout, scale)
    return out


def single_tokens(batch: AttentionBatch) -> torch.Tensor:
    """Flat indices of the tokens of the sequences that add one token, in `single_seqs` order."""
    return batch.last_token[batch.single_seqs]


def one_token_attention(q: torch.Tensor, cache_k, cache_v, batch: AttentionBatch, scale: float,
                        values_in_keys: bool) -> torch.Tensor:
    """[S, Hq, Dv] for the one-token sequences of a step that also carries prompt tokens (queries `q`
    in `single_seqs` order): the paged decode kernel on CUDA, else their keys gathered and padded, one SDPA."""
    if batch.single_table is not None:
        return _paged_kernel(q, cache_k, cache_v, batch.single_table, batch.single_lens, batch.block_size, scale,
                             values_in_keys)
    longest, count = batch.single_longest, q.shape[0]
    rows = batch.key_index[batch.single_seqs, :longest]  # [S, L]
    mask = (torch.arange(longest, device=q.device)[None, :] < batch.single_lens[:, None]).view(count, 1, 1, longest)
    kv_heads = cache_k.shape[1]  # the query heads of one key head are its query rows: keys never repeated per head
    grouped = q.view(count, kv_heads, q.shape[1] // kv_heads, q.shape[2])  # [S, Hkv, Hq/Hkv, Dk]
    return F.scaled_dot_product_attention(
        grouped, cache_k[rows].transpose(1, 2).to(q.dtype), cache_v[rows].transpose(1, 2).to(q.dtype),
        attn_mask=mask, scale=scale,
    ).reshape(count, q.shape[1], -1)


@dataclass(frozen=True)
class PromptLayout:
    """The sequences of a step that add several tokens, laid out for one variable-length attention call:
    their queries (the flat tokens `tokens`) and all their keys (`key_rows` of the cache), each concatenated
    sequence after sequence, with cumulative boundaries."""

    tokens: torch.Tensor | slice  # their flat token indices (a slice when consecutive: views, no copies)
    key_rows: torch.Tensor  # [K] cache row of every key of every prompt, prompt after prompt
    cu_queries: torch.Tensor  # [P + 1] int32 query boundaries
    cu_keys: torch.Tensor  # [P + 1] int32 key boundaries
    spans_host: tuple[tuple[int, int, int, int], ...]  # (query start, end, key start, end) of each prompt
    max_queries: int
    max_keys: int

    @classmethod
    def build(cls, key_index, new, total, starts, device) -> "PromptLayout | None":
        """From AttentionBatch.build's host tensors: [B, max_len] key rows, new and total keys per sequence,
        each sequence's first flat token. None when no sequence adds several tokens."""
        several = torch.nonzero(new > 1).flatten().tolist()
        if not several:
            return None
        lengths, totals = new[several], total[several]
        tokens = torch.cat([torch.arange(int(starts[s]), int(starts[s] + new[s])) for s in several])
        first, count = int(tokens[0]), len(tokens)
        consecutive = int(tokens[-1]) - first + 1 == count
        key_rows = torch.cat([key_index[s, : int(total[s])] for s in several])
        zero = torch.zeros(1, dtype=torch.long)
        cu_q, cu_k = torch.cat((zero, torch.cumsum(lengths, 0))), torch.cat((zero, torch.cumsum(totals, 0)))
        spans = tuple(zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()))
        return cls(
            tokens=slice(first, first + count) if consecutive else host_to_device(tokens, device),
            key_rows=host_to_device(key_rows, device),
            cu_queries=host_to_device(cu_q.to(torch.int32), device),
            cu_keys=host_to_device(cu_k.to(torch.int32), device),
            spans_host=spans,
            max_queries=int(lengths.max()),
            max_keys=int(totals.max()),
        )


def prompts_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, layout: PromptLayout,
                      scale: float) -> torch.Tensor:
    """Every prompt's queries [Q, Hq, Dk] over its own keys [K, Hkv, Dk] and values [K, Hkv, Dv] (concatenated
    as `layout` says; a prompt's last keys are its queries'), causal the lower-right way: [Q, Hq, Dv].
    On CUDA one variable-length kernel for the whole step (a call per prompt cost launches and host time
    per prompt and layer); elsewhere one SDPA per prompt."""
    keys, values = keys.to(q.dtype), values.to(q.dtype)
    if q.is_cuda:
        return varlen_causal_attention(q, keys, values, layout, scale)
    out = q.new_empty(q.shape[0], q.shape[1], values.shape[-1])
    for q0, q1, k0, k1 in layout.spans_host:
        out[q0:q1] = prompt_attention(q[q0:q1], keys[k0:k1], values[k0:k1], scale)
    return out


def varlen_causal_attention(q, keys, values, layout: PromptLayout, scale: float) -> torch.Tensor:
    """`prompts_attention` on CUDA: FlashAttention's variable-length kernel where it applies (16-bit, one head
    dim for queries, keys and values, grouped heads allowed; its causal mask is bottom-right aligned), else the
    memory-efficient one (float32, or MLA's 192-wide keys with 128-wide values; mask type 2 = causal from the
    bottom right)."""
    dim = q.shape[-1]
    if q.dtype in (torch.float16, torch.bfloat16) and dim == values.shape[-1] and dim <= 256 and dim % 8 == 0:
        return torch.ops.aten._flash_attention_forward(
            q, keys, values, layout.cu_queries, layout.cu_keys, layout.max_queries, layout.max_keys,
            0.0, True, False, scale=scale)[0]
    if keys.shape[1] != q.shape[1]:  # the memory-efficient kernel wants one key head per query head
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return torch.ops.aten._efficient_attention_forward(
        q[None], keys[None], values[None], None, layout.cu_queries, layout.cu_keys, layout.max_queries,
        layout.max_keys, 0.0, 2, False, scale=scale)[0][0]


def prompt_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's new queries [n, Hq, Dk] over all its keys [L, Hkv, Dk] (the last n are theirs),
    causal: [n, Hq, Dv]. The lower-right causal bias lets SDPA pick a flash or memory-efficient kernel.
    Not cuDNN's: it plans every new (n, L) shape on the host, about 1.6 ms a call on an H200, and a
    serving step's prompt lengths are new nearly every time."""
    bias = causal_lower_right(q.shape[0], keys.shape[0])
    with sdpa_kernel(PROMPT_BACKENDS):
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, Hq, n, Dk]
            keys.transpose(0, 1).unsqueeze(0).to(q.dtype),
            values.transpose(0, 1).unsqueeze(0).to(q.dtype),
            attn_mask=bias, scale=scale, enable_gqa=q.shape[1] != keys.shape[1],
        )[0].transpose(0, 1)


def _paged_kernel(q, cache_k, cache_v, block_table, seq_lens, block_size: int, scale: float, values_in_keys: bool):
    """The Triton paged decode kernel for one query per sequence: [B, Hq, Dv]."""
    # local import: Triton is optional (CPU installs have none): loaded where its kernel runs
    from afd.kernels.decode_attention import paged_decode_attention, paged_latent_decode_attention

    if values_in_keys:  # one shared latent row per token: every head reads it once per block
        return paged_latent_decode_attention(q, cache_k, cache_v.shape[-1], block_table, seq_lens, block_size, scale)
    return paged_decode_attention(q, cache_k, cache_v, block_table, seq_lens, block_size, scale)


def _paged_decode_reference(q, cache_k, cache_v, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """The paged decode kernel's function in plain torch (CPU, or no Triton): [B, Hq, Dv]."""
    pos = torch.arange(batch.block_table.shape[1] * batch.block_size, device=q.device)  # [W*bs]
    rows = batch.block_table[:, pos // batch.block_size].long() * batch.block_size + pos % batch.block_size
    mask = (pos[None, :] < batch.seq_lens[:, None]).view(q.shape[0], 1, 1, -1)  # [B, 1, 1, W*bs]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, Dk]
        cache_k[rows].transpose(1, 2).to(q.dtype),
        cache_v[rows].transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != cache_k.shape[1],
    )
    return out.squeeze(2)


def _paged_kernel_available() -> bool:
    return triton_available()

"""Deltaformer stage 2: causal softmax attention of q over (k, u), within documents when doc_start is given.

No mask: SDPA with is_causal (FlashAttention on CUDA). With doc_start [B, T], query i sees key j iff
doc_start_i <= j <= i. On CUDA that runs as flex_attention, compiled, with a block mask built from doc_start
(`doc_block_mask`): tiles of keys before the document of a tile's first query are skipped, tiles every query
of a tile sees whole run without the mask. Elsewhere (CPU) SDPA with the dense [B, 1, T, T] mask.
"""

import functools

import torch
import torch.nn.functional as F

BLOCK = 128  # the block mask's tile (flex_attention's default)


def attend(q, k, u, scale, doc_start=None):
    """o [B, H, T, D] = softmax over the visible j of (scale q_i.k_j) times u_j."""
    if doc_start is None:
        return F.scaled_dot_product_attention(q, k, u, is_causal=True, scale=scale)
    if q.is_cuda:
        return flex_in_documents(q, k, u, scale, doc_start, _flex_compiled())
    return F.scaled_dot_product_attention(q, k, u, attn_mask=dense_doc_mask(doc_start)[:, None], scale=scale)


def dense_doc_mask(doc_start):
    """[B, T, T] bool: query i sees key j iff doc_start_i <= j <= i."""
    j = torch.arange(doc_start.shape[1], device=doc_start.device)
    return (j[None, None, :] <= j[None, :, None]) & (j[None, None, :] >= doc_start[:, :, None])


@functools.cache
def _flex_compiled():  # compiled on first use (CUDA only)
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_in_documents(q, k, u, scale, doc_start, flex=None):
    """`attend` by flex_attention (flex: the compiled one on CUDA; None: eager, for the tests)."""
    # imported here, not at the top: flex_attention imports torch._dynamo, seconds of every process's start
    from torch.nn.attention.flex_attention import flex_attention

    return (flex or flex_attention)(q, k, u, block_mask=doc_block_mask(doc_start), scale=scale)


def doc_block_mask(doc_start, block=BLOCK):
    """The BlockMask of `dense_doc_mask`, from doc_start by arithmetic (no [T, T] mask, no host sync). Query
    tile m holds rows m*block.. with first-row start lo_m and last-row start hi_m (doc_start is
    non-decreasing): key tiles n < lo_m // block are seen by none of them, tiles ceil(hi_m / block) <= n < m
    by all of them whole ("full": no mask evaluated), the others (the ones between, and the diagonal tile m)
    in part."""
    from torch.nn.attention.flex_attention import BlockMask

    B, T = doc_start.shape
    n = -(-T // block)
    dev = doc_start.device
    ds = doc_start.to(torch.int32)
    m = torch.arange(n, device=dev, dtype=torch.int32)
    lo = ds[:, (m * block).long()] // block  # [B, n]: the first key tile any row of tile m sees
    hi = ds[:, (m * block + block - 1).clamp(max=T - 1).long()]
    full_lo = torch.minimum(-(-hi // block), m)  # key tiles [full_lo, m) are full
    idx = torch.arange(n, device=dev, dtype=torch.int32)
    partial = torch.where(idx < (full_lo - lo)[..., None], lo[..., None] + idx, m[:, None])  # then tile m
    full = (full_lo[..., None] + idx).clamp(max=n - 1)
    padded = ds[:, torch.arange(n * block, device=dev).clamp(max=T - 1)]  # rows past T: the last row's

    def mask_mod(b, h, i, j):
        return (j <= i) & (j >= padded[b, i])

    return BlockMask.from_kv_blocks(
        (full_lo - lo + 1)[:, None], partial[:, None], (m - full_lo)[:, None], full[:, None],
        BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(T, T),
    )  # fmt: skip

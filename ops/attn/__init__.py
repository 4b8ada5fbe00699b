"""Causal softmax attention, optionally within documents: softmax_attention(q, k, v, pos, doc_start).

Without doc_start it is SDPA's causal attention (FlashAttention on CUDA). With doc_start [B, T] (the
position of the first token of each query's document, in the keys' frame: ops/common.py), query i sees key
j iff doc_start[b, i] <= j <= pos + i. Under torch.compile that runs through flex_attention with a block
mask, which skips the key blocks before a query block's first document (SDPA with a dense mask would run
its slower memory-efficient kernel over every block); in eager mode, and with dropout, SDPA with the mask.
"""

import torch
import torch.nn.functional as F


def softmax_attention(q, k, v, pos=0, doc_start=None, dropout=0.0):
    """q [B, H, T, D] at positions pos.. (an int, or a one-element tensor), k, v [B, H, S, D] at 0..S-1."""
    T, S = q.shape[2], k.shape[2]
    one_new = T == 1 and isinstance(pos, int) and S == pos + 1  # a token after the cached keys: sees them all
    if doc_start is None and (S == T or one_new):  # causal (the keys are the queries'), or no mask at all
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=S == T)
    i, j = torch.arange(T, device=q.device)[:, None], torch.arange(S, device=q.device)
    if doc_start is None:  # the cached keys come first (a static cache's slots after pos + i: masked)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=j <= pos + i, dropout_p=dropout)
    if torch.compiler.is_compiling() and dropout == 0.0 and S == T:
        from torch.nn.attention.flex_attention import flex_attention  # (imports torch._dynamo: seconds)

        return flex_attention(q, k, v, block_mask=document_block_mask(doc_start))
    mask = (j <= pos + i) & (j >= doc_start[:, None, :, None])  # [B, 1, T, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)


def document_block_mask(doc_start):
    """flex_attention's BlockMask of causal attention within documents, T queries over their T keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    def within(b, h, i, j):
        return (j <= i) & (j >= doc_start[b, i])

    B, T = doc_start.shape
    return create_block_mask(within, B, None, T, T, device=doc_start.device)

"""DDLStream: the DDL state X between a model's sublayers, and how a model drives the ops on it; Compressor.

A sublayer reads x_in = compress(X) (`read`) and writes X <- X + beta khat (v^T - khat^T X) (`write`). The
reads go through the compressor that `enter` names: a Compressor, whose `kind` (the residual rule's
spec.compressor: None | "cc" | "tc") picks the fused kernels below, called as reader(X, doc_start) ->
[B, T, d].
What exists only for speed and memory happens behind those two calls, so that a model need not see it:
- a write waits for the next read and runs with it as one op, the update fused with that read-out
  (ddl_update_compress_cc / _tc: fewer passes over the state than the update and then the read; at
  d_v = 1, read_normed: the update with the reading sublayer's RMSNorm and logits, ddl_update_norm);
- keep_every = N (while autograd records): autograd keeps the state entering every Nth block; each update
  after it gets rebuild_from = (that state, the steps of the updates since) and rebuilds its input from them
  in its backward, so one state per N blocks stays alive rather than one per sublayer;
- decoding (a cache, sample.py): TC's causal conv reads through the states of the earlier tokens, kept per
  read (cache.history).
doc_start [B, T] (packed documents, ops/ddl's docstring): every TC read stays within each token's document.
With a cache it is in the whole sequence's frame; history_doc_start carries it to a read's window.
stochastic=True (a bf16 X): every update rounds its X stochastically, with a seed of its own drawn from
torch's generator on X's device.
"""

import torch
import torch.nn as nn

from ..common import autocast_dtype, resolve_backend
from . import (
    _check_doc_start,
    cc_read_weight,
    compress_cc,
    compress_tc,
    ddl_update,
    ddl_update_compress_cc,
    ddl_update_compress_tc,
    ddl_update_norm,
    tc_windows_ref,
)


class Compressor(nn.Module):
    """Reads the d-vector a sublayer (or the LM head) sees out of X [B, T, d, d_v], as the GPTConfig cfg's
    residual rule says (cfg.spec.compressor): None (d_v = 1: X[..., 0]), "cc" or "tc"."""

    def __init__(self, cfg):
        super().__init__()
        self.kind, self.backend, d, dv = cfg.spec.compressor, cfg.backend, cfg.n_embd, cfg.ddl_dv
        if self.kind == "cc":  # depthwise conv along d_v (kernel d_v, centred), then the read
            self.conv = nn.Parameter(identity_conv(d, dv, tap=(dv - 1) // 2))
        elif self.kind == "tc":  # causal depthwise conv over tokens (tap K-1 = now), then the read
            self.conv = nn.Parameter(identity_conv(d, dv, cfg.ddl_conv_size))
        if self.kind is not None:
            self.read = nn.Parameter(torch.full((dv,), 1.0 / dv))

    def cc_weight(self):  # DDL-CC's conv and read as the one linear map [d, d_v] they are
        return cc_read_weight(self.conv, self.read)

    def forward(self, X, doc_start=None):
        """x_in [B, T, d]; doc_start [B, T] (or None): TC's conv within each token's document."""
        if self.kind is None:
            return X[..., 0]
        if self.kind == "cc":
            return compress_cc(X, self.cc_weight(), backend=self.backend)
        return compress_tc(X, self.conv, self.read, backend=self.backend, doc_start=doc_start)

    def windows(self, X, doc_start=None):
        """TC: the read-outs of the last S - (K-1) tokens of X [B, S, d, d_v], its first K-1 steps the states
        before them (decoding: the cached ones); doc_start [B, S] in X's frame (history_doc_start) or None.
        PyTorch on every backend: a decoding step reads K states, for which five ops dispatch less than the
        kernel's launch with its taps' and views' ops around it."""
        doc_start = None if doc_start is None else doc_start[:, self.conv.shape[-1] - 1 :]
        return tc_windows_ref(X, self.conv, self.read, doc_start)


def identity_conv(*shape, tap=None):
    """A depthwise conv weight [..., K] that passes its input through: tap `tap` (default K-1) is 1."""
    return torch.zeros(shape).index_fill_(-1, torch.tensor([shape[-1] - 1 if tap is None else tap]), 1.0)


def history_doc_start(doc_start, pos, n):
    """doc_start [B, T] of T new tokens at positions pos.. (the sequence's frame) in the frame of a causal
    conv's input with the n cached steps before them in front ([B, n + T], cache.history), or None. The
    history's own steps get 0 (their outputs are dropped); a document that began before the history reaches
    back through all of it (where the sequence began, the history holds the conv's zero padding)."""
    if doc_start is None:
        return None
    moved = (doc_start - pos + n).clamp(min=0)
    return torch.cat([moved.new_zeros(moved.shape[0], n), moved], dim=1)


class DDLStream:
    """X [B, T, d, d_v] with read() and write(h, v, beta) for the sublayers (the module docstring)."""

    def __init__(
        self,
        X,
        eps=1e-5,
        erase=True,
        backend="auto",
        keep_every=0,
        cache=None,
        stochastic=False,
        doc_start=None,
    ):
        _check_doc_start("DDLStream", doc_start, X)
        self.X, self.cache, self.kw = X, cache, dict(eps=eps, erase=erase, backend=backend)
        self.doc_start = doc_start
        self.stochastic = stochastic
        self.every = keep_every if torch.is_grad_enabled() else 0
        self.blocks, self.keep, self.chain = 0, False, None  # chain: (the kept state, the updates' steps)
        self.reader, self.slot, self.pending = None, 0, None

    def enter(self, reader):
        """The reads from now on are `reader`'s (a block's compressor, or the last). Returns the stream."""
        self.reader, self.slot = reader, 0
        self.keep = self.every > 0 and self.blocks % self.every == 0  # the next write's input is kept
        self.blocks += 1
        return self

    def write(self, h, v, beta):
        """X <- X + beta khat (v^T - khat^T X), khat = h / sqrt(|h|^2 + eps^2), applied at the next read.
        Returns the stream."""
        self.pending, self.keep = (h, v, beta, self.keep), False
        return self

    def read(self):
        """x_in [B, T, d] = compress(X), after the pending write."""
        slot, self.slot = self.slot, self.slot + 1
        if self.pending is None:
            return self._compress(slot)
        (h, v, beta, keep), self.pending, X, read = self.pending, None, self.X, self.reader
        rebuild_from, steps = (None if keep else self.chain), self.every > 0
        kw = dict(self.kw, rebuild_from=rebuild_from, return_step=steps, seed=self._seed())
        if read.kind == "cc":
            out = ddl_update_compress_cc(X, h, v, beta, read.cc_weight(), **kw)
        elif read.kind == "tc" and self.cache is None:  # decoding reads through the history instead
            out = ddl_update_compress_tc(X, h, v, beta, read.conv, read.read, doc_start=self.doc_start, **kw)
        else:  # d_v = 1 (x_in = X[..., 0]) or TC decoding: the update, then the read
            out = ddl_update(X, h, v, beta, **kw)
            out = (out[0], None, out[1]) if steps else (out, None)
        self.X, x_in = out[0], out[1]
        if steps:  # this update joins the steps that the next updates rebuild their input with
            X0, earlier = rebuild_from or (X, ())
            self.chain = (X0, earlier + (out[2],))
        return x_in if x_in is not None else self._compress(slot)

    def read_normed(self, norm_weight, norm_eps, logit_weight):
        """d_v = 1: (c, z, inv_rms) of x_in = read() as ddl_update_norm gives them, from one op with the
        pending write, where the Triton kernels run it and every state is kept (c in autocast's dtype, as
        the sublayer's matmuls read it). Else None: the caller reads x_in and computes them itself."""
        X = self.X
        if self.pending is None or self.reader.kind is not None or self.every > 0:
            return None
        h, v, beta, _ = self.pending
        if resolve_backend("ddl_update_norm", self.kw["backend"], X, h, v, beta, norm_weight) != "triton":
            return None
        c_dtype = autocast_dtype(X.device.type)
        self.pending, self.slot = None, self.slot + 1
        kw = dict(self.kw, norm_eps=norm_eps, c_dtype=c_dtype, seed=self._seed())
        self.X, c, z, inv_rms = ddl_update_norm(X, h, v, beta, norm_weight, logit_weight, **kw)
        return c, z, inv_rms

    def _seed(self):  # an update's seed for its stochastic rounding, or None: rounded to nearest
        return torch.randint(2**32, (1,), device=self.X.device) if self.stochastic else None

    def _compress(self, slot):
        if self.cache is None or self.reader.kind != "tc":
            return self.reader(self.X, self.doc_start)
        K = self.reader.conv.shape[-1]  # the conv needs the K-1 states before the new ones
        X = self.cache.history((self.reader, slot), self.X, K - 1)
        return self.reader.windows(X, history_doc_start(self.doc_start, self.cache.pos, K - 1))

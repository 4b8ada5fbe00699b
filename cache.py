"""The decoding caches of GPT.hidden_states (generate in sample.py, and the Hugging Face model of
export_hf.py): Cache, grown by concatenation, and StaticCache, preallocated and written in place for
torch.compile's CUDA graphs; a model's StaticCache (static_cache) and the decoding step compiled over it
(compiled_next_logits)."""

import functools
import weakref

import torch

from ops.common import autocast_dtype
from ops.deltaformer import deltaformer_decode, deltaformer_step


class Cache:
    """Decoding state for GPT.hidden_states: `pos` tokens seen so far, and in `store`, per module (or
    (module, slot)), what it keeps of them: keys and values (Deltaformer: keys and u's) [B, H, S, D], grown by
    concatenation, and the last n inputs of a causal conv (DDL's TC read-outs and EC). `documents`: whether
    the cached tokens are split into documents (doc_start), which every later call then continues."""

    def __init__(self):
        self.pos, self.store, self.documents = 0, {}, False

    def extend(self, key, k, v):
        """key's cached keys and values [B, H, S, D] followed by the T new ones k, v [B, H, T, D]."""
        if key in self.store:
            k, v = (torch.cat([past, new], dim=2) for past, new in zip(self.store[key], (k, v)))
        self.store[key] = (k, v)
        return k, v

    def deltaformer(self, key, q, k, v, w, beta, kernel, doc_start=None):
        """Deltaformer attention [B, H, T, D] of T new tokens after key's cached keys and u's (doc_start: the
        new tokens', in the whole sequence's frame)."""
        y, self.store[key] = deltaformer_decode(q, k, v, w, beta, self.store.get(key), kernel, doc_start)
        return y

    def history(self, key, x, n):
        """x [B, T, ...] with the last n steps cached under key in front (zeros at the start of the sequence,
        i.e. the same zero padding a causal conv uses at t < 0); remembers the last n steps for next time."""
        if n == 0:
            return x
        past = self.store.get(key)
        if past is None:  # the first call only: no zeros allocated on every decoding step
            past = x.new_zeros((x.shape[0], n) + tuple(x.shape[2:]))
        full = torch.cat([past, x], dim=1)
        self._keep(key, full[:, -n:])
        return full

    def _keep(self, key, last):
        self.store[key] = last

    def doc_start(self, start):
        """doc_start [B, T] of the new tokens (ops/common.doc_starts: 0 where no document began among them)
        continued from the cached tokens': the document of the last cached token goes on until one begins."""
        last = self.store.get(Cache.doc_start)  # keyed by this method: a str key beside modules fails compile
        start = start if last is None else torch.maximum(start, last)
        self._keep(Cache.doc_start, start[:, -1:])
        self.documents = True
        return start


class StaticCache(Cache):
    """A Cache in buffers allocated for block_size tokens and written in place, `pos` a tensor: each decoding
    step after the prompt has the same shapes and reads and writes the same addresses at every position, so
    that torch.compile's CUDA graphs can replay it (gpt-fast's static KV cache). While `prompt` is True (the
    first pass, which its owner then ends by setting it False) the keys, values and u's are computed as
    Cache computes them and copied into the buffers; after it, each step writes its token's at slot pos, and
    attention reads the whole buffer with the slots after pos masked: the same result, more (masked) work."""

    def __init__(self, block_size, device):
        super().__init__()
        self.block_size, self.prompt = block_size, True
        self.pos = mark_static(torch.zeros(1, dtype=torch.long, device=device))

    def reset(self):
        """Ready for a new prompt; the buffers, zeroed, stay (and so their addresses)."""
        self.prompt, self.documents = True, False
        self.pos.zero_()
        for bufs in self.store.values():
            for buf in bufs if isinstance(bufs, tuple) else (bufs,):
                buf.zero_()
        return self

    def extend(self, key, k, v):
        if self.prompt:  # the prompt's keys attend to the prompt's only: causal attention, as Cache's
            self._fill(key, k, v)
            return k, v
        at = self.pos + torch.arange(k.shape[2], device=k.device)
        for buf, new in zip(self.store[key], (k, v)):
            buf.index_copy_(2, at, new)
        return self.store[key]

    def deltaformer(self, key, q, k, v, w, beta, kernel, doc_start=None):
        if self.prompt:
            y, (k, u) = deltaformer_decode(q, k, v, w, beta, None, kernel, doc_start)
            self._fill(key, k, u)
            return y
        docs = [None] * q.shape[2] if doc_start is None else doc_start.split(1, dim=1)
        outs = [  # one token at a time, as deltaformer_decode after a prompt
            deltaformer_step(*(x[:, :, t : t + 1] for x in (q, k, v, w, beta)), *self.store[key], kernel,
                             pos=self.pos + t, doc_start=docs[t])[0]
            for t in range(q.shape[2])
        ]  # fmt: skip
        return torch.cat(outs, dim=2)

    def _fill(self, key, *new):  # the prompt's [B, H, T, D] tensors into key's buffers (made if missing)
        if key not in self.store:
            shape = lambda x: x.shape[:2] + (self.block_size,) + x.shape[3:]  # noqa: E731
            self.store[key] = tuple(mark_static(x.new_zeros(shape(x))) for x in new)
        for buf, x in zip(self.store[key], new):
            buf[:, :, : x.shape[2]] = x

    def _keep(self, key, last):
        if key in self.store:
            self.store[key].copy_(last)  # in place (last is a slice of a new tensor, not of the buffer)
        else:
            self.store[key] = mark_static(last.clone())


def mark_static(buf):
    """buf, marked as an input whose address stays: CUDA graphs read it in place rather than copying it."""
    torch._dynamo.mark_static_address(buf)
    return buf


_static_caches = weakref.WeakKeyDictionary()  # model -> (what its StaticCache was made for, the cache)


def static_cache(model, idx):
    """model's StaticCache, reset, for a prompt idx: the last one again (the same buffers, so the same
    addresses for the CUDA graphs) unless the batch size, device or dtypes differ."""
    device = idx.device
    key = (idx.shape[0], device, autocast_dtype(device.type), next(model.parameters()).dtype)
    made_for, cache = _static_caches.get(model, (None, None))
    if made_for != key:
        cache = StaticCache(model.config.block_size, device)
        _static_caches[model] = (key, cache)
    return cache.reset()


def next_logits(model, cache, idx, attention_mask=None):
    """Logits [B, V] of the token after idx [B, T], continuing cache's sequence (None: idx is all of it)."""
    return model.lm_head(model.hidden_states(idx, cache, attention_mask)[:, -1])


@functools.cache
def compiled_next_logits(backend="inductor"):
    """next_logits compiled for a decoding step (one token, a StaticCache): its shapes never change, so on
    CUDA mode="reduce-overhead" replays the step as CUDA graphs, one launch instead of hundreds. backend:
    torch.compile's ("aot_eager": the same graphs, run without Inductor's code; what CPU tests check)."""
    mode = "reduce-overhead" if backend == "inductor" else None
    return torch.compile(next_logits, backend=backend, mode=mode, dynamic=False)

"""model.GPT as a Hugging Face model: DDLGPTConfig (a PretrainedConfig holding GPTConfig's fields) and
DDLGPTForCausalLM, which transformers' AutoModelForCausalLM, generate() and lm-eval's `hf` model load.

export_hf.py copies this file into the exported folder as modeling_ddl_gpt.py, with model.py and the
kernels beside it (their imports made relative, as transformers' loader of remote code requires), so the
exported model is model.py's GPT itself: the same forward, the same kernels (Triton's where it runs them,
the PyTorch path elsewhere) and the same decoding cache as sample.generate.

generate() decodes through a cache: the prompt once, then one token a step (its keys/values, Deltaformer's
u's, DDL's TC and EC histories); past block_size the window slides and each step reruns the last block_size
tokens without a cache, as sample.generate does. On CUDA the steps run compiled (decode="compiled": a
cache.StaticCache, each step one CUDA graph; the first generate() of a batch size compiles); decode="cache"
(a generate() argument, or the config's `decode`, e.g. from_pretrained(..., decode="cache")) runs them
eagerly through cache.Cache, the CPU's default. attention_mask may left-pad a batch (0s before a row's
tokens): the padding is a document of its own that no token sees (GPT.hidden_states), so each row's logits
and tokens are those of the row alone; right padding is refused.

It runs as the folder's modeling file (export_hf.py copies it there with the modules it imports).
"""

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from cache import Cache, StaticCache, compiled_next_logits, static_cache
from model import GPT, GPTConfig

EOT = 50256  # GPT-2's <|endoftext|>, the document separator
DECODES = ("cache", "compiled")  # generate()'s decode: eager through a Cache (CPU), compiled steps (CUDA)
# transformers 5 renamed the cache argument and output field past_key_values -> cache (both accepted here)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class DDLGPTConfig(PretrainedConfig):
    model_type = "ddl_gpt"

    def __init__(self, gpt=None, **kwargs):
        self.gpt = dict(gpt or {})  # GPTConfig's fields, as a checkpoint's model_args
        cfg = GPTConfig(**self.gpt)  # checks them
        for name, value in dict(
            vocab_size=cfg.vocab_size,
            max_position_embeddings=cfg.block_size,  # lm-eval's max_length: contexts are cut to fit
            hidden_size=cfg.n_embd,
            num_hidden_layers=cfg.n_layer,
            num_attention_heads=cfg.n_head,
            bos_token_id=EOT,
            eos_token_id=EOT,
            tie_word_embeddings=True,
        ).items():
            kwargs.setdefault(name, value)
        super().__init__(**kwargs)

    def gpt_config(self):
        return GPTConfig(**self.gpt)


class DDLGPTForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = DDLGPTConfig
    base_model_prefix = "gpt"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"gpt.lm_head.weight": "gpt.wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.gpt = GPT(config.gpt_config())
        self.post_init()

    def _init_weights(self, module):
        """from_pretrained loads every weight but leaves the buffers GPT computes when built (RoPE's tables)
        empty and asks for them here: taken from a GPT built on the CPU, once."""
        if not any(True for _ in module.buffers(recurse=False)):
            return
        if "_built" not in self.__dict__:  # a plain attribute, not a submodule; the GPT itself is freed
            buffers = dict(GPT(self.config.gpt_config()).named_buffers())
            self.__dict__["_built"] = buffers, {m: n for n, m in self.gpt.named_modules()}
        buffers, names = self.__dict__["_built"]
        if module in names:
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buffers[f"{names[module]}.{name}".lstrip(".")].to(buf.device)

    @classmethod
    def _supports_default_dynamic_cache(
        cls,
    ):  # generate() gets cache.Cache from prepare_inputs_for_generation
        return False

    def get_input_embeddings(self):
        return self.gpt.wte

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def forward(
        self, input_ids, attention_mask=None, labels=None, use_cache=None, return_dict=None, **kwargs
    ):
        """Logits [B, T, vocab] of input_ids [B, T]; with a cache.Cache (as `cache` or `past_key_values`),
        input_ids continue the cached sequence. attention_mask: 1 a token, 0 left padding (continuing a cache:
        of the whole sequence, as generate() grows it). labels: HF's convention (shifted, -100 ignored)."""
        cache = kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)
        if not isinstance(cache, Cache):
            cache = Cache() if use_cache else None
        if isinstance(cache, StaticCache) and not cache.prompt and input_ids.shape[1] == 1:  # a decoding step
            logits = compiled_next_logits()(self.gpt, cache, input_ids)[:, None]  # (no mask: no host sync)
        else:
            mask = padding(attention_mask, cache)
            logits = self.gpt.lm_head(self.gpt.hidden_states(input_ids, cache, mask))
            if isinstance(cache, StaticCache):
                cache.prompt = False  # the prompt is in: one token a step from here on
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE: cache})

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, decode=None, **kwargs):
        """The tokens generate() has not fed yet and the cache; past block_size the last block_size tokens,
        without a cache (sample.generate's sliding window). decode: DECODES' (None: the config's `decode`,
        else "compiled" on CUDA and "cache" elsewhere)."""
        cache = kwargs.get("cache") or kwargs.get("past_key_values")
        block_size = self.gpt.config.block_size
        if input_ids.shape[1] > block_size:  # (the mask, cropped alike, goes with them: forward's `padding`)
            cache, input_ids = None, input_ids[:, -block_size:]
            attention_mask = None if attention_mask is None else attention_mask[:, -block_size:]
        elif isinstance(cache, StaticCache) and not cache.prompt:  # the new token, in a tensor of its own
            input_ids = input_ids[:, -1:].clone(memory_format=torch.contiguous_format)  # (a view: recompiles)
        elif isinstance(cache, Cache) and cache.pos > 0:
            input_ids = input_ids[:, cache.pos :]
        else:
            decode = decode or getattr(self.config, "decode", None) or DECODES[input_ids.is_cuda]
            if decode not in DECODES:
                raise ValueError(f"DDLGPTForCausalLM: decode must be one of {DECODES}, got {decode!r}")
            cache = static_cache(self.gpt, input_ids) if decode == "compiled" else Cache()
        return {"input_ids": input_ids, "attention_mask": attention_mask, CACHE: cache}

    def _reorder_cache(self, *args, **kwargs):
        raise NotImplementedError("DDLGPTForCausalLM's cache does not support beam search (num_beams=1)")


def padding(attention_mask, cache):
    """The attention_mask GPT.hidden_states takes: None where no row is padded, or where the tokens continue
    a cache (whose last document they continue: cache.Cache.doc_start); else attention_mask itself, whose
    left padding is a document of its own. Right padding, and a row of padding alone, are refused."""
    if attention_mask is None:
        return None
    real = attention_mask.bool()
    if bool((real[:, :-1] & ~real[:, 1:]).any()):
        raise ValueError(
            "DDLGPTForCausalLM: attention_mask has right padding (a 0 after a 1); only left padding is "
            "supported (tokenizer.padding_side = 'left')"
        )
    if not bool(real[:, -1].all()):
        raise ValueError("DDLGPTForCausalLM: attention_mask has a row of padding alone (no token to go on)")
    return None if bool(real.all()) or (cache is not None and cache.pos > 0) else attention_mask

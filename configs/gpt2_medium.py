# GPT-2 medium (24 layers, d 1024, 8 heads x 128; ~354M parameters) on FineWeb-Edu: the recipe of
# configs/gpt2_small.py (global batch 480 x 1024, AdamW 1e-3, 2000 warmup, cosine over 100k steps) at the
# DDL paper's medium shape.
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_medium.py
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_medium.py --residual=ddl-cc \
#       --out_dir=out-medium-ddl-cc --wandb_run_name=medium-ddl-cc        # a variant: see the README table
from configs.gpt2_small import *  # noqa: F403  (the shared recipe, doc_mask too; the lines below override it)

out_dir = "out-gpt2-medium"
wandb_run_name = "gpt2-medium"

# model: the DDL paper's Table 6 shape (the same numbers as GPTConfig.preset("gpt2-medium"))
n_layer = 24
n_embd = 1024
n_head = 8
head_dim = 128

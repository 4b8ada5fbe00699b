# GPT-2 small (12 layers, d 768, 6 heads x 128; ~124M parameters) on FineWeb-Edu with the papers' recipe.
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_small.py
#   torchrun --standalone --nproc_per_node=8 train.py configs/gpt2_small.py --residual=ddl-cc \
#       --out_dir=out-small-ddl-cc --wandb_run_name=small-ddl-cc        # a variant: see the README table
out_dir = "out-gpt2-small"
dataset = "fineweb_edu"  # shards from `python data/fineweb_edu.py` in data/fineweb_edu (or set data_dir)
wandb_run_name = "gpt2-small"

# model: the DDL paper's Table 6 shape (the same numbers as GPTConfig.preset("gpt2-small"))
n_layer = 12
n_embd = 768
n_head = 6
head_dim = 128
block_size = 1024
# True: a document starts at each EOT, and no token sees an earlier document packed into its row (README,
# Training). The papers trained without it: off, as in their recipe
doc_mask = False

# global batch 480 x 1024 = 491,520 tokens: 32 micro-steps of 15 rows, split among 1, 2, 4, 8, 16 or 32
# GPUs. Less GPU memory: keep batch_size * gradient_accumulation_steps = 480, e.g. 10 x 48 or 5 x 96.
batch_size = 15
gradient_accumulation_steps = 32

# AdamW, 2000 warmup steps, cosine over 100k steps (49B tokens). The papers say "cosine" without a floor;
# min_lr = lr / 10 is nanoGPT's choice (--min_lr=0.0 decays to zero).
learning_rate = 1e-3
min_lr = 1e-4
betas = (0.9, 0.95)
weight_decay = 0.1
grad_clip = 1.0
warmup_iters = 2000
lr_decay_iters = 100_000
max_iters = 100_000

eval_interval = 1000
eval_iters = 10  # 10 val batches of 480 x 1024 = 4.9M tokens per evaluation
log_interval = 10

# A small GPT on the embedded Shakespeare corpus: trains on 2 CPU cores in about 9 minutes (~2 s per
# iteration) to a val loss of ~5.45 at iteration 250, then samples recognisable (if not sensible) Shakespeare.
# The README's first command:
#   python data/shakespeare.py && python train.py configs/shakespeare.py
#   python sample.py --out_dir=out-shakespeare --start="ROMEO:"
# Try a variant with e.g. --residual=ddl-cc or --attention=deltaformer (slower on CPU).
out_dir = "out-shakespeare"
dataset = "shakespeare"
wandb_run_name = "shakespeare"

# model: most of the compute is the 50304-token LM head, so depth is cheap and width is not
n_layer = 6
n_embd = 256
n_head = 4
head_dim = 64
block_size = 256

# 8 x 256 = 2,048 tokens per step; 250 steps see 0.51M tokens, over a third of the 1.36M training tokens
batch_size = 8
gradient_accumulation_steps = 1
max_iters = 250
learning_rate = 2e-3  # a short run of a small model tolerates a high learning rate
min_lr = 2e-4
warmup_iters = 30
lr_decay_iters = 250
weight_decay = 0.1
dropout = 0.0  # less than one epoch: nothing to regularise yet

eval_interval = 125
eval_iters = 8
log_interval = 10

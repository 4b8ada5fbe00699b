# State tracking (Deltaformer paper): swaps of n = 5 elements, per-position targets, curriculum from
# length 32 (doubled when held-out accuracy >= 0.99) up to 256; accuracy at 256 and 512 at the end.
#
#   python train.py configs/state_tracking.py                                  # 1-layer Deltaformer
#   python train.py configs/state_tracking.py --deltaformer_kernel=relu --deltaformer_w=q
#   python train.py configs/state_tracking.py --attention=softmax --n_layer=4  # Transformer baseline
#
# The variants bench/run_state_tracking.py trains (overrides of this file):
#   deltaformer_kernel in {softmax, relu, linear} x deltaformer_w in {k, q, proj}, n_layer=1
#   attention=softmax with n_layer in {1, 2, 4}
# All share the width (n_embd 128, 2 heads of 64) and the additive residual. relu / linear kappa score
# unit w and k (ops/deltaformer): with w = k, linear is DeltaNet, beta in (0, 2) up to a reflection.
# Positions come from RoPE only (model.py), so the 512-token evaluation is real extrapolation.
# DAG reachability (the bench's "dag" task): --st_task=dag --st_n_nodes=32 --vocab_size=33 --st_length=93
# --st_curriculum=False --st_eval_lengths=(93,189): 30 edges, a separator, then 32 queries (189: 128).

dataset = "state_tracking"
st_task = "swap"
st_n = 5
st_length = 32
st_curriculum = True
st_curriculum_acc = 0.99
st_max_length = 256
st_eval_lengths = (256, 512)

# model: small vocabulary (10 swap tokens; targets 0..4 reuse the first logits)
vocab_size = 16
block_size = 512  # the longest sequence the model sees (evaluation at 512); RoPE, no learned positions
n_layer = 1
n_embd = 128
n_head = 2
head_dim = 64
residual = "additive"
attention = "deltaformer"
deltaformer_kernel = "softmax"
deltaformer_w = "k"
deltaformer_beta_max = 2.0  # reflections (swaps need them); bounded for linear kappa with w = k (README)

# optimisation: constant learning rate after warmup (the run length is set by a time budget)
batch_size = 64  # linear kappa with w = k passed the curriculum at 64 and stalled at length 32 at 256
learning_rate = 1e-3
min_lr = 1e-3
warmup_iters = 100
lr_decay_iters = 1_000_000
max_iters = 100_000
max_seconds = 0.0  # bench/run_state_tracking.py sets a time budget
weight_decay = 0.0
grad_clip = 1.0

# evaluation: 2 x 256 fixed held-out sequences every 100 iterations (also decides the curriculum)
eval_interval = 100
eval_iters = 2
log_interval = 100
compile = False  # short runs with changing lengths: compilation costs more than it saves
out_dir = "out-state-tracking"

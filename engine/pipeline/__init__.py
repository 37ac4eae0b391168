"""Pipeline parallelism: the world's ranks as stages of consecutive layers, each stage
tensor-parallel (grid.py: who is where, and the torch.distributed groups), which layers and
which checkpoint tensors a stage holds (split.py), and a stage's forward, which moves the
activations between stages point-to-point at the bucket's static shape (stage.py)."""

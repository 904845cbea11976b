"""Training with AMP: the trainer hook and loss scaling, opt levels, master weights, the
overflow check, checkpoints, and distributed agreement (kvstore, Horovod)."""

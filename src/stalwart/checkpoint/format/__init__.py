"""What a checkpoint is: the root's layout and manifest, and training state as a skeleton plus raw tensors."""

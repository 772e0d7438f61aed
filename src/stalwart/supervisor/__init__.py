"""`stalwart run`: the per-node agent on torch.distributed.elastic."""

"""`stalwart ckpt`: listing, verifying, inspecting and exporting checkpoints, for people. Never changes one."""

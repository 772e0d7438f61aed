"""The memory tiers under the durable one: node shared memory (L2) and its copies on peer nodes (L3)."""

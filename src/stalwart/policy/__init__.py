"""When to copy state: intervals chosen from measured costs, never hard-coded per model size."""

"""`stalwart demo`: a small GPT trained on 2 CPU ranks, killed, recovered, and compared with a clean run."""

"""Benchmarks a user can run on their own machine: `stalwart bench checkpoint`."""

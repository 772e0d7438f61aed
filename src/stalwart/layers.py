"""The layers of stalwart, lowest first: the one place their order is written (docs/architecture.md shows it, and
tests/test_house.py holds the code to it).

A module may import from its own layer and the layers below it, never from one above: what sits lower cannot
know what is built on it (the checkpoint path knows nothing of fault injection, the job nothing of the
launcher). Every module may import the package root `stalwart`, the public API a user's script imports (the
scripts that stand in for user code, e.g. demo/train.py, do), and the root may import anything: it is where
the parts are put together (chaos/install.py plugs the fault injectors into the product's seams there).
"""

from __future__ import annotations

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),  # the one exception tree
    ("layers", "runtime"),  # where this process stands: placement, small collectives, environment, seams
    ("telemetry",),  # the event log, goodput, metrics, reports
    ("data", "checkpoint", "policy"),  # sample order; the checkpoint tiers; when to checkpoint and snapshot
    ("detect", "recovery"),  # hangs, numerics, stragglers, divergence, GPUs; restore, rollback, re-forming
    ("job",),  # the training-loop integration: stalwart.Job
    ("integrations",),  # loops stalwart does not own (the HF Trainer), driving the Job's step protocol
    ("supervisor",),  # `stalwart run`: agents, rendezvous, spares, restarts
    ("chaos", "sim", "demo", "bench"),  # tools built on the product: fault injection, simulation, demo, benchmarks
    ("cli", "__main__"),  # the command line
)
"""Each entry one layer (a tuple of top-level modules or packages of `stalwart`), lowest first."""


def rank_of(name: str) -> int:
    """The layer of a top-level module or package of `stalwart` (its index in LAYERS); KeyError if it has none."""
    for index, layer in enumerate(LAYERS):
        if name in layer:
            return index
    raise KeyError(name)

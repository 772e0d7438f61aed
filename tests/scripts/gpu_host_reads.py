"""On a GPU: how many times a step of a one-rank job synchronises the host with the device (issue #32, item 7).

Between saves, with the defaults a step may synchronise once (the numeric guard's read of the gradient norm,
with the reported loss riding along, detect/host_reads.py); with the guard's checks and the loss-spike check
off, never. torch.cuda.set_sync_debug_mode flags every synchronising operation: "warn" counts them per step for
the defaults, "error" makes any one fail the run with the checks off. The loop body itself synchronises nothing
(its input is made on the device before, SGD with foreach, the loss is reported as a tensor).

Run by `bash scripts/gpu_checks.sh sync`; prints one JSON line, exits 1 if a bound is broken.
"""

from __future__ import annotations

import json
import sys
import tempfile
import warnings
from typing import Any

import torch

import stalwart

STEPS = 40
WATCHED = range(5, STEPS - 2)  # after the first steps (the first is logged), before the run's last save


def run(options: dict[str, Any], mode: str) -> list[int]:
    """Synchronising operations per watched step."""
    with tempfile.TemporaryDirectory() as ckpt:
        job = stalwart.Job(ckpt, checkpoint_every=10_000, log_every=10_000, **options)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).cuda()
        optim = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
        job.track(model=model, optim=optim)
        x = torch.randn(256, 1024, device="cuda")
        counts: list[int] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            seen = 0
            for step, _ in job.steps(max_steps=STEPS):
                if step in WATCHED and step - 1 in WATCHED:
                    counts.append(len(caught) - seen)  # the last step's body and its end
                seen = len(caught)
                torch.cuda.set_sync_debug_mode(mode if step in WATCHED else 0)
                loss = model(x).pow(2).mean()
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                job.report(loss=loss)
        torch.cuda.set_sync_debug_mode(0)
        job.close()
        return counts


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    defaults = run({}, "warn")
    off = {"nonfinite_grads": "off", "grad_spike": "off", "loss_spike": "off"}
    error = None
    try:
        checks_off = run(off, "error")
    except RuntimeError as exc:  # a synchronising operation under "error"
        checks_off, error = [], str(exc).splitlines()[0]
    ok = bool(defaults) and max(defaults) <= 1 and error is None
    print(json.dumps({"defaults_syncs_per_step": sorted(set(defaults)), "checks_off_error": error,
                      "checks_off_steps": len(checks_off), "ok": ok}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

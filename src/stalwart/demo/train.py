"""The demo's training script, run by every rank under `stalwart run`. It is also a template: this is all a
user adds to a DDP loop to make it resumable (stalwart.Job, ResumableLoader, track, steps, report)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

import stalwart
from stalwart.demo.model import GPT, GPTConfig
from stalwart.demo.text import CharWindows, encode, load_text


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="directory for checkpoints and the final result")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)  # the same bits on every run is the point of the demo
    job = stalwart.Job(Path(args.out) / "ckpt", checkpoint_every=args.checkpoint_every, log_every=1)

    ids, vocab = encode(load_text())
    split = int(len(ids) * 0.95)
    cfg = GPTConfig(vocab_size=vocab)
    train = CharWindows(ids[:split], cfg.block_size)
    val = CharWindows(ids[split:], cfg.block_size)

    torch.manual_seed(args.seed)
    model = GPT(cfg)
    ddp = DistributedDataParallel(model) if job.world_size > 1 else model
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = max(1, args.steps // 15)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: _lr_scale(s, warmup, args.steps))
    loader = stalwart.ResumableLoader(train, global_batch_size=args.global_batch_size, seed=args.seed)
    job.track(model=model, optim=optim, sched=sched, data=loader)

    if job.is_main:
        n = sum(p.numel() for p in model.parameters())
        print(f"GPT {n:,} parameters, {len(train):,} samples, rank {job.rank} of {job.world_size}", flush=True)
    for step, (x, y) in job.steps(loader, max_steps=args.steps):
        loss = ddp(x, y)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        sched.step()
        job.report(loss=loss.detach())
        if job.is_main and (step + 1) % 50 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)

    if job.is_main:
        _write_result(Path(args.out), model, val)


def _lr_scale(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def _write_result(out: Path, model: GPT, val: CharWindows) -> None:
    model.eval()
    xs, ys = zip(*(val[i] for i in range(0, min(len(val), 64))), strict=True)
    val_loss = model(torch.stack(xs), torch.stack(ys)).item()
    digest = hashlib.sha256()
    params = {}
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
        params[name] = tensor.clone()
    torch.save(params, out / "final_params.pt")
    result = {"final_loss": val_loss, "params_sha256": digest.hexdigest()}
    (out / "result.json").write_text(json.dumps(result))
    print(f"final validation loss {val_loss:.4f}, parameters sha256 {digest.hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()

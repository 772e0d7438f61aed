"""A config module for torchtitan's own Trainer (`-m torchtitan.train --module torchtitan_tiny --config tiny`, this
directory on PYTHONPATH): torchtitan's debug llama3 over synthetic tokens, without tokenizer or dataset files, so
that it runs where nothing can be downloaded (a lent GPU machine: scripts/gpu_checks.sh `titan`; on CPU by hand,
scripts/torchtitan_check.sh). Its data loader records the indices it serves in $TINY_SERVED_LOG (a file per
process); at the Trainer's close each rank's parameters' sha256 goes to $TINY_OUT (train_torchtitan.write_digest);
$TINY_DIE_AT kills rank 1 in a step (`_die_at`).

On a machine without CUDA the module shims what torchtitan reads of the device (its device type is CUDA wherever no
accelerator is found): the device type and module become CPU ones; torch's fake process group is registered
(torchtitan's mesh gives its disabled dimensions one; its GPU runs register it through their imports); flex
attention, which has no backward on CPU, becomes causal SDPA (the same attention with one document a sequence); and
FSDP2 reduces gradients with SUM (gloo has no PREMUL_SUM). On any machine, a torch without
`torch.distributed.set_timeout` (2.13 has none) gets a no-op for it. Not in the suite: torchtitan's Trainer also
needs triton, datasets and tensorboard, which scripts/setup.sh does not install.
"""

from __future__ import annotations

import importlib
import os
import signal
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer
from train_torchtitan import write_digest  # this directory is on PYTHONPATH

VOCAB = 2048
"""The debug model's vocabulary."""


class _CpuDevice(types.SimpleNamespace):
    """What torchtitan calls on its device module, for the CPU."""

    def __init__(self) -> None:
        super().__init__(
            set_device=lambda *a: None,
            current_device=lambda: 0,
            device_count=lambda: 1,
            get_device_name=lambda *a: "cpu",
            get_device_properties=lambda *a: types.SimpleNamespace(total_memory=1 << 34),
            reset_peak_memory_stats=lambda *a: None,
            empty_cache=lambda: None,
            memory_stats=lambda *a: {},
            synchronize=lambda *a: None,
        )


def _shim_for_cpu() -> None:
    if torch.cuda.is_available():
        return
    importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers the "fake" backend
    device = _CpuDevice()
    for name in (
        "torchtitan.tools.utils",
        "torchtitan.components.metrics",
        "torchtitan.distributed.parallel_dims",
        "torchtitan.distributed.utils",
    ):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"  # type: ignore[attr-defined]
        if hasattr(module, "device_module"):
            module.device_module = device  # type: ignore[attr-defined]
        if hasattr(module, "get_local_device"):
            module.get_local_device = lambda: torch.device("cpu")  # type: ignore[attr-defined]
    from torchtitan.models.common.attention import FlexAttention

    def causal_sdpa(self: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """flex attention has no backward on CPU: causal SDPA, the same attention for one document a sequence."""
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=kwargs.get("scale")
        )
        return out.transpose(1, 2)

    FlexAttention.forward = causal_sdpa  # type: ignore[method-assign]

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide = _fsdp_collectives._get_gradient_divide_factors

    def summed(rs: Any, ar: Any, dtype: Any, device: str = "", factor: Any = None, *rest: Any) -> Any:
        """gloo has no PREMUL_SUM (torchtitan's gradient divide factor 1.0 makes FSDP2 ask for it): SUM, then a
        division by that factor, as FSDP2 reduces where a device has no PREMUL_SUM."""
        return divide(rs, ar, dtype, device, factor, True)

    _fsdp_collectives._get_gradient_divide_factors = summed


def _shim_for_this_torch() -> None:
    """torchtitan 0.3 sets its training timeout with `torch.distributed.set_timeout`, which torch 2.13 lacks: the
    timeout stays the set-up's."""
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda *args, **kwargs: None  # type: ignore[attr-defined]


_shim_for_cpu()
_shim_for_this_torch()


class NoTokenizer(BaseTokenizer):
    """The tokens are synthetic: nothing to encode."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, **kwargs: Any) -> None:
        super().__init__()

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        return []

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return ""

    def get_vocab_size(self) -> int:
        return VOCAB


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed random sequences; each index served is appended to $TINY_SERVED_LOG/pid<pid>.txt."""

    def __init__(self, n: int, seq_len: int) -> None:
        self.tokens = torch.randint(0, VOCAB, (n, seq_len + 1), generator=torch.Generator().manual_seed(3))
        log = os.environ.get("TINY_SERVED_LOG")
        self.log = Path(log) if log else None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        if self.log is not None:
            self.log.mkdir(parents=True, exist_ok=True)
            with open(self.log / f"pid{os.getpid()}.txt", "a") as f:
                f.write(f"{i}\n")
        inputs = self.tokens[i, :-1]  # one document a sequence: positions 0.. (flex attention's masks from them)
        return {"input": inputs, "positions": torch.arange(len(inputs))}, self.tokens[i, 1:]


class SyntheticLoader(ParallelAwareDataloader):
    """torchtitan's data loader over `_Tokens`, each rank its slice (a DistributedSampler without shuffling)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        samples: int = 4096

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: Any,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs: Any,
    ) -> None:
        dataset = _Tokens(config.samples, seq_len)
        sampler = torch.utils.data.DistributedSampler(dataset, dp_world_size, dp_rank, shuffle=False, drop_last=True)
        super().__init__(
            dataset,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            batch_size=local_batch_size,
            sampler=sampler,
            snapshot_every_n_steps=snapshot_every_n_steps,
        )


def tiny() -> Trainer.Config:
    """torchtitan's llama3 debug model (flex attention, 2 layers) over synthetic tokens; 30 steps of 4 sequences of
    64 tokens per rank, metrics at every step (its loss check with them), seeded and deterministic."""
    model_spec = model_registry("debugmodel", attn_backend="flex")
    model_spec.model.layers = model_spec.model.layers[:2]  # type: ignore[attr-defined]
    return Trainer.Config(
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        hf_assets_path=".",
        tokenizer=NoTokenizer.Config(),
        model_spec=model_spec,
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear"),
        training=TrainingConfig(local_batch_size=4, seq_len=64, steps=30),
        dataloader=SyntheticLoader.Config(),
        metrics=MetricsProcessor.Config(log_freq=1),
        # DTensor for the model-parallel axes only: FSDP2 as torchtitan applied it before its SPMD types (whose
        # fully_shard path refuses the debug model's plain parameters with torch 2.13).
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        debug=DebugConfig(seed=0, deterministic=True),  # two runs comparable bit for bit
    )


def _digest_at_close() -> None:
    """At the Trainer's close: its step and parameters' digest to $TINY_OUT/rank<RANK>.json."""
    out = os.environ.get("TINY_OUT")
    if not out:
        return
    close = Trainer.close

    def closing(self: Any) -> None:
        [model] = self.model_parts  # no pipeline stages in this config
        write_digest(Path(out), int(os.environ.get("RANK", "0")), self.step, model)
        close(self)

    Trainer.close = closing  # type: ignore[method-assign]


def _die_at() -> None:
    """$TINY_DIE_AT=STEP:PHASE: rank 1 of the first launch SIGKILLs itself in step STEP, as it begins (begin), in
    the model's backward pass (backward) or in the optimizer step (optimizer)."""
    spec = os.environ.get("TINY_DIE_AT", "")
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if not spec or os.environ.get("RANK") != "1" or not first:
        return
    at, _, phase = spec.partition(":")
    train_step = Trainer.train_step
    armed: list[bool] = []

    def die(*args: Any) -> None:
        if armed and armed[0]:
            os.kill(os.getpid(), signal.SIGKILL)

    def dying_train_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not armed:  # the first step: the hooks
            armed.append(False)
            if phase == "backward":
                self.model_parts[0].register_full_backward_hook(die)
            elif phase == "optimizer":
                self.optimizers.optimizers[0].register_step_pre_hook(die)
        armed[0] = self.step == int(at)
        if phase == "begin":
            die()
        return train_step(self, *args, **kwargs)

    Trainer.train_step = dying_train_step  # type: ignore[method-assign]


_digest_at_close()
_die_at()

"""GPU telemetry: where a node's GPU readings come from, one `GpuProvider` per source.

Why apart from detect/gpu.py: the provider is the seam between the hardware and the judgment. The monitor and
its playbook never touch NVML; tests and `stalwart chaos` swap in a scripted provider, so a machine without a
GPU can still exercise every path.

`NvmlProvider` reads NVML through nvidia-ml-py (`pynvml`); a value a device answers "Not Supported" for is
absent (None), never an error (on an H100 with driver 580, retired pages and NVLink state are Not Supported).
`ScriptedProvider` replays a JSON script of samples and XID events at given times. `provider_from_env` picks
one: STALWART_GPU_TELEMETRY=off, =nvml (the default: NVML when it loads, else nothing) or =PATH (a script).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from stalwart.errors import ConfigError
from stalwart.runtime.env import GPU_TELEMETRY_ENV as TELEMETRY_ENV


@dataclass(slots=True)
class GpuSample:
    """One device's readings; None is a value the device does not report (NVML: Not Supported)."""

    index: int
    uuid: str | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    throttle_reasons: list[str] | None = None
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    pcie_replay_total: int | None = None


@dataclass(frozen=True, slots=True)
class XidEvent:
    index: int
    xid: int


class GpuProvider(Protocol):
    """One source of a node's GPU readings, polled by GpuMonitor (detect/gpu.py)."""

    def device_count(self) -> int: ...

    def sample(self, index: int) -> GpuSample: ...

    def xids(self) -> list[XidEvent]:
        """XID events since the last call (without waiting)."""
        ...

    def close(self) -> None: ...


class ScriptedProvider:
    """Replays a JSON script: {"devices": N, "samples": [{"at": seconds, "index": i, ...GpuSample fields}],
    "xids": [{"at": seconds, "index": i, "xid": code}]}. A device's sample is its latest one due by now (seconds
    since the provider was made); an XID is delivered once, at the first call after it is due."""

    def __init__(self, script: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        try:
            self._count = int(script.get("devices", 1))
            self._samples = sorted(script.get("samples", []), key=lambda s: float(s.get("at", 0)))
            self._xids = sorted(script.get("xids", []), key=lambda x: float(x.get("at", 0)))
            fields = set(GpuSample.__dataclass_fields__)
            for s in self._samples:
                unknown = set(s) - fields - {"at"}
                if unknown:
                    raise ConfigError(f"GPU telemetry script: unknown sample fields {sorted(unknown)}")
            self._pending = [XidEvent(int(x["index"]), int(x["xid"])) for x in self._xids]
            self._due = [float(x.get("at", 0)) for x in self._xids]
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"GPU telemetry script: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ScriptedProvider:
        try:
            script = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{TELEMETRY_ENV}: cannot read the GPU telemetry script {path}: {exc}") from exc
        if not isinstance(script, dict):
            raise ConfigError(f"{TELEMETRY_ENV}: {path} is not a JSON object")
        return cls(script)

    def device_count(self) -> int:
        return self._count

    def sample(self, index: int) -> GpuSample:
        now = self._clock() - self._start
        latest: dict[str, Any] = {}
        for s in self._samples:
            if float(s.get("at", 0)) <= now and int(s.get("index", 0)) == index:
                latest = s
        return GpuSample(**{k: v for k, v in latest.items() if k != "at"} | {"index": index})

    def xids(self) -> list[XidEvent]:
        now = self._clock() - self._start
        due = [e for e, at in zip(self._pending, self._due, strict=True) if at <= now]
        keep = [(e, at) for e, at in zip(self._pending, self._due, strict=True) if at > now]
        self._pending, self._due = [e for e, _ in keep], [at for _, at in keep]
        return due

    def close(self) -> None:
        pass


class NvmlProvider:
    """NVML through nvidia-ml-py. Every reading a device answers Not Supported (or any other NVML error) for is
    None; XID events come from an NVML event set, polled without waiting."""

    def __init__(self) -> None:
        import pynvml  # nvidia-ml-py

        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for handle in self._handles:
                pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
        except pynvml.NVMLError:
            self._events = None  # XIDs unavailable (containers without the capability): samples still work
        self._index_of = {self._uuid(h): i for i, h in enumerate(self._handles)}

    def device_count(self) -> int:
        return len(self._handles)

    def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:  # NotSupported and the rest: absent, not an error
            return None

    def _uuid(self, handle: Any) -> str | None:
        value = self._read(self._nvml.nvmlDeviceGetUUID, handle)
        return value.decode() if isinstance(value, bytes) else value

    def sample(self, index: int) -> GpuSample:
        n, h = self._nvml, self._handles[index]
        power = self._read(n.nvmlDeviceGetPowerUsage, h)
        reasons_mask = self._read(_clock_event_reasons(n), h)
        remap = self._read(n.nvmlDeviceGetRemappedRows, h)  # (correctable, uncorrectable, pending, failure)
        pending_pages = self._read(n.nvmlDeviceGetRetiredPagesPendingStatus, h)
        return GpuSample(
            index=index,
            uuid=self._uuid(h),
            temperature_c=self._read(n.nvmlDeviceGetTemperature, h, n.NVML_TEMPERATURE_GPU),
            power_w=power / 1000 if power is not None else None,
            sm_clock_mhz=self._read(n.nvmlDeviceGetClockInfo, h, n.NVML_CLOCK_SM),
            throttle_reasons=_reason_names(n, reasons_mask) if reasons_mask is not None else None,
            ecc_corrected_total=self._read(
                n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_CORRECTED, n.NVML_VOLATILE_ECC
            ),
            ecc_uncorrected_total=self._read(
                n.nvmlDeviceGetTotalEccErrors, h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC
            ),
            retired_pages_pending=bool(pending_pages) if pending_pages is not None else None,
            remapped_rows_correctable=remap[0] if remap is not None else None,
            remapped_rows_uncorrectable=remap[1] if remap is not None else None,
            remapped_rows_pending=bool(remap[2]) if remap is not None else None,
            remapped_rows_failed=bool(remap[3]) if remap is not None else None,
            pcie_replay_total=self._read(n.nvmlDeviceGetPcieReplayCounter, h),
        )

    def xids(self) -> list[XidEvent]:
        found: list[XidEvent] = []
        if self._events is None:
            return found
        while True:
            try:
                data = self._nvml.nvmlEventSetWait(self._events, 0)
            except self._nvml.NVMLError:  # a timeout: nothing more now
                return found
            uuid = self._uuid(data.device)
            found.append(XidEvent(self._index_of.get(uuid, -1), int(data.eventData)))

    def close(self) -> None:
        try:
            if self._events is not None:
                self._nvml.nvmlEventSetFree(self._events)
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def _clock_event_reasons(n: Any) -> Callable[..., Any]:
    """nvmlDeviceGetCurrentClocksEventReasons (newer drivers' name) or ...ThrottleReasons."""
    return getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or n.nvmlDeviceGetCurrentClocksThrottleReasons


_REASON_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake": 0x80,
    "display_clocks": 0x100,
}
"""NVML's clocks-event (throttle) reason bits (nvml.h: nvmlClocksEventReason*)."""


def _reason_names(_: Any, mask: int) -> list[str]:
    return [name for name, bit in _REASON_BITS.items() if mask & bit]


def nvml_device_count() -> int:
    """GPUs NVML sees (0 without nvidia-ml-py, a driver or a GPU), without creating a CUDA context."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
    except Exception:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:
        return 0
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def provider_from_env(env: dict[str, str] | None = None) -> GpuProvider | None:
    """The provider STALWART_GPU_TELEMETRY asks for: "off", "nvml" (the default: None when NVML cannot be
    loaded, e.g. no GPU or no driver) or the path of a script for ScriptedProvider."""
    value = (env if env is not None else os.environ).get(TELEMETRY_ENV, "nvml").strip()
    if value in ("off", "0", ""):
        return None
    if value == "nvml":
        try:
            return NvmlProvider()
        except Exception:  # no nvidia-ml-py, no driver, no GPU: nothing to watch
            return None
    return ScriptedProvider.from_file(value)


def sample_dict(sample: GpuSample) -> dict[str, Any]:
    return {k: v for k, v in asdict(sample).items() if v is not None}

"""GPU telemetry: where a node's GPU readings come from, one `GpuProvider` per source.

Why apart from detect/gpu.py: the provider is the seam between the hardware and the judgment. The monitor and
its playbook never touch NVML; tests and `stalwart chaos` swap in a scripted provider, so a machine without a
GPU can still exercise every path.

`NvmlProvider` reads NVML through nvidia-ml-py (`pynvml`); a value a device answers "Not Supported" for is
absent (None), never an error (on an H100 with driver 580, retired pages and NVLink state are Not Supported).
`ScriptedProvider` replays a JSON script of samples and XID events at given times, and reads its file again
when it changes (`add_to_script`: a fault at a chosen step of a run). `provider_from_env` picks one:
STALWART_GPU_TELEMETRY=off, =nvml (the default: NVML when it loads, else nothing) or =PATH (a script).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
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
    "xids": [{"at": seconds, "index": i, "xid": code}]}. `at` counts from when the provider was made. A device's
    sample is its latest one due by now (of those due at the same `at`, the later in the script); an XID is
    delivered once, at the first call after it is due.

    Made from a file, it reads the file again when it changes (one stat per call). That lets a test or the chaos
    harness bring a fault at a chosen training step: once the job has logged that step, it adds the entry with
    `at` 0, due at once. A time guessed in advance races with the workers' start under load, and a warning raised
    before a worker started is not news to it (detect/risk.py). Writers replace the file whole (`write_script`);
    a file that does not read as a script (half written by a writer that does not) leaves the previous script in
    force, and is read again at the next call. An XID delivered stays delivered across re-reads (an entry of the
    same `at`, index and code is that XID).
    """

    def __init__(self, script: dict[str, Any], clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._start = clock()
        self._path: str | os.PathLike[str] | None = None
        """The file the script came from (from_file), read again when it changes."""
        self._stamp: tuple[int, int, int] | None = None
        self._delivered: Counter[tuple[float, int, int]] = Counter()
        """(at, index, xid) of every XID delivered, counted: a re-read script's entries that match are not due."""
        self._load(script)

    def _load(self, script: dict[str, Any]) -> None:
        """Take `script` as the one in force; a ConfigError leaves the previous one (all checks come first)."""
        try:
            count = int(script.get("devices", 1))
            samples = sorted(script.get("samples", []), key=lambda s: float(s.get("at", 0)))
            xids = sorted(
                ((float(x.get("at", 0)), int(x["index"]), int(x["xid"])) for x in script.get("xids", [])),
                key=lambda x: x[0],
            )
            fields = set(GpuSample.__dataclass_fields__)
            for s in samples:
                unknown = set(s) - fields - {"at"}
                if unknown:
                    raise ConfigError(f"GPU telemetry script: unknown sample fields {sorted(unknown)}")
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"GPU telemetry script: {exc}") from exc
        delivered = Counter(self._delivered)
        pending = []
        for key in xids:
            if delivered[key]:
                delivered[key] -= 1
            else:
                pending.append(key)
        self._count, self._samples, self._pending = count, samples, pending

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], clock: Callable[[], float] = time.monotonic) -> ScriptedProvider:
        try:
            stamp = _stamp(path)  # before the read: a change between the two is read again at the first call
        except OSError as exc:
            raise ConfigError(f"{TELEMETRY_ENV}: cannot read the GPU telemetry script {path}: {exc}") from exc
        provider = cls(_read_script(path), clock)
        provider._path, provider._stamp = path, stamp
        return provider

    def _reread(self) -> None:
        """Take the file's script if the file changed since the last read (its inode, mtime and size: a writer's
        rename changes the inode even within one mtime tick)."""
        if self._path is None:
            return
        try:
            stamp = _stamp(self._path)
            if stamp == self._stamp:
                return
            self._load(_read_script(self._path))
        except (OSError, ConfigError):
            return  # gone for a moment, or half written: the previous script stays, the next call tries again
        self._stamp = stamp

    def device_count(self) -> int:
        self._reread()
        return self._count

    def sample(self, index: int) -> GpuSample:
        self._reread()
        now = self._clock() - self._start
        latest: dict[str, Any] = {}
        for s in self._samples:
            if float(s.get("at", 0)) <= now and int(s.get("index", 0)) == index:
                latest = s
        return GpuSample(**{k: v for k, v in latest.items() if k != "at"} | {"index": index})

    def xids(self) -> list[XidEvent]:
        self._reread()
        now = self._clock() - self._start
        due = [x for x in self._pending if x[0] <= now]
        self._pending = [x for x in self._pending if x[0] > now]
        self._delivered.update(due)
        return [XidEvent(index, xid) for _, index, xid in due]

    def close(self) -> None:
        pass


def _stamp(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def _read_script(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        script = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{TELEMETRY_ENV}: cannot read the GPU telemetry script {path}: {exc}") from exc
    if not isinstance(script, dict):
        raise ConfigError(f"{TELEMETRY_ENV}: {path} is not a JSON object")
    return script


def write_script(path: str | os.PathLike[str], script: dict[str, Any]) -> None:
    """Write a GPU telemetry script whole: to a file beside it, renamed over it. A provider replaying it may read
    it at any moment, and a rename is atomic, so it reads the old script or the new one, never half of one."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps(script))
    os.replace(temporary, target)


def add_to_script(
    path: str | os.PathLike[str],
    samples: Sequence[dict[str, Any]] = (),
    xids: Sequence[dict[str, Any]] = (),
) -> None:
    """Append samples and XID events to the script at `path` (`write_script`), for a fault at a chosen moment of a
    run: with `at` 0 they are due at once to a provider replaying it. One writer at a time (read, then replace)."""
    script = _read_script(path)
    script["samples"] = [*script.get("samples", []), *samples]
    script["xids"] = [*script.get("xids", []), *xids]
    write_script(path, script)


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

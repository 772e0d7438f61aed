"""GPU health: telemetry from NVML (or a scripted fake), judged into events, and the XID playbook.

Why: a GPU usually announces its failure before it takes a job down: correctable ECC errors climb, rows wait
to be remapped, the clocks throttle for heat or power, the driver logs an XID. A job that reads these signals
can checkpoint before the failure and take the node out of service after it, instead of crashing into the same
bad GPU again at the next restart.

Providers: `NvmlProvider` reads NVML through nvidia-ml-py (`pynvml`); a value a device answers "Not Supported"
for is absent (None), never an error (on an H100 with driver 580, retired pages and NVLink state are Not
Supported). `ScriptedProvider` replays a JSON script of samples and XID events at given times, for tests and
for `stalwart chaos`: a machine without a GPU can still exercise every path. `provider_from_env` picks one:
STALWART_GPU_TELEMETRY=off, =nvml (the default: NVML when it loads, else nothing) or =PATH (a script).

Each sample is exported under the names DCGM exporter users know (`DCGM_METRICS`), and `GpuMonitor` turns
samples and XIDs into events: `gpu_xid` (with the playbook's meaning and action), `gpu_throttled` (thermal or
power slowdown), `gpu_ecc_errors` (uncorrectable errors, or correctable ones rising), `gpu_rows_remap`
(pending or failed row remapping). The playbook's actions follow NVIDIA's XID catalog.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from stalwart.errors import ConfigError
from stalwart.runtime.env import GPU_TELEMETRY_ENV as TELEMETRY_ENV
from stalwart.telemetry.events import EventLog

RESTART_PROCESS = "restart_process"
"""An application-level error: restarting the process on that GPU (re-forming) is enough."""
RESET_GPU = "reset_gpu"
"""The GPU needs a reset before it can be trusted again: its processes must go, and the node should not take
work until the reset (here: the node is excluded until someone clears it)."""
DRAIN_NODE = "drain_node"
"""Take the node out of service and investigate (reboot, diagnostics)."""
REPLACE_HARDWARE = "replace_hardware"
"""A hardware fault: the GPU or node needs repair."""
REPORT = "report"
"""Informational, or the follow-on of another error: recorded, no action by itself."""

ACTIONS = (REPORT, RESTART_PROCESS, RESET_GPU, DRAIN_NODE, REPLACE_HARDWARE)
"""From least to most severe."""


@dataclass(frozen=True, slots=True)
class XidRule:
    meaning: str
    action: str


XID_PLAYBOOK: dict[int, XidRule] = {
    13: XidRule("graphics engine exception (often an application's illegal access)", RESTART_PROCESS),
    31: XidRule("GPU memory page fault (an application's illegal address)", RESTART_PROCESS),
    32: XidRule("invalid or corrupted push buffer stream (mostly PCIe quality)", RESTART_PROCESS),
    38: XidRule("driver firmware error (FECS watchdog timeout)", REPORT),
    43: XidRule("GPU stopped processing (the application faulted; the GPU stays healthy)", REPORT),
    45: XidRule("preemptive cleanup after an earlier error", REPORT),
    46: XidRule("GPU stopped processing (GPU timeout)", RESET_GPU),
    48: XidRule("double-bit ECC error", RESET_GPU),
    54: XidRule("auxiliary power is not connected to the GPU board", DRAIN_NODE),
    56: XidRule("display engine error (unused on data-center GPUs)", REPORT),
    57: XidRule("error programming video memory interface (unused on current GPUs)", REPORT),
    58: XidRule("unstable video memory interface detected (unused on current GPUs)", REPORT),
    61: XidRule("internal micro-controller breakpoint or warning", RESET_GPU),
    62: XidRule("internal micro-controller halt", RESET_GPU),
    63: XidRule("ECC page retirement or row remapping recorded", REPORT),
    64: XidRule("ECC page retirement or row remapping failed", RESET_GPU),
    68: XidRule("video decoder (NVDEC) exception", RESTART_PROCESS),
    69: XidRule("graphics engine class error", RESTART_PROCESS),
    74: XidRule("NVLink error", RESET_GPU),
    79: XidRule("GPU has fallen off the bus", DRAIN_NODE),
    92: XidRule("high single-bit ECC error rate", REPORT),
    94: XidRule("contained ECC error (the application that used the memory must restart)", RESTART_PROCESS),
    95: XidRule("uncontained ECC error (every application on the GPU is affected)", RESET_GPU),
    109: XidRule("context switch timeout", RESET_GPU),
    110: XidRule("security fault error", RESET_GPU),
    119: XidRule("GSP RPC timeout", RESET_GPU),
    120: XidRule("GSP error", RESET_GPU),
    121: XidRule("C2C link corrected error", REPORT),
    122: XidRule("SPI PMU RPC read failure (unused on current GPUs)", REPORT),
    123: XidRule("SPI PMU RPC write failure", RESET_GPU),
    136: XidRule("link training failed", RESET_GPU),
    140: XidRule("unrecovered ECC error", RESET_GPU),
    143: XidRule("GPU initialization failure", RESET_GPU),
    144: XidRule("NVLink SAW error", RESET_GPU),
    145: XidRule("NVLink RLW error", RESET_GPU),
    146: XidRule("NVLink TLW error", RESET_GPU),
    147: XidRule("NVLink TREX error", RESET_GPU),
    148: XidRule("NVLink NVLPW control error", RESET_GPU),
    149: XidRule("NVLink NETIR error", RESET_GPU),
    150: XidRule("NVLink MSE error", RESET_GPU),
    151: XidRule("key rotation error (confidential computing: the VM must restart)", DRAIN_NODE),
    154: XidRule("GPU recovery action changed (the message says reset or reboot)", RESET_GPU),
    155: XidRule("NVLink SW defined error", RESET_GPU),
    156: XidRule("resource retirement event", RESET_GPU),
    158: XidRule("GPU fatal timeout", RESET_GPU),
    171: XidRule("uncorrectable DRAM error", RESET_GPU),
    172: XidRule("uncorrectable SRAM error", RESET_GPU),
}
"""XID -> meaning and action, after NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors, the "Xid Catalog"
spreadsheet), checked on 2026-11-24 against three copies built from it (NVIDIA/NVSentinel's
xiderrorsmapping.csv, leptonai/gpud's catalog_generated.go, and a YAML with the catalog's action definitions).
The catalog's first action maps onto ours: RESTART_APP -> restart_process, RESET_GPU -> reset_gpu, RESTART_BM
-> drain_node, IGNORE -> report. Where it says "Unused" (56-58, 122) the code is reported; 61 and 123 keep
NVIDIA's older debug guidance (reset); 154 carries the action in its message, which an NVML XID event does not:
reset_gpu, which here excludes the node like a drain. Codes whose action depends on sub-codes in the message
(NVLink 144-150) take the catalog's fatal case. An XID not listed is reported with the action REPORT."""


def playbook(xid: int) -> XidRule:
    return XID_PLAYBOOK.get(xid, XidRule(f"XID {xid} (not in stalwart's playbook)", REPORT))


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


DCGM_METRICS: dict[str, str] = {
    "temperature_c": "DCGM_FI_DEV_GPU_TEMP",
    "power_w": "DCGM_FI_DEV_POWER_USAGE",
    "sm_clock_mhz": "DCGM_FI_DEV_SM_CLOCK",
    "ecc_corrected_total": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "ecc_uncorrected_total": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "retired_pages_pending": "DCGM_FI_DEV_RETIRED_PENDING",
    "remapped_rows_correctable": "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "remapped_rows_uncorrectable": "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "remapped_rows_pending": "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "remapped_rows_failed": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "pcie_replay_total": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
}
"""GpuSample field -> the DCGM exporter's metric name (XIDs: DCGM_FI_DEV_XID_ERRORS, the last XID's code)."""


def dcgm_metrics(sample: GpuSample) -> dict[str, float]:
    """A sample under DCGM exporter names (absent values left out; booleans as 0/1)."""
    out: dict[str, float] = {}
    for name, metric in DCGM_METRICS.items():
        value = getattr(sample, name)
        if value is not None:
            out[metric] = float(value)
    return out


@dataclass(frozen=True, slots=True)
class XidEvent:
    index: int
    xid: int


class GpuProvider(Protocol):
    def device_count(self) -> int: ...

    def sample(self, index: int) -> GpuSample: ...

    def xids(self) -> list[XidEvent]:
        """XID events since the last call (without waiting)."""
        ...

    def close(self) -> None: ...


SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake")
"""Throttle reasons that are a health sign (not the power cap or idle clocks a busy GPU meets normally)."""


@dataclass
class _DeviceState:
    corrected: int | None = None
    uncorrected: int | None = None
    throttled: bool = False
    remap: str | None = None


@dataclass
class GpuMonitor:
    """Turns samples and XIDs into events. `act(index, action, reason)` is called for every XID whose action is
    more than REPORT and for failed row remapping; what it does is the caller's (the agent's) business."""

    provider: GpuProvider
    events: EventLog
    act: Callable[[int, str, str], None] = lambda index, action, reason: None
    warn: Callable[[int, str], None] = lambda index, reason: None
    """Called with each warning sign (slowdown begins, uncorrected or fast-rising ECC errors, rows pending
    remapping): the agent asks its workers for a checkpoint (detect/risk.py)."""
    corrected_per_poll: int = 100
    """Correctable ECC errors between two polls that count as rising."""
    _devices: dict[int, _DeviceState] = field(default_factory=dict)

    def poll(self) -> list[GpuSample]:
        samples = [self.provider.sample(i) for i in range(self.provider.device_count())]
        for sample in samples:
            self._judge(sample)
        for event in self.provider.xids():
            rule = playbook(event.xid)
            self.events.emit("gpu_xid", gpu=event.index, xid=event.xid, meaning=rule.meaning, action=rule.action)
            if rule.action != REPORT:
                self.act(event.index, rule.action, f"XID {event.xid}: {rule.meaning}")
        return samples

    def _judge(self, s: GpuSample) -> None:
        d = self._devices.setdefault(s.index, _DeviceState())
        slow = sorted(set(s.throttle_reasons or ()) & set(SLOWDOWN_REASONS))
        if bool(slow) != d.throttled:
            d.throttled = bool(slow)
            self.events.emit("gpu_throttled", gpu=s.index, throttled=d.throttled, reasons=slow,
                             temperature_c=s.temperature_c, sm_clock_mhz=s.sm_clock_mhz)  # fmt: skip
            if d.throttled:
                self.warn(s.index, f"slowdown ({', '.join(slow)})")
        if s.ecc_uncorrected_total is not None:
            if d.uncorrected is not None and s.ecc_uncorrected_total > d.uncorrected:
                new = s.ecc_uncorrected_total - d.uncorrected
                self.events.emit("gpu_ecc_errors", gpu=s.index, kind="uncorrected", new=new,
                                 total=s.ecc_uncorrected_total)  # fmt: skip
                self.warn(s.index, f"{new} new uncorrected ECC errors")
            d.uncorrected = s.ecc_uncorrected_total
        if s.ecc_corrected_total is not None:
            if d.corrected is not None and s.ecc_corrected_total - d.corrected >= self.corrected_per_poll:
                new = s.ecc_corrected_total - d.corrected
                self.events.emit("gpu_ecc_errors", gpu=s.index, kind="corrected_rising", new=new,
                                 total=s.ecc_corrected_total)  # fmt: skip
                self.warn(s.index, f"corrected ECC errors rising ({new} since the last poll)")
            d.corrected = s.ecc_corrected_total
        remap = "failed" if s.remapped_rows_failed else "pending" if s.remapped_rows_pending else None
        if remap != d.remap:
            d.remap = remap
            if remap is not None:
                self.events.emit("gpu_rows_remap", gpu=s.index, state=remap,
                                 uncorrectable=s.remapped_rows_uncorrectable)  # fmt: skip
                if remap == "failed":
                    self.act(s.index, DRAIN_NODE, "row remapping failed")
                else:
                    self.warn(s.index, "rows pending remapping (a reset will apply them)")


# -- providers ---------------------------------------------------------------------------------------------------


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

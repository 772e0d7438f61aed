"""GPU health: telemetry judged into events, and the XID playbook.

Why: a GPU usually announces its failure before it takes a job down: correctable ECC errors climb, rows wait
to be remapped, the clocks throttle for heat or power, the driver logs an XID. A job that reads these signals
can checkpoint before the failure and take the node out of service after it, instead of crashing into the same
bad GPU again at the next restart.

Where the readings come from (NVML, or a scripted fake for tests and `stalwart chaos`) is
detect/gpu_providers.py's business; this module judges them. Each sample is exported under the names DCGM
exporter users know (`DCGM_METRICS`), and `GpuMonitor` turns samples and XIDs into events: `gpu_xid` (with the
playbook's meaning and action), `gpu_throttled` (thermal or power slowdown), `gpu_ecc_errors` (uncorrectable
errors, or correctable ones rising), `gpu_rows_remap` (pending or failed row remapping). The playbook's actions
follow NVIDIA's XID catalog.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stalwart.detect.gpu_providers import GpuProvider, GpuSample
from stalwart.detect.gpu_providers import NvmlProvider as NvmlProvider
from stalwart.detect.gpu_providers import ScriptedProvider as ScriptedProvider
from stalwart.detect.gpu_providers import provider_from_env as provider_from_env
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
            self.events.emit(
                "gpu_throttled",
                gpu=s.index,
                throttled=d.throttled,
                reasons=slow,
                temperature_c=s.temperature_c,
                sm_clock_mhz=s.sm_clock_mhz,
            )
            if d.throttled:
                self.warn(s.index, f"slowdown ({', '.join(slow)})")
        if s.ecc_uncorrected_total is not None:
            if d.uncorrected is not None and s.ecc_uncorrected_total > d.uncorrected:
                new = s.ecc_uncorrected_total - d.uncorrected
                self.events.emit(
                    "gpu_ecc_errors", gpu=s.index, kind="uncorrected", new=new, total=s.ecc_uncorrected_total
                )
                self.warn(s.index, f"{new} new uncorrected ECC errors")
            d.uncorrected = s.ecc_uncorrected_total
        if s.ecc_corrected_total is not None:
            if d.corrected is not None and s.ecc_corrected_total - d.corrected >= self.corrected_per_poll:
                new = s.ecc_corrected_total - d.corrected
                self.events.emit(
                    "gpu_ecc_errors", gpu=s.index, kind="corrected_rising", new=new, total=s.ecc_corrected_total
                )
                self.warn(s.index, f"corrected ECC errors rising ({new} since the last poll)")
            d.corrected = s.ecc_corrected_total
        remap = "failed" if s.remapped_rows_failed else "pending" if s.remapped_rows_pending else None
        if remap != d.remap:
            d.remap = remap
            if remap is not None:
                self.events.emit(
                    "gpu_rows_remap", gpu=s.index, state=remap, uncorrectable=s.remapped_rows_uncorrectable
                )
                if remap == "failed":
                    self.act(s.index, DRAIN_NODE, "row remapping failed")
                else:
                    self.warn(s.index, "rows pending remapping (a reset will apply them)")

"""Every environment variable between the launcher and its workers, in one place.

`stalwart run` sets the STALWART_* ones for its workers (a user may set a few by hand, as noted); torch elastic
sets the TORCHELASTIC_* ones and torchrun's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. The modules
that read a variable re-export its name from here.
"""

from __future__ import annotations

# -- set by `stalwart run` for every worker ---------------------------------------------------------------------
AGENT_PID_ENV = "STALWART_AGENT_PID"
"""PID of the `stalwart run` process that started this worker (a worker dies with it)."""
EVENT_LOG_ENV = "STALWART_EVENT_LOG"
"""Path of the JSONL event log shared by the agent, the workers and their persisters; a user may set it."""
HEARTBEAT_ENV = "STALWART_HEARTBEAT"
"""Path of the agent's heartbeat board in /dev/shm."""
QUIET_ENV = "STALWART_QUIET"
"""1 (`stalwart run --quiet`; a user may set it): rank 0 prints no start or progress lines (job/progress.py)."""
HANG_TIMEOUT_ENV = "STALWART_HANG_TIMEOUT"
"""Seconds, or "auto" (the default): `stalwart run --hang-timeout`."""
LAUNCH_TIME_ENV = "STALWART_LAUNCH_TIME"
"""Wall-clock seconds (time.time()) when `stalwart run` started: the age from which checkpoint_every="auto"
estimates the failure rate."""
SNAPSHOT_DIR_ENV = "STALWART_SNAPSHOT_DIR"
"""The node's shared-memory directory for the memory tier."""
REFORM_ENV = "STALWART_REFORM"
"""1 when survivors re-form in place (the default; `--no-reform` sets 0)."""
IN_LOOP_ENV = "STALWART_IN_LOOP"
"""1 (the default under re-forming; `stalwart run --reform-by-rerun` sets 0): survivors re-form inside their
training loop (recovery/in_loop/) instead of running the script again."""
WAIT_FOR_REPLACEMENT_ENV = "STALWART_WAIT_FOR_REPLACEMENT"
"""1 (`stalwart run --wait-for-replacement`): after a failure the survivors wait for the replacement instead of
training on shrunk meanwhile (recovery/shrink.py); the job then ends bitwise identical to a run without it."""
KEPT_RANKS_ENV = "STALWART_KEPT_RANKS"
"""Set by the agents in a re-formed round: the global ranks whose processes were kept (survivors), of every node, as
"0,2"; the others are replacements starting (recovery/shrink.py)."""
SHRUNK_STORE_ENV = "STALWART_SHRUNK_STORE"
"""Set with KEPT_RANKS_ENV in a re-formed round of several nodes: "host:port/token", the rendezvous store every
node reaches and the round's token, under which the survivors form their own group and the replacements say they
are ready (recovery/shrink.py; supervisor/round_kept.py). Absent on one node: files on the node serve."""
ELASTIC_ENV = "STALWART_ELASTIC"
"""1 under `stalwart run --nnodes MIN:MAX` (MIN < MAX): the world size may change between restarts."""
MIRRORS_ENV = "STALWART_MIRRORS"
"""Locations, one per line, where the job's checkpoints are also kept (`stalwart run --mirror`): a Job's `mirrors`
when the script gives none (checkpoint/save/mirroring.py)."""
FAILOVER_ENV = "STALWART_FAILOVER_S"
"""Seconds (`stalwart run --failover-s`): a Job's `failover_s` when the script gives none
(checkpoint/save/failover.py)."""
SPARES_ENV = "STALWART_SPARES"
"""The default of `stalwart run --spares`."""
WARM_SPARES_ENV = "STALWART_WARM_SPARES"
"""1: the default of `stalwart run --warm-spares`."""
WARM_SPARE_ENV = "STALWART_WARM_SPARE"
"""1 in a warm spare's run of the script: its Job parks at `job.steps()` until it is given a rank
(recovery/warm_spare.py)."""

# -- between the agent and a host process (supervisor/) ----------------------------------------------------------
HOST_STATUS_FD_ENV = "STALWART_HOST_FD"
"""The descriptor on which a host process reports to its agent (supervisor/host_protocol.py)."""
HOST_WARM_ENV = "STALWART_HOST_WARM"
"""1 for a hot spare: import torch and take a first optimizer step before waiting."""

ZYGOTE_ENV = "STALWART_ZYGOTE"
"""0: start worker hosts as new interpreters instead of forking them from the zygote (supervisor/zygote.py)."""
PRELOAD_ENV = "STALWART_PRELOAD"
"""Modules the zygote imports for the script, comma-separated, as `stalwart run --preload` (supervisor/preload.py)."""

# -- set by a user or a test ---------------------------------------------------------------------------------------
FAULTS_ENV = "STALWART_FAULTS"
"""Fault injection by (rank, step): chaos/faults.py."""
THREADED_SIDE_COPY_ENV = "STALWART_TEST_THREADED_SIDE_COPY"
"""Set to 1 (tests only): CPU memory-tier snapshots copy the tracked optimizers' tensors on a thread, as a GPU
copies them on a side stream, so the overlapped path's protocol runs where no GPU exists (save/side_copy.py)."""

# -- torch's -------------------------------------------------------------------------------------------------------
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
"""Set by torch elastic when workers share the agent's store (torchrun's default) instead of rank 0 hosting one."""
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""1 (stalwart run's default): each restart's workers get a fresh store hosted by rank 0."""
NCCL_ERRORS_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""2 under in-loop re-forming unless the user set it (torch's CleanUpOnly): NCCL's watchdog aborts a failed
communicator and the collective's wait raises, which the re-formable group absorbs, instead of the default of
tearing the process down (recovery/in_loop/)."""
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
"""Set to "lo" on a one-node run so gloo listens on loopback only."""
GPU_TELEMETRY_ENV = "STALWART_GPU_TELEMETRY"
"""The agent's GPU telemetry: "nvml" (the default; nothing when NVML cannot load), "off", or the path of a scripted
provider's JSON (detect/gpu_providers.py)."""
GPU_POLL_ENV = "STALWART_GPU_POLL_S"
"""Seconds between two GPU telemetry polls of the agent (default 5)."""
EXCLUDE_FILE_ENV = "STALWART_EXCLUDE_FILE"
"""The node exclusion list (supervisor/exclusion.py); default ~/.stalwart/excluded-nodes.json."""
NODE_NAME_ENV = "STALWART_NODE_NAME"
"""The node's name as its scheduler knows it, where the host name is not (a Kubernetes pod's host name is the
pod's: deploy/kubernetes sets it from spec.nodeName); the exclusion list and its suggestions use it."""
NODE_FAULTS_ENV = "STALWART_NODE_FAULTS"
"""Faults of the node itself for the pre-flight check, for tests: 'bad_memory' (chaos/node_faults.py)."""
PREFLIGHT_ENV = "STALWART_PREFLIGHT"
"""`stalwart run --preflight`'s default: auto, on or off."""
METRICS_PORT_ENV = "STALWART_METRICS_PORT"
"""`stalwart run --metrics-port`'s default: serve the run's Prometheus metrics on this port (0: any free one)."""
PREEMPT_NOTICE_ENV = "STALWART_PREEMPT_NOTICE"
"""The default of `stalwart run --preempt-notice` (a metadata URL or file:PATH)."""
PREEMPT_POLL_ENV = "STALWART_PREEMPT_POLL_S"
"""Seconds between two polls of the preemption notice (supervisor/preempt_notice.py)."""

# -- the ones that ask for fault injection -------------------------------------------------------------------------
FAULT_ENVS = (FAULTS_ENV, NODE_FAULTS_ENV, THREADED_SIDE_COPY_ENV)
"""Any of these set (not empty) asks for fault injection in this process and, as its environment is inherited, in
the processes it starts: runtime/seams.py then has chaos/'s injectors installed. With none of them, `import
stalwart` imports no module of chaos/ and installs nothing (a save request that carries faults still asks for
them, see seams.installed)."""

"""A warm spare host: a node waiting in the rendezvous runs the script's set-up before it is admitted.

Why: on several nodes an agent beyond `--nnodes` waits on torch's redundancy list; when a training node is lost it
is admitted at once, but its workers then start and run the script's whole set-up while the survivors wait (minutes
at scale; the tiny job's 0.3 s in tests/test_multinode.py). With `--spares N --warm-spares` such a node warms one
spare per local rank while it waits: warm spares (recovery/warm_spare.py) run the script up to `job.steps()` and
park; once admitted, the agent gives them the round's ranks (supervisor/agent.py takes spares for the ranks it
lacks) and they join the survivors with their state. A spare whose FSDP2 modules were sharded as another rank shards
them again in place (recovery/in_loop/late_join.py), and a ResumableLoader takes the given rank's slice.

What a waiting agent lacks is a worker's activation to run the script with: no round has given it one. Every agent
that starts a round's workers publishes the activation of its last local rank in the rendezvous store (torch
elastic's part of the environment, which is the same on every node but for the node's own ranks, and the argv);
a waiting agent reads it at each poll of the rendezvous (supervisor/rendezvous.py calls `while_waiting`) and
runs its spares with it over its own environment. Nothing is published or read on one node.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from stalwart.runtime.process import first_line, say
from stalwart.runtime.torch_compat_rendezvous import waits_as_spare
from stalwart.supervisor.host_pool import SparePool

KEY = "stalwart/warm_template"
_THIS_HOST_ONLY = frozenset({"TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_TIMER_FILE", "CUDA_VISIBLE_DEVICES"})
"""What torch elastic may set for a worker that belongs to the publishing host: paths there, its devices."""


class SpareHost:
    """This node's side: publish the activation of the rounds it starts, and warm its spares while it waits."""

    def __init__(self, pool: SparePool | None, nproc: int, argv: list[str]) -> None:
        self.store: Any = None  # the rendezvous store, once supervisor/rendezvous.py made it
        self.handler: Any = None  # the rendezvous handler, whose last read state says whether this node is a spare
        self._pool = pool
        self._nproc = nproc
        self._argv = argv  # this node's own: the script and its arguments as given to its `stalwart run`
        self._target = pool.target if pool is not None else 0
        self._warming = False
        self._admitted = False  # once part of a round, never a spare again (its survivors are kept by the agent)

    @property
    def enabled(self) -> bool:
        return self._pool is not None and self._pool.warm_script

    def publish(self, torch_env: dict[str, str]) -> None:
        """A round's activation of this node's last local rank: `torch_env` is what torch elastic set for it (no
        host's own environment; a spare node runs its own argv). Best effort: a spare node that cannot read it
        starts its workers when it is admitted, as before."""
        if not self.enabled:
            return
        env = {k: v for k, v in torch_env.items() if k not in _THIS_HOST_ONLY}
        with contextlib.suppress(Exception):
            self.store.set(KEY, json.dumps({"env": env}))

    def while_waiting(self) -> None:
        """At each poll of a rendezvous this agent waits in: while it waits as a spare node (on the redundancy list
        of a round it is not part of) and a round's activation is published, keep one warm spare per local rank,
        running the script's set-up with it (SparePool does the rest). An agent waiting to re-form a round it was
        part of, or for the job's first round, warms nothing."""
        try:
            self._warm()
        except Exception as exc:  # never the rendezvous's failure: this node's spares stay as they are
            self.admitted()
            self._pool = None
            say(
                f"stalwart: this spare node cannot warm its spares while it waits ({first_line(exc)}); its workers "
                "start when it is admitted"
            )

    def _warm(self) -> None:
        pool = self._pool
        if pool is None or not pool.warm_script or self._admitted:
            return
        if not self._warming:
            if not waits_as_spare(self.handler):
                return
            env = self._template()
            if env is None:
                return
            pool.remember(self._argv, {**os.environ, **env})
            pool.target = max(self._target, self._nproc)
            pool.schedule_refill(0.0)
            self._warming = True
        pool.maintain()

    def admitted(self) -> None:
        """The agent left the rendezvous with a round (after its spares went to the round's ranks): the pool keeps
        `--spares` from now on, those beyond it end, and this node warms nothing while it waits again."""
        self._admitted = True
        if self._pool is not None and self._warming:
            self._pool.target = self._target
            self._pool.trim()
            self._warming = False

    def _template(self) -> dict[str, str] | None:
        try:
            if not self.store.check([KEY]):
                return None
            found = json.loads(self.store.get(KEY))
            return {str(k): str(v) for k, v in found["env"].items() if k not in _THIS_HOST_ONLY}
        except Exception:  # the store gone or a value not ours: nothing to warm with
            return None

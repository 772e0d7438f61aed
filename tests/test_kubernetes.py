"""The Kubernetes recipe (deploy/kubernetes/stalwart-job.yaml, docs/schedulers.md), checked offline: against
Kubernetes' own schemas (kubernetes-validate, strict), against `stalwart run`'s parser, and for the few values
that must agree across its two resources. Node exclusion names the node, not the pod, and suggests the cordon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import stalwart
from stalwart.supervisor import exclusion, run_args

MANIFEST = Path(__file__).parent.parent / "deploy" / "kubernetes" / "stalwart-job.yaml"
VERSIONS = ("1.29.0", "1.31.0", "1.33.0")
"""backoffLimitPerIndex is beta from 1.29 (on by default) and GA in 1.33."""


def _resources() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_manifest_is_valid_kubernetes(version: str) -> None:
    resources = _resources()
    assert sorted(resources) == ["Job", "Service"]
    for doc in resources.values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_a_mistake_in_the_manifest_is_caught_by_the_same_check() -> None:
    job = _resources()["Job"]
    job["spec"]["completionMod"] = job["spec"].pop("completionMode")  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, VERSIONS[-1], strict=True)


def test_the_manifests_parts_agree_and_its_command_is_stalwart_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    resources = _resources()
    service, job = resources["Service"], resources["Job"]
    pod = job["spec"]["template"]
    [container] = pod["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["stalwart", "run"]
    script = tmp_path / command[-1]
    script.write_text("")
    for key in [k for k in os.environ if k.startswith(("SLURM_", "PET_"))]:
        monkeypatch.delenv(key)
    args = run_args.parse([*command[2:-1], str(script)])  # the flags are stalwart run's, and valid together
    name = service["metadata"]["name"]
    assert pod["spec"]["subdomain"] == name and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert args.rdzv_endpoint == f"{job['metadata']['name']}-0.{name}:{service['spec']['ports'][0]['port']}"
    assert args.nnodes.split(":")[-1] == str(job["spec"]["completions"]) == str(job["spec"]["parallelism"])
    assert str(args.nproc_per_node) == str(container["resources"]["limits"]["nvidia.com/gpu"])
    assert args.preempt_grace_s < pod["spec"]["terminationGracePeriodSeconds"], "the last checkpoint fits the grace"
    shm = [v for v in pod["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert [m["mountPath"] for m in container["volumeMounts"] if m["name"] == shm[0]["name"]] == ["/dev/shm"]
    names = {e["name"]: e for e in container["env"]}
    assert names["STALWART_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_an_excluded_node_is_named_as_the_scheduler_knows_it_with_the_commands_to_keep_it_off(tmp_path: Path) -> None:
    path = tmp_path / "excluded.json"
    env = {**os.environ, "STALWART_EXCLUDE_FILE": str(path), "STALWART_NODE_NAME": "gke-pool-a-17"}
    code = "from stalwart.supervisor import exclusion; exclusion.exclude('GPU 3: XID 79', 'drain_node')"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    assert list(json.loads(path.read_text())["nodes"]) == ["gke-pool-a-17"], "the node, not the pod's host name"
    out = stalwart("nodes", "list", env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "kubectl cordon gke-pool-a-17" in out.stdout
    assert 'scontrol update NodeName=gke-pool-a-17 State=DRAIN Reason="stalwart: GPU 3: XID 79"' in out.stdout
    as_json = stalwart("nodes", "list", "--json", env=env, timeout=60)
    [entry] = json.loads(as_json.stdout)
    assert entry["suggested"] == exclusion.scheduler_commands(exclusion.listed(path)[0])

"""A command's bad flag, its help and its usage errors are answered before torch is imported: `import torch` costs
3-5 s of CPU on the 2-core VM, which a user who mistyped a flag should not wait for (and each such test paid).
`stalwart run` is the exception: its parser is torchrun's, which lives in torch.distributed.run."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import child_env

COMMANDS = [
    ["bench", "--bogus"],
    ["bench", "recovery", "--kill-rank", "2"],
    ["bench", "recovery", "--setup-s", "five"],
    ["bench", "overhead", "--bogus"],
    ["bench", "checkpoint", "--size", "tiny"],
    ["bench", "reshard", "--help"],
    ["bench", "handover", "--sizes", "tiny"],
    ["chaos", "--bogus"],
    ["chaos"],
    ["ckpt", "list"],
    ["ckpt", "inspect", "--rank", "one", "somewhere"],
    ["demo", "--bogus"],
    ["preflight", "--bogus"],
    ["report", "--bogus"],
    ["sim", "--bogus"],
    ["nodes", "--bogus"],
    ["--version"],
    ["bogus"],
]

_SCRIPT = """
import contextlib, io, json, sys
from stalwart.cli import main

answers = []
for argv in json.loads(sys.argv[1]):
    sys.argv = ["stalwart", *argv]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main()
        except SystemExit as exc:
            code = exc.code
    answers.append({"argv": argv, "code": code, "torch": "torch" in sys.modules, "err": err.getvalue()})
print(json.dumps(answers))
"""


def test_every_command_but_run_answers_a_bad_flag_without_importing_torch() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(COMMANDS)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert [a["argv"] for a in answers] == COMMANDS
    for a in answers:
        assert not a["torch"], f"stalwart {' '.join(a['argv'])} imported torch before answering"
        if a["argv"][-1] != "--help" and a["argv"] != ["--version"]:
            assert a["code"] == 2 and a["err"].strip(), a  # an error, said
    [version] = [a for a in answers if a["argv"] == ["--version"]]
    assert version["code"] == 0, version

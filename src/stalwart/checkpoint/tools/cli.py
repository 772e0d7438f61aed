"""`stalwart ckpt list|verify|inspect|export|status PATH`: a checkpoint directory, for people; never changes it.
`stalwart ckpt sync PATH DEST`: its committed checkpoints copied to another location, verified there (tools/sync.py).
`status PATH MIRROR...`: each location's newest committed step, how far it is behind PATH, whether it verifies."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from stalwart.checkpoint.format import layout
from stalwart.checkpoint.storage import Storage, describe_error
from stalwart.errors import CheckpointCorruptError, CheckpointMismatchError, ConfigError, StalwartError
from stalwart.runtime.args import pointing_to
from stalwart.telemetry.console import console

EXIT_INVALID = 1


_Parser = pointing_to("stalwart ckpt")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stalwart ckpt", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    ls = sub.add_parser("list", help="every checkpoint: committed, interrupted, quarantined")
    vf = sub.add_parser("verify", help="check every shard and tensor (size, xxh3, format); exit 1 if any fails")
    vf.add_argument("--step", type=int, help="only this step (default: every committed checkpoint)")
    ins = sub.add_parser("inspect", help="what a checkpoint holds: manifest, tracked objects, tensors, bytes")
    ins.add_argument("--step", type=int, help="the step (default: the newest committed)")
    ins.add_argument("--rank", type=int, default=0, help="whose shard to summarize (default 0)")
    ex = sub.add_parser("export", help="write a checkpoint in torch.distributed.checkpoint (DCP) format")
    ex.add_argument("--to", required=True, help="a new (or empty) directory for the DCP checkpoint")
    ex.add_argument("--step", type=int, help="the step (default: the newest committed)")
    ex.add_argument("--rank", type=int, default=0, help="whose shard to export (default 0; under DDP all are equal)")
    sy = sub.add_parser(
        "sync", help="copy the committed checkpoints to another location (a mirror), verified there; resumable"
    )
    st = sub.add_parser(
        "status", help="each location's newest committed step, how far it is behind the first, whether it verifies"
    )
    sy.add_argument("--step", type=int, help="only this step (default: every committed checkpoint)")
    sy.add_argument(
        "--verify", action="store_true", help="also check the steps the destination holds already; repair any that fail"
    )
    for sp in (ls, vf, ins, ex, sy, st):
        sp.add_argument("path", help="the checkpoint directory or URL (a Job's checkpoint_dir, e.g. s3://bucket/run)")
        sp.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    sy.add_argument("destination", help="where the copy goes: empty, or a stalwart checkpoint directory or URL")
    st.add_argument("mirrors", nargs="*", help="the job's mirrors (paths or URLs), compared with PATH")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except StalwartError:
        raise
    except Exception as exc:  # an I/O error of any store (OSError, botocore, aiohttp): one line, not a traceback
        raise ConfigError(f"{args.path}: {describe_error(exc)}") from exc


def _dispatch(args: argparse.Namespace) -> int:
    # Here, not at the top: torch comes with them, and a bad flag is answered before (seconds of start-up).
    from stalwart.checkpoint.tools import inspect

    root = inspect.open_root(args.path)
    if args.command == "list":
        return _list(root, args.json)
    if args.command == "verify":
        return _verify(root, args.step, args.json)
    if args.command == "export":
        return _export(root, args.step, args.rank, Path(args.to), args.json)
    if args.command == "status":
        return _status(root, args.mirrors, args.json)
    if args.command == "sync":
        return _sync(root, args.destination, args.step, args.verify, args.json)
    return _inspect(root, args.step, args.rank, args.json)


def _committed(root: Storage, step: int | None) -> list[int]:
    steps = layout.committed_steps(root)
    if step is None:
        return steps
    if step not in steps:
        raise ConfigError(
            f"{root.display()} has no committed checkpoint at step {step} (committed: {sorted(steps) or 'none'})"
        )
    return [step]


def _list(root: Storage, as_json: bool) -> int:
    from stalwart.checkpoint.tools import inspect

    entries = inspect.list_entries(root)
    if as_json:
        rows = [
            {
                "step": e.step,
                "status": e.status,
                "path": e.path,
                "world_size": e.world_size,
                "bytes": e.bytes,
                "written_bytes": e.written_bytes,
                "kind": e.kind or None,
                "created": e.created,
                "problem": e.problem,
            }
            for e in entries
        ]
        print(json.dumps({"path": root.display(), "checkpoints": rows}))
        return 0
    table = Table(title=f"checkpoints in {root.display()}")
    for column in ("step", "status", "kind", "ranks", "state bytes", "written", "created", "note"):
        table.add_column(column, justify="right" if column in ("step", "ranks", "state bytes", "written") else "left")
    for e in entries:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.created)) if e.created else ""
        table.add_row(
            str(e.step),
            e.status,
            e.kind,
            str(e.world_size or ""),
            f"{e.bytes:,}" if e.bytes else "",
            f"{e.written_bytes:,}" if e.status == "committed" else "",
            created,
            e.problem or (e.path.rsplit("/", 1)[-1] if e.status == "quarantined" else ""),
        )
    console().print(table if entries else f"{root.display()}: no checkpoints")
    return 0


def _verify(root: Storage, step: int | None, as_json: bool) -> int:
    from stalwart.checkpoint.tools import inspect

    results = {s: inspect.verify(root, s) for s in _committed(root, step)}
    if as_json:
        print(json.dumps({"path": root.display(), "checkpoints": {str(s): p for s, p in results.items()}}))
    else:
        out = console()
        if not results:
            out.print(f"{root.display()}: no committed checkpoints")
        for s, problems in results.items():
            verdict = ("ok", "green") if not problems else ("FAILED", "red")
            out.print(Text.assemble(f"step {s}: ", verdict, "" if not problems else f" ({len(problems)})"))
            for problem in problems:
                out.print(f"  {problem}", highlight=False)
    return EXIT_INVALID if any(results.values()) else 0


def _inspect(root: Storage, step: int | None, rank: int, as_json: bool) -> int:
    from stalwart.checkpoint.tools import inspect

    steps = _committed(root, step)
    if not steps:
        raise ConfigError(f"{root.display()} has no committed checkpoint to inspect")
    try:
        manifest, summary = inspect.summarize(root, steps[0], rank)
    except (CheckpointCorruptError, CheckpointMismatchError, OSError) as exc:
        raise ConfigError(f"cannot inspect step {steps[0]}: {exc} (see 'stalwart ckpt verify')") from exc
    objects = summary["objects"]
    state_bytes, written = manifest.state_bytes, manifest.written_bytes
    if as_json:
        print(
            json.dumps(
                {
                    "path": root.display(),
                    "step": manifest.step,
                    "world_size": manifest.world_size,
                    "created": manifest.created,
                    "kind": "full" if manifest.base is None else "delta",
                    "base": manifest.base,
                    "state_bytes": state_bytes,
                    "written_bytes": written,
                    "bytes_saved": state_bytes - written,
                    "tensors": len(manifest.tensors),
                    "shards": [{"meta": r.meta, "bytes": r.bytes, "xxh3": r.xxh3} for r in manifest.ranks],
                    "rank": rank,
                    "objects": {
                        k: {"tensors": o.tensors, "bytes": o.bytes, "dtypes": sorted(o.dtypes), "content": o.content}
                        for k, o in objects.items()
                    },
                }
            )
        )
        return 0
    out = console()
    kind = "full checkpoint" if manifest.base is None else f"delta of step {manifest.base}"
    saved = (
        f", {state_bytes - written:,} bytes saved ({state_bytes / max(written, 1):.1f}x fewer)"
        if written < state_bytes
        else ""
    )
    out.print(
        f"step {manifest.step} in {root.display()}: {kind}, {manifest.world_size} ranks, {len(manifest.tensors)} "
        f"tensors, {state_bytes:,} bytes of state, {written:,} bytes written{saved}; created "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(manifest.created))}",
        highlight=False,
    )
    table = Table(title=f"rank {rank}'s state")
    for column in ("object", "tensors", "bytes", "dtypes", "content"):
        table.add_column(column, justify="right" if column in ("tensors", "bytes") else "left")
    for name, o in objects.items():
        table.add_row(name, str(o.tensors), f"{o.bytes:,}", ", ".join(sorted(o.dtypes)), o.content)
    out.print(table)
    return 0


def _export(root: Storage, step: int | None, rank: int, out: Path, as_json: bool) -> int:
    from stalwart.checkpoint.tools.export import export_dcp

    steps = _committed(root, step)
    if not steps:
        raise ConfigError(f"{root.display()} has no committed checkpoint to export")
    try:
        result = export_dcp(root, steps[0], rank, out)
    except (CheckpointCorruptError, CheckpointMismatchError, OSError) as exc:
        raise ConfigError(f"cannot export step {steps[0]}: {exc} (see 'stalwart ckpt verify')") from exc
    if as_json:
        print(json.dumps(result))
    else:
        console().print(
            f"exported step {result['step']} (rank {rank}: {', '.join(result['objects'])}) to {out} in DCP format",
            highlight=False,
        )
    return 0


def _sync(root: Storage, destination: str, step: int | None, verify: bool, as_json: bool) -> int:
    from stalwart.checkpoint.storage import open_storage
    from stalwart.checkpoint.tools.sync import sync

    dst = open_storage(destination)
    if dst.display() == root.display():
        raise ConfigError(f"{destination} is the checkpoint directory itself; give another location")
    started = time.monotonic()
    say = (lambda line: None) if as_json else console().print
    copies = sync(root, dst, _committed(root, step), say, verify=verify)
    failed = [c for c in copies if c.problem]
    if as_json:
        rows = [
            {"step": c.step, "files": c.files, "bytes": c.bytes, "seconds": c.seconds, "already": c.already}
            | ({"problem": c.problem} if c.problem else {})
            for c in copies
        ]
        print(json.dumps({"path": root.display(), "destination": dst.display(), "steps": rows}))
    else:
        copied = sum(c.bytes for c in copies)
        console().print(
            f"{len(copies) - len(failed)} of {len(copies)} checkpoints in {dst.display()}, {copied:,} bytes copied "
            f"in {time.monotonic() - started:.1f} s" + (f"; {len(failed)} did not verify there" if failed else ""),
            highlight=False,
        )
    return EXIT_INVALID if failed else 0


def _status(root: Storage, mirrors: list[str], as_json: bool) -> int:
    """Each location's newest committed step, its lag behind the first location (steps and seconds between their
    commits), and whether that step verifies there. Exit 1 when one does not, or one has none."""
    from stalwart.checkpoint.tools import inspect

    rows: list[dict[str, Any]] = []
    for i, where in enumerate([root.display(), *mirrors]):
        try:
            storage = root if i == 0 else inspect.open_root(where)
            steps = layout.committed_steps(storage)
            newest = layout.read_manifest(storage, steps[0]) if steps else None
        except Exception as exc:  # a mirror that cannot be read is a row, not the end of the command
            problem = str(exc) if isinstance(exc, StalwartError) else describe_error(exc)
            rows.append({"location": where, "step": None, "problem": problem})
            continue
        if newest is None:
            rows.append({"location": where, "step": None, "problem": "no committed checkpoint"})
            continue
        problems = inspect.verify(storage, newest.step)
        rows.append(
            {"location": where, "step": newest.step, "created": newest.created, "problem": "; ".join(problems[:1])}
        )
    first = rows[0]
    for row in rows:
        if row.get("step") is not None and first.get("step") is not None:
            row["steps_behind"] = first["step"] - row["step"]
            row["seconds_behind"] = max(0.0, first["created"] - row["created"])
    if as_json:
        print(json.dumps({"locations": rows}))
    else:
        table = Table(title="checkpoint locations")
        for column in ("location", "newest step", "behind", "verifies"):
            table.add_column(column, justify="right" if column == "newest step" else "left")
        for row in rows:
            behind = (
                ""
                if "steps_behind" not in row
                else f"{row['steps_behind']} steps, {row['seconds_behind']:.0f} s"
                if row is not first
                else "-"
            )
            verdict = Text("ok", "green") if not row["problem"] else Text(row["problem"], "red")
            table.add_row(row["location"], str(row["step"] if row["step"] is not None else ""), behind, verdict)
        console().print(table)
    return EXIT_INVALID if any(row["problem"] for row in rows) else 0

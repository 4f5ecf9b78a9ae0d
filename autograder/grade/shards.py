"""Grade a class in shards, on several machines, and merge the shards into one set of grades.

    kit grade SUBMISSIONS --out shard1 --shard 1/3 --secret run.json   # on machine 1 (and 2/3, 3/3)
    kit grade merge shard1 shard2 shard3 --out grades [--gradescope]  # anywhere, afterwards

``--shard I/N`` grades the I-th of N slices of the submissions: a student's slice is fixed by a
hash of the student's name (never by the order or the number of the other submissions), so a
re-run, a resumed run or the same command on another machine grades the same students. Every shard
must use the same run secret (its seed draws the checks' data; its key signs the records): give
every shard the same ``--secret FILE`` (created, mode 0600, by whichever shard starts first) or the
same ``--seed``. Each shard writes, beside its signed records, a signed manifest
(``.kit-grade/shard.json``): the whole class in input order, its own students, the lessons and the
seed.

``kit grade merge`` reads the shards' manifests and records, each verified with its folder's key,
and refuses, naming what is wrong, when a shard is missing or given twice, the shards disagree (the
class, the lessons, the seed), or a student's record is missing, unsigned or altered. Otherwise it
writes ``records/``, ``grades.csv``, ``nbgrader-grades.csv``, ``feedback/`` and (``--gradescope``)
``gradescope/``: the files one unsharded run with the same seed writes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autograder.grade.batch import _sign, load_records, write_atomic
from autograder.grade.submissions import Submission, safe_name

__all__ = ["MergeError", "ShardError", "merge_shards", "parse_shard", "shard_of", "shared_secret",
           "write_manifest"]

MANIFEST = "shard.json"


class ShardError(ValueError):
    """A --shard or --secret that cannot be used; the message names the fix."""


class MergeError(ValueError):
    """Shards that do not merge into one run's grades; the message names each problem."""


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/3"`` -> ``(2, 3)``: the 2nd of 3 slices, counted from 1.

    Raises:
        ShardError: not two integers ``I/N`` with ``1 <= I <= N``.
    """
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ShardError(f"--shard {text!r}: write it I/N, e.g. --shard 1/4 for the first of 4 "
                         "slices") from None
    if not 1 <= i <= n:
        raise ShardError(f"--shard {text}: I must be between 1 and N (1/{n} to {n}/{n})")
    return i, n


def shard_of(student: str, n: int) -> int:
    """The slice (1..n) ``student`` falls in: a hash of the name alone, stable on every machine."""
    return int(hashlib.sha256(student.encode("utf-8")).hexdigest(), 16) % n + 1


def select(subs: list[Submission], shard: tuple[int, int]) -> list[Submission]:
    """The submissions of slice ``shard = (i, n)``, in their input order."""
    i, n = shard
    return [s for s in subs if shard_of(s.student, n) == i]


def shared_secret(path: Path) -> dict[str, Any]:
    """The run secret in ``path`` (``{"seed", "key"}``), created there (mode 0600) if absent.

    Several shards may start at once: the file appears whole or not at all (written aside, then
    linked into place, which fails if another shard won), so every shard reads the same secret.

    Raises:
        ShardError: the file exists but is not a run secret.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"seed": secrets.randbelow(2**31), "key": secrets.token_hex(32)}, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # atomic, and refuses to replace a secret another shard wrote
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        secret = json.loads(path.read_text(encoding="utf-8"))
        if not (isinstance(secret.get("seed"), int) and bytes.fromhex(secret["key"])):
            raise ValueError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ShardError(f"--secret {path} is not a run secret (a JSON {{\"seed\", \"key\"}} that "
                         "kit grade writes): give the file the first shard created, or a new "
                         "path") from None
    return {"seed": secret["seed"], "key": secret["key"]}


def write_manifest(out: Path, key: str, shard: tuple[int, int], everyone: list[Submission],
                   mine: list[Submission], lessons: list[int], seed: int) -> None:
    """``out/.kit-grade/shard.json``: what this shard was asked to grade, signed with ``key``."""
    manifest = {"shard": shard[0], "of": shard[1], "students": [s.student for s in everyone],
                "mine": [s.student for s in mine], "lessons": list(lessons), "seed": seed}
    manifest["hmac"] = _sign(manifest, key)
    write_atomic(out / ".kit-grade" / MANIFEST, json.dumps(manifest, indent=1))


@dataclass
class _Student:
    """What write_outputs reads of a submission: its name."""

    student: str


def _read_shard(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(manifest, secret) of one shard folder, the manifest verified with the folder's key."""
    state = folder / ".kit-grade"
    try:
        secret = json.loads((state / "secret.json").read_text(encoding="utf-8"))
        manifest = json.loads((state / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise MergeError(f"{folder} is not a shard's output folder (no readable .kit-grade/"
                         f"{MANIFEST} and secret.json): grade it with kit grade ... --out "
                         f"{folder} --shard I/N first") from None
    if not (isinstance(manifest, dict) and isinstance(secret, dict)
            and hmac.compare_digest(str(manifest.get("hmac", "")),
                                    _sign(manifest, str(secret.get("key"))))):
        raise MergeError(f"{folder}: its shard manifest is not signed by its run's key (altered, "
                         "or copied from another run): grade that shard again")
    return manifest, secret


def merge_shards(folders: list[Path], out: Path, *, gradescope: bool = False,
                 progress: Any = None) -> dict[str, dict[str, Any]]:
    """Merge shard output folders into ``out``; returns every record by student. ``progress``
    (a :class:`kit.output.Progress` over the shards) hears of each shard once its records are read.

    Raises:
        MergeError: naming each missing or repeated shard, disagreement between shards, and every
            student whose record is missing, unsigned or altered. Nothing is written then.
    """
    from autograder.grade.batch import run_secret
    from autograder.grade.reports import write_outputs

    shards = [(Path(f), *_read_shard(Path(f))) for f in folders]
    problems: list[str] = []
    first = shards[0][1]
    for folder, manifest, _ in shards[1:]:
        for field, what in (("of", "the number of shards"), ("students", "the class"),
                            ("lessons", "the lessons"), ("seed", "the seed")):
            if manifest[field] != first[field]:
                problems.append(f"{folder} and {shards[0][0]} disagree on {what} ({field}: "
                                f"{_short(manifest[field])} vs {_short(first[field])}): grade "
                                "every shard with the same submissions, --lessons and --secret (or "
                                "--seed)")
    n = first["of"]
    given: dict[int, list[Path]] = {}
    for folder, manifest, _ in shards:
        given.setdefault(manifest["shard"], []).append(folder)
    missing = [i for i in range(1, n + 1) if i not in given]
    if missing:
        problems.append("missing shard(s) " + ", ".join(f"{i}/{n}" for i in missing)
                        + ": grade them (kit grade ... --shard I/N) and give their folders too")
    for i, where in sorted(given.items()):
        if len(where) > 1:
            problems.append(f"shard {i}/{n} given {len(where)} times: "
                            + ", ".join(map(str, where)))
    records: dict[str, dict[str, Any]] = {}
    for folder, manifest, secret in shards:
        signed = load_records(folder, str(secret["key"]))
        for student in manifest["mine"]:
            record = signed.get(student)
            if record is None:
                problems.append(f"{student} (shard {manifest['shard']}/{n}, {folder}): no record, "
                                "or one that is unsigned or altered: grade that shard again (it "
                                "resumes and regrades only what is not recorded)")
            elif (record.get("seed") != manifest["seed"]
                  or record.get("lessons") != manifest["lessons"]):
                problems.append(f"{student} (shard {manifest['shard']}/{n}): its record was graded "
                                "with another seed or other lessons than its shard")
            else:
                records[student] = record
        if progress is not None:
            progress.update(f"shard {manifest['shard']}/{n} read: "
                            f"{len(manifest['mine'])} record(s)")
    if not problems and set(records) != set(first["students"]):
        unplaced = sorted(set(first["students"]) - set(records))
        problems.append("students in no shard's list: " + ", ".join(unplaced))
    if problems:
        raise MergeError("refusing to merge:\n  " + "\n  ".join(problems))
    keys = {str(secret["key"]) for _, _, secret in shards}
    secret = run_secret(out, first["seed"])
    if len(keys) == 1:  # one shared secret: the merged folder keeps it
        secret["key"] = keys.pop()
        write_atomic(out / ".kit-grade" / "secret.json", json.dumps(secret), mode=0o600)
    (out / "records").mkdir(parents=True, exist_ok=True)
    for student, record in records.items():
        record = dict(record)
        record["hmac"] = _sign(record, secret["key"])
        records[student] = record
        write_atomic(out / "records" / f"{safe_name(student)}.json", json.dumps(record, indent=1))
    write_outputs(out, [_Student(s) for s in first["students"]], records, gradescope=gradescope)
    return records


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def main_merge(argv: list[str]) -> int:
    """``kit grade merge SHARD_DIR... --out DIR [--gradescope]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="kit grade merge",
                                     description="Merge the output folders of kit grade --shard "
                                                 "I/N.")
    parser.add_argument("shards", nargs="+", metavar="SHARD_DIR", help="every shard's --out folder")
    parser.add_argument("--out", required=True, help="the merged output folder")
    parser.add_argument("--gradescope", action="store_true",
                        help="also write gradescope/<student>/results.json")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if any(out.resolve() == Path(f).resolve() for f in args.shards):
        print(f"kit grade merge: --out {out} is one of the shards: give the merge a folder of its "
              "own",
              file=sys.stderr)
        return 2
    from kit.output import Progress

    bar = Progress(len(args.shards), sys.stderr, width=20)
    try:
        records = merge_shards([Path(f) for f in args.shards], out, gradescope=args.gradescope,
                               progress=bar)
    except MergeError as e:
        bar.close()
        print(f"kit grade merge: {e}", file=sys.stderr)
        return 2
    bar.close()
    scores = [r["score"] for r in records.values()]
    print(f"merged {len(args.shards)} shard(s): {len(records)} submission(s), mean score "
          f"{sum(scores) / max(1, len(scores)):.3g}; wrote {out / 'grades.csv'}")
    return 0

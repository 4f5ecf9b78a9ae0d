"""kit grade --shard I/N and kit grade merge: a class graded in slices equals one unsharded run.

The slices are fixed by a hash of each student's name; every shard shares one run secret (a file
the first shard creates); the merge verifies every shard's signed manifest and records and refuses,
naming the problem, a missing or repeated shard, shards that disagree, and a missing or altered
record, writing nothing then.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from grading_corpus import write_corpus
from grading_support import need_grading_sandbox
from hypothesis import given, settings
from hypothesis import strategies as st

from autograder.grade import shards
from autograder.grade.notebook import main as grade_main
from autograder.grade.submissions import Submission

STUDENTS = ["correct", "stub", "cell_deleted", "syntax_error", "function_renamed"]


def test_parse_shard_takes_i_of_n_and_names_the_form_otherwise():
    assert shards.parse_shard("2/3") == (2, 3)
    for bad in ("3", "0/2", "3/2", "a/b", "1/2/3"):
        with pytest.raises(shards.ShardError, match="--shard"):
            shards.parse_shard(bad)


@settings(max_examples=30, deadline=None)
@given(names=st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=30, unique=True),
       n=st.integers(1, 6))
def test_every_student_is_in_exactly_one_slice_fixed_by_the_name_alone(names, n):
    subs = [Submission(name) for name in names]
    slices = [shards.select(subs, (i, n)) for i in range(1, n + 1)]
    assert sorted(s.student for part in slices for s in part) == sorted(names)
    for i, part in enumerate(slices, start=1):  # input order kept; the others do not matter
        assert [s.student for s in part] == [s for s in names if shards.shard_of(s, n) == i]


def test_the_shared_secret_is_created_once_and_read_back_the_same(tmp_path):
    path = tmp_path / "run.json"
    first = shards.shared_secret(path)
    assert shards.shared_secret(path) == first and path.stat().st_mode & 0o777 == 0o600
    path.write_text("{}")
    with pytest.raises(shards.ShardError, match="not a run secret"):
        shards.shared_secret(path)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """The corpus graded once unsharded and once as 2 shards sharing a secret, then merged."""
    need_grading_sandbox()
    root = tmp_path_factory.mktemp("shards")
    write_corpus(root / "subs", root / "full", STUDENTS)
    common = [str(root / "subs"), "--lessons", "00", "--workers", "2", "--gradescope"]
    for i in (1, 2):
        assert grade_main([*common, "--out", str(root / f"shard{i}"), "--shard", f"{i}/2",
                           "--secret", str(root / "run.json")]) == 0
    seed = json.loads((root / "run.json").read_text())["seed"]
    assert grade_main([*common, "--out", str(root / "full"), "--seed", str(seed)]) == 0
    assert grade_main(["merge", str(root / "shard1"), str(root / "shard2"), "--out",
                       str(root / "merged"), "--gradescope"]) == 0
    return root


def _files(folder: Path) -> dict[str, str]:
    # Which rank reports a crash first, and how long it took, differ between any two runs, sharded
    # or not: "rank N" and Gradescope's execution_time are not compared.
    return {str(p.relative_to(folder)): re.sub(r'"execution_time": [\d.]+', "", re.sub(
                r"rank \d+", "rank N", p.read_text()))
            for p in sorted(folder.rglob("*"))
            if p.is_file() and p.suffix in {".csv", ".txt", ".json"} and "records" not in p.parts
            and ".kit-grade" not in p.parts}


def test_a_merge_reports_its_progress_as_plain_lines_in_a_log(graded, tmp_path, capsys):
    assert grade_main(["merge", str(graded / "shard1"), str(graded / "shard2"), "--out",
                       str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err  # not a terminal: one line per shard
    assert "[  1/2] shard 1/2 read:" in err and "[  2/2] shard 2/2 read:" in err, err


def test_the_merged_shards_write_exactly_what_one_unsharded_run_writes(graded):
    full, merged = _files(graded / "full"), _files(graded / "merged")
    assert "grades.csv" in full and "gradescope/correct/results.json" in full
    assert merged["grades.csv"] == full["grades.csv"]  # every score, exactly
    assert merged == full
    mine = [json.loads((graded / f"shard{i}" / ".kit-grade" / "shard.json").read_text())["mine"]
            for i in (1, 2)]
    assert sorted(mine[0] + mine[1]) == sorted(STUDENTS) and mine[0] and mine[1]


def _merge(graded, *folders, capsys) -> tuple[int, str]:
    out = graded / "refused"
    code = grade_main(["merge", *map(str, folders), "--out", str(out)])
    assert not out.exists() or not (out / "grades.csv").exists()
    return code, capsys.readouterr().err


def test_a_missing_or_repeated_shard_is_refused_by_name(graded, capsys):
    code, err = _merge(graded, graded / "shard1", capsys=capsys)
    assert code == 2 and "missing shard(s) 2/2" in err, err
    code, err = _merge(graded, graded / "shard1", graded / "shard1", capsys=capsys)
    assert code == 2 and "shard 1/2 given 2 times" in err and "missing shard(s) 2/2" in err, err
    code, err = _merge(graded, graded / "subs", capsys=capsys)
    assert code == 2 and "is not a shard's output folder" in err, err


def test_an_altered_record_or_manifest_is_refused_naming_the_student(graded, tmp_path, capsys):
    import shutil

    copy = tmp_path / "shard2"
    shutil.copytree(graded / "shard2", copy)
    student = json.loads((copy / ".kit-grade" / "shard.json").read_text())["mine"][0]
    record_path = next(p for p in (copy / "records").glob("*.json")
                       if json.loads(p.read_text())["student"] == student)
    record = json.loads(record_path.read_text())
    record["score"] = record["max_score"]  # a raised grade, without the key to sign it
    record_path.write_text(json.dumps(record))
    code, err = _merge(graded, graded / "shard1", copy, capsys=capsys)
    assert code == 2 and f"{student} (shard 2/2" in err and "unsigned or altered" in err, err
    manifest = json.loads((copy / ".kit-grade" / "shard.json").read_text())
    manifest["mine"] = manifest["mine"][1:]  # drop a student from the shard's list
    (copy / ".kit-grade" / "shard.json").write_text(json.dumps(manifest))
    code, err = _merge(graded, graded / "shard1", copy, capsys=capsys)
    assert code == 2 and "not signed by its run's key" in err, err


def test_shards_graded_with_different_secrets_are_refused(graded, tmp_path, capsys):
    other = tmp_path / "other"
    assert (
        grade_main(
            [
                str(graded / "subs"),
                "--lessons",
                "00",
                "--out",
                str(other),
                "--shard",
                "2/2",
                "--secret",
                str(tmp_path / "another.json"),
            ]
        )
        == 0
    )
    code, err = _merge(graded, graded / "shard1", other, capsys=capsys)
    assert code == 2 and "disagree on the seed" in err, err


def test_secret_and_seed_together_are_refused(tmp_path, capsys):
    write_corpus(tmp_path / "subs", tmp_path / "out", ["stub"])
    code = grade_main([str(tmp_path / "subs"), "--out", str(tmp_path / "out"), "--secret",
                       str(tmp_path / "s.json"), "--seed", "3"])
    assert code == 2 and "not both" in capsys.readouterr().err

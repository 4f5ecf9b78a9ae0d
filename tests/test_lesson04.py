"""Lesson 04's checks can pass and can fail: solutions pass, stubs and seeded bugs fail.

Also proves the lesson's claims against trusted references independently of the checks: the
solutions' gradients equal torch's own DistributedDataParallel on a small transformer for
world sizes 1-4 and several bucket caps (hypothesis), the bucket plan keeps its contract for
any cap, no_sync accumulation equals one large batch, and the lesson runs headless.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from case_support import failed_cases
from conftest import ROOT, seeded_bugs
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, pass_with_spawned_ranks, printed_text, run_headless
from torch.nn import functional as F

from autograder import course
from autograder.checking import NOT_IMPLEMENTED, run_checks
from autograder.lesson04 import MIB
from autograder.references.lesson04 import bucket_plan
from autograder.registry import get_task, lesson_tasks
from kit.launcher import run_ranks
from kit.lessons.models import AwkwardNet, TinyTransformer, token_batch

LESSON = 4
BUGS = seeded_bugs(LESSON)
SOURCE = course.lesson(LESSON).source
STUDENT = course.lesson(LESSON).notebook
TASK_IDS = ["4.1", "4.2", "4.3", "4.4"]


def test_no_sync_stub_on_a_finished_bucketed_ddp_says_task_4_4(solution):
    base = solution.BucketedDDP.__mro__[1]  # the Task 4.3 class, before no_sync was added

    class BucketedDDP(base):
        def no_sync(self):
            raise NotImplementedError("Task 4.4: Add no_sync()")

    report = run_checks("4.4", BucketedDDP)
    assert report.status == NOT_IMPLEMENTED
    assert "Task 4.4: Add no_sync()" in report.cases[0].message


def test_summing_instead_of_averaging_is_named_in_the_feedback():
    report = run_checks("4.1", dict(BUGS["4.1"])["sums the gradients instead of averaging them"])
    messages = [c.message for c in report.cases if not c.passed]
    assert any("the sum over ranks, not the mean" in m for m in messages)


def test_tied_weight_reduced_twice_fails_only_the_counting_case():
    bug = dict(BUGS["4.1"])["reduces the tied weight twice (module by module)"]
    assert failed_cases("4.1", bug) == [
        c.name for c in get_task("4.1").cases if "at most one" in c.name
    ]


# --------------------------------------------------------------------------- the bucket plan


@settings(max_examples=60, deadline=None)
@given(cap_bytes=st.integers(1, 4000))
def test_bucket_plan_covers_parameters_in_reverse_order_under_the_cap(cap_bytes):
    model = AwkwardNet()
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    plan = bucket_plan(cap_bytes / MIB)
    assert [n for b in plan for n in b] == trainable[::-1]  # every trainable one once, reversed
    for bucket in plan:
        total = sum(sizes[n] for n in bucket)
        assert total <= cap_bytes or len(bucket) == 1  # only a lone parameter may exceed the cap
    for a, b in zip(plan, plan[1:]):  # greedy: the next parameter did not fit
        assert sum(sizes[n] for n in a) + sizes[b[0]] > cap_bytes


def test_solution_buckets_match_the_trusted_plan(solution):
    def buckets_on_rank(impl, cap_mb):
        model = AwkwardNet()
        names = {p: n for n, p in model.named_parameters()}
        return [[names[p] for p in bucket] for bucket in impl(model, bucket_size_mb=cap_mb).buckets]

    for cap in (600 / MIB, 1500 / MIB, 1.0):
        got = run_ranks(buckets_on_rank, (solution.BucketedDDP, cap), world_size=1, echo=False)[0]
        assert got == bucket_plan(cap)


# --------------------------------------------------------------------------- against torch DDP


def _grads_after_steps(wrapper, options, steps=2):
    """Each rank: its own initial weights, wrap, ``steps`` SGD steps; last step's gradients."""
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = TinyTransformer(vocab=32, dim=32, layers=2, heads=2, context=8)
    wrapper = DistributedDataParallel if wrapper is None else wrapper
    ddp = wrapper(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = token_batch(2 * world_size, 8, 32, seed=step)
        x, y = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
        F.cross_entropy(ddp(x).flatten(0, 1), y.flatten()).backward()
        getattr(ddp, "finish_gradient_synchronization", lambda: None)()
        grads = [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return grads


@settings(max_examples=6, deadline=None)
@given(
    world_size=st.integers(1, 4),
    which=st.sampled_from(["NaiveDDP", "OverlappedDDP", "BucketedDDP"]),
    cap_kib=st.sampled_from([1, 16, 64, 1024]),
)
def test_solutions_give_torch_ddp_gradients_on_a_transformer(solution, world_size, which, cap_kib):
    options = {"bucket_size_mb": cap_kib / 1024} if which == "BucketedDDP" else {}
    ours = run_ranks(_grads_after_steps, (getattr(solution, which), options),
                     world_size=world_size, echo=False)
    torchs = run_ranks(_grads_after_steps, (None, {}), world_size=world_size, echo=False)
    for rank in range(world_size):
        for a, b in zip(ours[rank], torchs[rank]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _accumulated(impl, micro):
    """Each rank: one step of ``micro`` micro-batches (all but the last under no_sync)."""
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = TinyTransformer(vocab=32, dim=32, layers=1, heads=2, context=8)
    ddp = impl(model, bucket_size_mb=0.01)
    x, y = token_batch(8, 8, 32, seed=rank)  # this rank's 8 sequences
    for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
        loss = F.cross_entropy(ddp(xs).flatten(0, 1), ys.flatten()) / micro
        if i < micro - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()
    ddp.finish_gradient_synchronization()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("micro", [2, 4])
def test_no_sync_accumulation_equals_one_step_on_the_combined_batch(solution, micro):
    one = run_ranks(_accumulated, (solution.BucketedDDP, 1), world_size=2, echo=False)
    accumulated = run_ranks(_accumulated, (solution.BucketedDDP, micro), world_size=2, echo=False)
    for rank in range(2):
        for a, b in zip(accumulated[rank], one[rank]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson04_runs_headless_with_its_solutions_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=180, budget=240)
    printed = printed_text(result)
    assert "same gradients: True" in printed
    counts = {line.split()[0]: int(line.split()[1]) for line in printed.splitlines()
              if line.endswith("all-reduces in one step")}
    assert counts["NaiveDDP"] == counts["OverlappedDDP"] > counts["BucketedDDP"] >= 1
    # torch DDP's own bucket all-reduces, issued by its C++ Reducer, are on the timeline
    reducer = next(line for line in printed.splitlines() if line.startswith("torch DDP "))
    assert "routes ['c++']" in reducer and int(reducer.split()[2]) >= 2
    accumulated = next(
        line for line in printed.splitlines() if "each micro-batch's backward" in line
    )
    silent, last = accumulated.split(": [")[1].rstrip("]").rsplit(", ", 1)
    assert silent == "0, 0, 0" and int(last) >= 1  # no_sync: only the last backward communicates
    assert "find_unused_parameters=True: ['two steps done', 'two steps done']" in printed
    assert "static_graph=True:           ['two steps done', 'two steps done']" in printed
    assert "DDP: You can enable unused parameter detection" in printed  # and without: the error
    # persistent ranks: the model built in one cell is trained in the next
    wrapped = [line for line in printed.splitlines() if "checksum after wrapping" in line]
    stepped = [line.split("] ", 1)[1] for line in printed.splitlines() if "buckets now" in line]
    assert len(wrapped) == 2 and len(stepped) == 4, printed
    assert len({line.split("] ", 1)[1] for line in wrapped}) == 1  # rank 0's weights everywhere
    assert wrapped[0].endswith("buckets [424960] bytes")  # one bucket before the first backward
    first, second = ([line.split("checksum ")[1] for line in stepped
                      if line.startswith(f"step {k}")] for k in (0, 1))
    assert len(set(first)) == len(set(second)) == 1  # the same weights on both ranks
    assert first[0].endswith("[424960] bytes") and second[0].count(",") >= 1  # rebuilt
    assert "2 persistent ranks up" in printed and "persistent ranks stopped" in printed
    check_outputs(result)


@pytest.mark.slow
def test_checks_pass_with_spawned_ranks_as_on_macos(solution, monkeypatch):
    pass_with_spawned_ranks(monkeypatch, solution, dict.fromkeys(TASK_IDS, -1))


@pytest.mark.slow
def test_nbgrader_autograde_gives_lesson04_full_marks_solved_and_zero_untouched(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from nbgrader.api import Gradebook

    from autograder.build import main_course, source_notebook

    name = SOURCE.stem
    course = tmp_path / "course"
    assert main_course([str(course), "--root", str(ROOT), "--lessons", "04"]) == 0
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

    def nbgrader(*args):
        done = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course,
                              env={**os.environ, "PATH": path}, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, f"nbgrader {args} failed:\n{done.stdout}\n{done.stderr}"

    nbgrader("generate_assignment", name, "--force")
    release = json.loads((course / "release" / name / f"{name}.ipynb").read_text())
    solutions = {c.id: c.source for c in source_notebook(SOURCE).cells}
    solved = json.loads(json.dumps(release))
    for cell in solved["cells"]:
        if cell["id"].startswith("task-"):
            cell["source"] = solutions[cell["id"]]
    for student, nb in (("solved", solved), ("untouched", release)):
        folder = course / "submitted" / student / name
        folder.mkdir(parents=True)
        (folder / f"{name}.ipynb").write_text(json.dumps(nb, indent=1))
    nbgrader("autograde", name, "--force")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        scores = {s: gb.find_submission(name, s).score for s in ("solved", "untouched")}
    assert scores == {"solved": sum(t.points for t in lesson_tasks(4)), "untouched": 0}


# --------------------------------------------------------------------------- the recorder


def _torch_ddp_steps(steps: int, cap_mb: float) -> list[list[tuple[str, str, int, bool, bool]]]:
    """Each rank: torch DDP on a transformer, every step traced; (op, route, bytes, async, in
    backward)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from kit.trace import region, trace

    torch.manual_seed(0)
    model = DDP(
        TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32), bucket_cap_mb=cap_mb
    )
    per_step = []
    for step in range(steps):
        x, y = token_batch(4, 32, 64, seed=10 * step + dist.get_rank())
        with trace() as t:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            with region("backward"):
                loss.backward()
        backward = next(e for e in t.events if e.op == "backward")
        per_step.append(
            [
                (e.op, e.route, e.nbytes, e.async_op, backward.start <= e.start <= backward.end)
                for e in t.events
                if e.kind == "collective"
            ]
        )
        model.zero_grad()
    return per_step


def test_torch_ddp_reducer_all_reduces_are_traced_inside_backward_as_cpp_route():
    cap_mb = 0.05
    steps = run_ranks(_torch_ddp_steps, (3, cap_mb), {}, world_size=2, timeout=120, echo=False)
    grad_bytes = sum(
        p.numel() * p.element_size()
        for p in TinyTransformer(vocab=64, dim=64, layers=2, heads=4, context=32).parameters()
    )
    for rank_steps in steps:
        for step, events in enumerate(rank_steps):
            reduces = [e for e in events if e[0] == "all_reduce"]
            # issued by the C++ Reducer (no Python dist.* call), async, during backward
            assert reduces and all(route == "c++" and is_async and inside
                                   for _, route, _, is_async, inside in reduces), (step, events)
            assert (
                sum(nbytes for _, _, nbytes, _, _ in reduces) == grad_bytes
            )  # every gradient once
        # after the first step DDP rebuilds its buckets under the cap: several all-reduces
        assert len([e for e in rank_steps[-1] if e[0] == "all_reduce"]) >= 2


_RANK_IMPORTS = r'''
import json, os, pickle, sys
import kit._rank
from autograder.checking import run_checks
from autograder.loading import load_tasks
from autograder.registry import lesson_tasks

out, source = sys.argv[1], sys.argv[2]
tasks = lesson_tasks(4)
pid = os.fork()  # the trusted expectations train in this process: keep their imports out of it
if pid == 0:
    from autograder.grade.batch import expectations
    expectations(tasks, 0)
    with open(os.path.join(out, "expected.pkl"), "wb") as f:
        pickle.dump({t.id: t._expected for t in tasks}, f)
    os._exit(0)
assert os.waitpid(pid, 0)[1] == 0
with open(os.path.join(out, "expected.pkl"), "rb") as f:
    got = pickle.load(f)
for t in tasks:
    t._expected.update(got[t.id])
module = load_tasks(source, lesson=4)
print(json.dumps({"parent": "torch._dynamo" in sys.modules}))
real = kit._rank.rank_main

def rank_main(*args, **kwargs):  # each rank writes the modules it imported on its way out
    before, exit = set(sys.modules), os._exit

    def _exit(code):
        with open(os.path.join(out, f"rank-{os.getpid()}.json"), "w") as f:
            json.dump([os.environ["TASK"], sorted(set(sys.modules) - before)], f)
        exit(code)

    os._exit = _exit
    real(*args, **kwargs)

kit._rank.rank_main = rank_main
for t in tasks:
    os.environ["TASK"] = t.id
    report = run_checks(t.id, getattr(module, t.name))
    assert report.score == report.max_score, report.to_text()
'''


def test_no_rank_of_the_checks_imports_dynamo_itself(tmp_path):
    """Every rank builds a torch.optim optimizer, whose __init__ imports Dynamo on first use:
    about a second of CPU per rank, 26 ranks for the lesson, when no earlier lesson had imported
    it (a worker grading Lesson 04 alone). The tasks preload it: forked ranks inherit it."""
    import json
    import subprocess
    import sys

    script = tmp_path / "rank_imports.py"
    script.write_text(_RANK_IMPORTS)
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(SOURCE)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"parent": False}  # not imported by loading
    ranks = [json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")]
    assert {task for task, _ in ranks} == set(TASK_IDS)
    heavy = {(task, m) for task, modules in ranks for m in modules if m.startswith("torch._dynamo")}
    assert not heavy, sorted(heavy)[:10]


@pytest.mark.parametrize(("bug", "words"), [
    ("no_sync restores True, not the previous value", "after an inner no_sync"),
    ("no_sync without try/finally", "after a raise"),
])
def test_a_no_sync_that_loses_the_flag_at_an_edge_fails_only_the_edges_case(bugs, bug, words):
    report = run_checks("4.4", next(impl for label, impl in bugs["4.4"] if label.startswith(bug)))
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name.split(":")[0] for c in failed] == ["the flag at the edges"], report.to_text()
    assert words in failed[0].message, failed[0].message

"""Lesson 12's checks rest on trusted pieces that are right, and measure what they claim.

The generic tests (tests/test_checks.py) prove every task passes on its solution and fails on its
stub and on every seeded bug. These prove the rest: the solution's FLOP count against
FlopCounterMode on random shapes (hypothesis) and the fused kernel's zero the lesson shows; the
solution's bytes against the recorder on a world size the checks do not use (3); the straggler
found on every run of several seeds, where the naive totals blame the overlap scenario's decoys;
the profiling helpers (traces per rank, the merged trace with
the recorder's collectives, the figure); which case catches which bug; and the lesson, headless.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from case_support import failed_cases
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, printed_text
from torch.nn import functional as F

from autograder import course, gates
from autograder.lesson12 import (
    LAYOUTS,
    PHASES,
    SCENARIOS,
    STRAGGLER_RANKS,
    STRAGGLER_STEPS,
    expected_straggler,
    straggler_plan,
    traffic_model,
    traffic_sizes,
)
from autograder.references import lesson12 as ref
from autograder.registry import get_task
from kit.launcher import run_ranks
from kit.lessons import profiling

LESSON = 12
SOURCE = course.lesson(LESSON).source


def test_every_forbidden_name_of_12_1_resolves():
    forbidden = get_task("12.1").forbidden
    assert "torch.utils.flop_counter" in forbidden
    for name in forbidden:
        assert gates.resolve(name) is not None, name


def test_every_forbidden_name_of_12_2_resolves_and_a_real_run_scores_0(bugs):
    from autograder.checking import run_checks

    for name in get_task("12.2").forbidden:
        assert gates.resolve(name) is not None, name
    cheat = dict(bugs["12.2"])["measured on real ranks with the recorder"]
    report = run_checks("12.2", cheat)
    assert {c.status for c in report.cases} == {"forbidden"}, [c.status for c in report.cases]


def test_the_helpers_hold_no_answer():
    assert not {"training_flops", "step_traffic", "find_straggler"} & set(dir(profiling))


# --------------------------------------------------------------------------- 12.1


@settings(max_examples=12, deadline=None)
@given(vocab=st.integers(1, 300), heads=st.integers(1, 4), width=st.integers(1, 8),
       layers=st.integers(0, 3), batch=st.integers(0, 3), seq_len=st.integers(1, 40))
def test_solution_flops_equal_flop_counter_mode_on_random_shapes(solution, vocab, heads, width,
                                                                 layers, batch, seq_len):
    shape = (vocab, heads * width, layers, heads, batch, seq_len)
    assert solution.training_flops(*shape) == ref.counted_flops([shape])["counts"][0]


@settings(max_examples=40, deadline=None)
@given(dim=st.integers(-2, 24), heads=st.integers(-1, 6), layers=st.integers(-1, 2),
       batch=st.integers(-1, 2))
def test_solution_refuses_exactly_the_models_tiny_transformer_refuses(solution, dim, heads,
                                                                       layers, batch):
    # training_flops raises a ValueError where the model cannot be built (or run), and only there.
    from kit.lessons.models import TinyTransformer

    try:
        if batch < 0 or layers < 0 or dim < 1 or heads < 1:
            raise ValueError("a negative size")  # torch raises other errors on these
        TinyTransformer(11, dim, layers, heads, context=4)
        buildable = True
    except (ValueError, ZeroDivisionError, RuntimeError):
        buildable = False
    if buildable:
        assert solution.training_flops(11, dim, layers, heads, batch, 4) >= 0
    else:
        with pytest.raises(ValueError, match="dim|heads|size"):
            solution.training_flops(11, dim, layers, heads, batch, 4)


def test_the_fused_cpu_kernel_counts_attention_as_zero():
    # What the lesson shows: without the math backend FlopCounterMode misses exactly the two
    # attention products, forward and backward.
    from torch.utils.flop_counter import FlopCounterMode

    from kit.lessons.models import TinyTransformer

    vocab, dim, layers, heads, batch, seq_len = 50, 16, 2, 2, 2, 12
    model = TinyTransformer(vocab, dim, layers, heads, context=seq_len)
    x = torch.randint(0, vocab, (batch, seq_len))
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(model(x).reshape(-1, vocab), x.reshape(-1)).backward()
    with_math = ref.counted_flops([(vocab, dim, layers, heads, batch, seq_len)])["counts"][0]
    attention = 3 * layers * 4 * batch * seq_len * seq_len * dim
    assert counter.get_total_flops() == with_math - attention


# --------------------------------------------------------------------------- 12.2


def test_solution_bytes_equal_the_recorder_on_3_ranks(solution):
    # DTensor's row-wise split needs 4 * dim divisible by 3; vocab and seq_len still pad
    sizes = {"vocab": 37, "dim": 12, "layers": 2, "heads": 2, "seq_len": 7, "batch": 3}
    ranks = list(run_ranks(ref._traffic_on_rank, (sizes,), world_size=3, timeout=120, echo=False,
                           preload=ref.TRAFFIC_PRELOAD))
    assert all(r == ranks[0] for r in ranks)
    for layout in LAYOUTS:
        got = solution.step_traffic(
            layout, traffic_model(sizes), 3, sizes["batch"], sizes["seq_len"]
        )
        assert got == ranks[0][layout], layout


def test_fsdp_pads_at_the_sizes_the_checks_draw(solution):
    # Every seed's sizes leave a remainder on 2 or 4 ranks, so padding changes FSDP's bytes.
    for seed in range(5):
        sizes = traffic_sizes(seed)
        model = traffic_model(sizes)
        assert sizes["vocab"] % 2 and sizes["vocab"] % 4
        unpadded = sum(p.numel() * p.element_size() for p in model.parameters())
        fsdp = solution.step_traffic("fsdp", model, 4, sizes["batch"], sizes["seq_len"])
        assert fsdp["reduce_scatter_single"] > unpadded


def test_one_rank_sends_nothing_under_fsdp_and_tp_and_the_check_names_that_regime(solution, bugs):
    measured = ref._measured(0, 1)  # the recorder on a single rank
    assert measured["fsdp"] == {} and measured["tp"] == {}
    assert measured["ddp"] and measured["zero1"]
    sizes = traffic_sizes(0)
    for layout in LAYOUTS:
        got = solution.step_traffic(
            layout, traffic_model(sizes), 1, sizes["batch"], sizes["seq_len"]
        )
        assert got == measured[layout], layout
    with pytest.raises(ValueError, match="world_size"):
        solution.step_traffic("ddp", traffic_model(sizes), 0, 1, 1)
    bug = dict(bugs["12.2"])["FSDP and TP traffic predicted on one rank, where nothing is sent"]
    failed = failed_cases("12.2", bug)
    assert failed == [c.name for c in get_task("12.2").cases if c.name.startswith("one rank")]
    from autograder.checking import run_checks

    report = run_checks("12.2", bug)
    one_rank = next(c for c in report.cases if c.name.startswith("one rank"))
    assert (
        one_rank.status != "passed" and "FSDP2 gathers and reduce-scatters nothing" in one_rank.hint
    )
    assert "fsdp on 1 ranks" in one_rank.message, one_rank.message


# --------------------------------------------------------------------------- 12.3


def test_the_plan_puts_each_off_step_and_each_overlap_role_apart():
    # A reader of one step fails on some seed's phase scenario only if the off steps differ; the
    # overlap decoys fool the naive rules only on ranks of their own.
    for seed in range(20):
        plan = straggler_plan(seed)
        assert sorted(plan[p]["off_step"] for p in PHASES) == list(range(STRAGGLER_STEPS))
        assert all(plan[p]["slow_rank"] != plan[p]["hiccup_rank"] for p in PHASES)
        roles = [plan["overlap"][k] for k in ("slow_rank", "late_launch", "busy_wait",
                                              "hiccup_rank")]
        assert sorted(roles) == list(range(STRAGGLER_RANKS))
        assert expected_straggler(seed, "link") == {"rank": None, "phase": "link"}


@pytest.mark.slow
def test_the_straggler_is_found_on_every_run_of_several_seeds_and_fools_the_naive_rules(solution):
    # The checks' claim that every scenario's answer is found every time, on this machine however
    # busy: 2 more runs of the five scenarios, on other ranks and steps. In the overlap scenario
    # the rank that waits least is the late launcher and the one that computes most is the busy
    # waiter, neither of them the straggler.
    from autograder.lesson12 import _straggler_ranks

    profiling.warm_profiler()
    for seed in range(1, 3):
        ranks = run_ranks(_straggler_ranks, (seed,), world_size=4, timeout=60, echo=False)
        for i, scenario in enumerate(SCENARIOS):
            traces = [r[i] for r in ranks]
            assert solution.find_straggler(traces) == expected_straggler(seed, scenario), (
                seed, scenario)
        plan = straggler_plan(seed)["overlap"]
        spans = [[e for e in r[-1]["traceEvents"] if e.get("ph") == "X"] for r in ranks]
        waits = [sum(e["dur"] for e in s if e["name"].startswith("gloo:")) for s in spans]
        compute = [sum(e["dur"] for e in s if e["name"] in ("aten::mm", "aten::tanh"))
                   for s in spans]
        assert waits.index(min(waits)) == plan["late_launch"], (seed, waits)
        assert compute.index(max(compute)) == plan["busy_wait"], (seed, compute)


MAIN, GLOO = 1, 2
LOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def _synthetic_trace(data: float, compute: float, gap: float, wait: float) -> dict:
    """One rank's step as torch's profiler lays it out: the loader's __next__ and aten ops on
    the main thread, nothing during a gap, the all-reduce's wait on a gloo thread, one op after."""
    t, events = 0.0, []

    def event(name, dur, tid, cat="cpu_op"):
        events.append({"ph": "X", "name": name, "ts": t, "dur": dur, "tid": tid, "cat": cat})

    event(LOADER, data, MAIN, cat="user_annotation")
    event("aten::empty", data / 4, MAIN)  # an op inside the loader: data, not compute
    t += data
    for _ in range(3):
        event("aten::mm", compute / 3, MAIN)
        t += compute / 3
    t += gap
    event("gloo:all_reduce", wait, GLOO, cat="user_annotation")
    t += wait
    event("aten::add_", 1.0, MAIN)
    return {"traceEvents": events}


@settings(max_examples=40, deadline=None)
@given(world=st.integers(2, 8), data=st.data())
def test_solution_finds_the_straggler_of_any_step_whose_one_rank_is_slow(solution, world, data):
    # Ranks differ by noise up to 30%; one rank is slower in one phase by 2-20x a phase's time;
    # the all-reduce makes everyone wait for it. Traces come in rank order.
    slow = data.draw(st.integers(0, world - 1))
    phase = data.draw(st.sampled_from(PHASES))
    noise = st.floats(0.7, 1.3)
    rows = [{p: 1000.0 * data.draw(noise) for p in PHASES} for _ in range(world)]
    rows[slow][phase] += 1000.0 * data.draw(st.floats(2.0, 20.0))
    arrive = [r["data"] + r["compute"] + r["communication"] for r in rows]
    traces = [_synthetic_trace(r["data"], r["compute"], r["communication"],
                               max(arrive) - a + 50.0) for r, a in zip(rows, arrive)]
    assert solution.find_straggler(traces) == {"rank": slow, "phase": phase}


def _two_rank_traces(tmp_path):
    def on_rank(folder):
        import torch.distributed as dist

        from kit.trace import trace

        with profiling.profiled(folder), trace() as t:
            x = torch.ones(1000)
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
            dist.all_reduce(x)
        return [e.to_dict() for e in t.events]

    profiling.warm_profiler()
    events = list(run_ranks(on_rank, (str(tmp_path),), world_size=2, echo=False))
    return profiling.load_traces(tmp_path), events


def test_profiled_without_a_folder_keeps_the_trace_in_memory_and_leaves_no_file(
    tmp_path, monkeypatch
):
    # Two runs profiling at once (two kernels, two checks of 12.3) once shared $TMPDIR/rank0.json.
    import tempfile

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    profiling.warm_profiler()
    with profiling.profiled() as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    assert "kitClock" in prof.trace and prof.trace["kitRank"] == 0
    assert any(e.get("name") == "aten::mm" for e in prof.trace["traceEvents"])
    assert list(tmp_path.iterdir()) == []


def test_profiled_writes_one_trace_per_rank_with_a_clock_and_gloo_events(tmp_path):
    traces, events = _two_rank_traces(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["rank0.json", "rank1.json"]
    for rank, trace in enumerate(traces):
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "gloo:all_reduce" in names and "aten::mm" in names
        assert set(trace["kitClock"]) == {"perf_counter_s", "ts_us"}
        assert [e["op"] for e in events[rank]] == ["all_reduce"]
        assert events[rank][0]["nbytes"] == 4000


def test_merged_trace_has_a_row_per_rank_and_the_recorders_collectives_in_time(tmp_path):
    traces, events = _two_rank_traces(tmp_path)
    merged = profiling.merge_traces(traces, events, tmp_path / "merged.json")
    assert json.loads((tmp_path / "merged.json").read_text()) == merged
    spans = [e for e in merged["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for rank in (0, 1):
        recorded = [e for e in spans if e["pid"] == rank and e["tid"] == "recorder"]
        gloo = [e for e in spans if e["pid"] == rank and e["name"] == "gloo:all_reduce"]
        assert [e["args"]["bytes"] for e in recorded] == [4000]
        # the recorder's call and gloo's own event overlap on the shared time axis
        (r,), (g,) = recorded, gloo
        assert r["ts"] - 5e4 < g["ts"] + g["dur"] and g["ts"] < r["ts"] + r["dur"] + 5e4


def test_plot_traces_draws_a_row_per_rank(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    traces, events = _two_rank_traces(tmp_path)
    ax = profiling.plot_traces(traces, events)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1"]
    assert len(ax.patches) > 4


# --------------------------------------------------------------------------- which case, which bug


# A bug at an edge of its task: (task, the bug's label, the one case that catches it, what that
# case's feedback names)
EDGE_BUGS = [
    ("12.1", "counts a model that cannot exist", "a shape the model refuses",
     "dim 10 on 4 heads (dim not a multiple of heads)"),
    ("12.1", "the output layer counted in every block", "the edges", "layers=0"),
    ("12.3", "names a straggler where there is none", "no straggler to find",
     "one rank's trace (world size 1)"),
]


def _bug(bugs, task_id, label_start):
    return next(i for description, i in bugs[task_id] if description.startswith(label_start))


@pytest.mark.parametrize("task_id, bug, caught_by", [
    ("12.1", "attention's score matmuls forgotten", "long sequences"),
    ("12.1", "the LM head", "a large vocabulary"),
    ("12.2", "no padding counted", "fsdp"),
    ("12.2", "TP's backward all-reduce forgotten", "tp"),
    ("12.3", "never blames the link", "a slow link"),
    ("12.3", "late arrivals counted by the others' waits", "a compute straggler among"),
    *[(task_id, bug, caught_by) for task_id, bug, caught_by, _ in EDGE_BUGS],
])
def test_each_bug_is_caught_by_the_case_that_targets_it(bugs, task_id, bug, caught_by):
    failed = failed_cases(task_id, _bug(bugs, task_id, bug))
    assert failed and any(name.startswith(caught_by) or caught_by in name for name in failed), (
        failed
    )
    if task_id == "12.2" or (task_id, bug) in {(t, b) for t, b, _, _ in EDGE_BUGS}:
        assert all(name.startswith(caught_by) for name in failed), failed


@pytest.mark.parametrize("task_id, bug, names",
                         [(task_id, bug, names) for task_id, bug, _, names in EDGE_BUGS])
def test_an_edge_bug_gets_feedback_naming_its_regime(bugs, task_id, bug, names):
    from autograder.checking import run_checks

    failed = [c for c in run_checks(task_id, _bug(bugs, task_id, bug)).cases
              if c.status == "failed"]
    assert len(failed) == 1 and names in failed[0].message, [c.message for c in failed]


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson12_runs_headless_and_shows_what_it_claims():
    import re

    from kit.runner import run_notebook

    beside = set((SOURCE.parent).iterdir())
    result = run_notebook(SOURCE, timeout=300)
    assert result.ok, str(result.failure)
    assert result.seconds < 300, result.slowest()
    assert set((SOURCE.parent).iterdir()) == beside  # nothing written beside the notebook
    printed = printed_text(result)
    work = Path(re.search(r"this lesson's traces and figures: (\S+)", printed).group(1))
    assert work.is_dir() and work.name.startswith("kit-lesson12-")
    merged = json.loads((work / "merged_trace.json").read_text())
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1, 2, 3}
    assert sorted(p.name for p in (work / "traces_data").glob("rank*.json")) == [
        f"rank{r}.json" for r in range(4)]
    assert "FlopCounterMode has a formula for the CPU flash kernel: False" in printed
    assert "training_flops equals FlopCounterMode: True" in printed
    assert (
        "(= FlopCounterMode's math count: True)" in printed
    )  # Kaplan's 6N + PaLM's attention + head
    buckets = re.findall(
        r"(\d+) DDP all-reduce\(s\) per step \(torch's assignment: (\d+)\)", printed
    )
    assert len(buckets) == 3 and all(a == b for a, b in buckets) and buckets[-1][0] == "2", buckets
    assert "fsdp 0.91 s/0 GB (the batch's 256 sequences do not cover 512 replicas)" in printed
    assert "ddp" in printed and "112 GB (does not fit)" in printed  # 7B under DDP: 16 B x 7e9
    choices = [line.rsplit("->", 1)[1].strip() for line in printed.splitlines() if "GPUs:" in line]
    assert choices == ["fsdp", "fsdp", "tp+fsdp"], choices
    assert "the recorder agrees with step_traffic on every layout: True" in printed
    assert "find_straggler finds every scenario's answer: True" in printed
    assert sorted(p.name for p in (work / "traces_scenarios" / "overlap").glob("rank*.json")) == [
        f"rank{r}.json" for r in range(4)]
    assert "export_memory_timeline` is deprecated" in printed  # torch 2.13's own warning, shown
    timeline = json.loads((work / "memory_timeline.json").read_text())
    assert len(timeline) == 2 and len(timeline[0]) == len(timeline[1]) > 10
    assert re.search(r"optimizer state at the peak / parameters: 2\.\d\d", printed)
    assert "no CUDA device here" in printed or "segments reserved" in printed
    assert printed.count("hidden behind compute or loading") == 4
    checks = check_outputs(result)
    points = [o["data"]["text/plain"] for o in checks if o.get("output_type") == "execute_result"]
    assert points == ["3.0", "4.0", "4.0"], points  # full marks on every task, in the kernel

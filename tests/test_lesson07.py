"""Lesson 07's claims, proved against trusted references independently of the checks.

The solutions' loss scaler follows torch's GradScaler for any overflow pattern and growth
interval (hypothesis); the saved-activation count meets the per-layer formula for any block
shape; checkpointing gives torch.utils.checkpoint's gradients and saves what the formula
predicts; GraphBreakNet really breaks Dynamo's graph and the solution does not; and the lesson
runs headless, showing what its prose says. (tests/test_checks.py runs the checks themselves
on the solutions, the stubs and the seeded bugs.)
"""

from __future__ import annotations

import contextlib
import io
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lesson_support import check_outputs, printed_text, run_headless
from torch import nn
from torch.nn import functional as F

from autograder import course
from autograder.checking import run_checks
from autograder.lesson07 import SCALER_ARGS, _dropout_model, _train_scaled
from autograder.references.lesson07 import block_formula_bytes
from autograder.references.lesson07 import saved_activation_bytes as _reference_saved_bytes
from autograder.references.lesson07 import torch_scaler as _torch_scaler
from autograder.registry import get_task, lesson_tasks
from kit.lessons.models import TinyTransformer, token_batch
from kit.lessons.precision import GraphBreakNet, format_table, padded_batch

LESSON = 7
SOURCE = course.lesson(LESSON).source


def test_lesson07_gates_name_what_each_task_reimplements():
    gates = {t.id: t.forbidden for t in lesson_tasks(7)}
    assert "torch.amp.GradScaler" in gates["7.1"]
    assert "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler" in gates["7.1"]
    assert "torch.utils.checkpoint.checkpoint" in gates["7.3"]


def test_format_table_matches_torch_finfo():
    rows = {r["format"]: r for r in format_table()}
    assert rows["fp16"]["max"] == 65504.0 and rows["fp16"]["eps"] == 2.0**-10
    assert (
        rows["bf16"]["eps"] == 2.0**-7
        and rows["bf16"]["smallest normal"] == torch.finfo(torch.float32).tiny
    )
    assert rows["tf32"]["eps"] == rows["fp16"]["eps"] and rows["tf32"]["max"] == rows["fp32"]["max"]


# --------------------------------------------------------------------------- task 7.1


@settings(max_examples=25, deadline=None)
@given(
    inf_steps=st.sets(st.integers(0, 11), max_size=5),
    nan_steps=st.sets(st.integers(0, 11), max_size=2),
    interval=st.integers(1, 4),
    clip=st.sampled_from([None, 0.3]),
)
def test_scaler_follows_torch_grad_scaler_for_any_overflow_pattern(solution, inf_steps, nan_steps,
                                                                   interval, clip):
    kwargs = {"inf_steps": tuple(inf_steps), "nan_steps": tuple(nan_steps), "clip": clip}
    with patch.dict(SCALER_ARGS, growth_interval=interval):
        ours = _train_scaled(solution.DynamicLossScaler, 3, **kwargs)
        theirs = _train_scaled(_torch_scaler, 3, **kwargs)
    assert ours["scales"] == theirs["scales"]
    assert ours["stepped"] == theirs["stepped"]
    assert ours["stepped"] == [s not in inf_steps | nan_steps for s in range(len(ours["stepped"]))]
    for name, p in theirs["params"].items():
        torch.testing.assert_close(ours["params"][name], p, rtol=0, atol=0)


# --------------------------------------------------------------------------- task 7.2


@settings(max_examples=20, deadline=None)
@given(s=st.sampled_from([1, 5, 16, 33]), b=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([4, 8, 16]))
def test_saved_bytes_of_a_block_meet_the_per_layer_formula(solution, s, b, heads, head_dim):
    h = heads * head_dim
    block = TinyTransformer(vocab=8, dim=h, layers=1, heads=heads, context=64).blocks[0]
    x = torch.randn(b, s, h, requires_grad=True)
    assert solution.saved_activation_bytes(block, x) == block_formula_bytes(s, b, h, heads)
    assert _reference_saved_bytes(block, x) == block_formula_bytes(s, b, h, heads)


def test_saved_bytes_skip_weights_and_count_a_shared_storage_once(solution):
    linear = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    assert solution.saved_activation_bytes(linear, x) == x.numel() * 4  # the input only

    def three_views(t):  # q, k, v views of one storage, each saved by a multiplication
        q, k, v = t.chunk(3, dim=1)
        return (q * k * v).sum()

    t = torch.randn(4, 12, requires_grad=True)
    assert (
        solution.saved_activation_bytes(three_views, t * 1.0) == 4 * 12 * 4 + 4 * 4 * 4
    )  # t's storage once, q * k


# --------------------------------------------------------------------------- task 7.3


@pytest.mark.parametrize("every", [1, 2, 4])
def test_checkpointing_gives_torch_checkpoint_gradients_bit_for_bit(solution, every):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    def grads(wrap):
        model = _dropout_model(5)
        named = list(model.named_parameters())
        wrap(model)
        x, y = token_batch(2, 16, 32, 9)
        torch.manual_seed(11)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        return {n: p.grad for n, p in named}

    class TorchCheckpointed(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return torch_checkpoint(self.block, x, use_reentrant=False)

    def torch_wrap(model):
        for i, block in enumerate(model.blocks):
            if (i + 1) % every == 0:
                model.blocks[i] = TorchCheckpointed(block)

    ours = grads(lambda m: solution.apply_checkpointing(m, every=every))
    theirs = grads(torch_wrap)
    for name, g in theirs.items():
        assert torch.equal(ours[name], g), name


def test_checkpointing_saves_what_task_7_2_predicts(solution):
    """Saved bytes = plain model - per checkpointed block (its own saved bytes - its input)."""
    x, _ = token_batch(2, 16, 32, 0)
    plain = _dropout_model(0)
    full = _reference_saved_bytes(plain, x)
    block = plain.blocks[0]
    h = torch.randn(2, 16, 32, requires_grad=True)
    per_block = solution.saved_activation_bytes(block, h) - h.numel() * 4  # the input stays
    for every in (1, 2, 4):
        model = solution.apply_checkpointing(_dropout_model(0), every=every)
        assert _reference_saved_bytes(model, x) == full - (4 // every) * per_block


# --------------------------------------------------------------------------- task 7.4


def _breaks(module):
    import torch._dynamo

    torch._dynamo.reset()
    tokens, lengths = padded_batch(4, 7, 32, seed=0)
    with contextlib.redirect_stdout(io.StringIO()):
        explanation = torch._dynamo.explain(module)(tokens, lengths)
    torch._dynamo.reset()
    return explanation.graph_break_count


def test_graph_break_net_breaks_three_times_and_the_solution_never(solution):
    model = GraphBreakNet()
    assert _breaks(model) == 3
    assert _breaks(solution.compile_ready(model)) == 0


def test_compile_ready_matches_eager_with_inductor_too(solution):
    """The checks use backend="eager"; Inductor's fused kernels give the same values."""
    import torch._dynamo

    torch.manual_seed(0)
    model = GraphBreakNet()
    tokens, lengths = padded_batch(6, 9, 32, seed=4)
    with contextlib.redirect_stdout(io.StringIO()):
        want = model(tokens, lengths)
    torch._dynamo.reset()
    got = torch.compile(solution.compile_ready(model), fullgraph=True)(tokens, lengths)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compile_ready_compiles_twice_over_three_lengths_and_a_python_range_once_per_length(
    solution, bugs
):
    """The second length makes T dynamic (automatic dynamic shapes), the third reuses that graph;
    positions built from range(T) pin T, and the third length compiles again. Only the dynamic
    shapes case catches that: the values are right."""
    from autograder import lesson07

    fixed = lesson07.COMPILED(solution.compile_ready, 0)
    assert fixed["graphs after each batch"] == [1, 1, 1, 2, 2]
    bug = dict(bugs["7.4"])["recompiles per sequence length (positions from a Python range)"]
    assert lesson07.COMPILED(bug, 0)["graphs after each batch"] == [1, 1, 1, 2, 3]
    report = run_checks("7.4", bug)
    assert [c.name for c in report.cases if c.status != "passed"] == [
        c.name for c in get_task("7.4").cases if "no recompile on the third length" in c.name]


# --------------------------------------------------------------------------- the bounds, measured

# A seeded bug with right values that loses the technique's saving: (task, bug) -> what its failing
# bound bounds, words of the saving its message names, and the other resource cases it may fail
# (7.3's saved-tensor count sees the kept activations too).
RESOURCE_BUGS = {
    ("7.3", "forward runs fn with grad and keeps its output on ctx: every activation stays alive"):
        ("bytes kept after the forward with every block checkpointed",
         "activations are kept although backward recomputes them", ["saved bytes for every="]),
}


@pytest.mark.parametrize(("task_id", "bug"), list(RESOURCE_BUGS), ids=[b for _, b in RESOURCE_BUGS])
def test_a_bug_that_loses_the_saving_fails_its_bound_and_passes_every_value_case(
    bugs, task_id, bug
):
    task = get_task(task_id)
    what, lost, other_resource_cases = RESOURCE_BUGS[(task_id, bug)]
    (bound,) = [b for b in task.bounds if b.what == what]
    report = run_checks(task_id, dict(bugs[task_id])[bug])
    by_name = {c.name: c for c in report.cases}
    bound_case = by_name[f"{bound.what} is within {bound.formula}"]
    assert bound_case.status == "failed" and lost in bound_case.message, bound_case.message
    assert "x the bound" in bound_case.message
    resource = {bound_case.name} | {n for n in by_name if n.startswith(tuple(other_resource_cases))}
    for name, case in by_name.items():  # every value case passes
        assert name in resource or case.status == "passed", (name, case.message)
    assert report.score <= sum(c.max_points for n, c in by_name.items() if n not in resource) + 1e-9


def test_a_forward_hidden_in_an_opaque_call_scores_0_and_the_feedback_names_the_op(bugs):
    # The breaks are hidden, not removed: fullgraph=True compiles and the values are right, so
    # only what the captured graph holds tells. Any opaque node (a custom op, allow_in_graph)
    # makes the compiled run a forbidden use: 0 for the task.
    report = run_checks("7.4", dict(bugs["7.4"])["hides the eager forward in one custom op"])
    assert report.score == 0 and report.cases[0].status == "forbidden", report.to_text()
    assert "the custom op kitbugs::graph_break_net" in report.cases[0].message
    assert "hides the forward from the compiler" in report.cases[0].message


def test_lesson07_states_what_each_task_bounds():
    bounds = {t.id: [(b.what, b.unit) for b in t.bounds] for t in lesson_tasks(7)}
    assert bounds == {
        "7.1": [],
        "7.2": [],  # a loss scaler and a meter bound nothing
        "7.3": [("bytes kept after the forward with every block checkpointed", "bytes")],
        "7.4": [("model FLOPs the captured graph does not show", "FLOPs")],
    }


# --------------------------------------------------------------------------- the lesson


@pytest.mark.slow
def test_lesson07_runs_headless_with_its_solutions_and_shows_what_it_claims():
    result = run_headless(LESSON, timeout=300, budget=240)
    printed = printed_text(result)
    formula = [line for line in printed.splitlines() if line.startswith("T=")]
    assert len(formula) == 4 and all(line.split()[3] == line.split()[6] for line in formula)
    # the constants derived from the student's count: Korthikanti's 16 values, + (2 * 2 + a) per
    # token
    assert (
        "derived: alpha = 64 bytes (16 fp32 values) per token and hidden unit, beta = 32 bytes"
        in printed
    )
    memory = [float(line.split(":")[1].split()[0]) for line in printed.splitlines()
              if line.split(":")[0].strip() in ("none", "every 4", "every 2", "every 1")]
    assert len(memory) == 4 and memory == sorted(memory, reverse=True) and memory[0] > 4 * memory[3]
    assert "refused: BF16 all reduce communication hook required" in printed
    assert "layer output torch.bfloat16, sharded weight torch.float32" in printed
    assert "4 graphs, 3 graph breaks" in printed
    assert "bucket_cap_mb=25: graphs holding [" in printed
    graphs = {line.split(":")[0]: line.count(",") + 1 for line in printed.splitlines()
              if line.startswith("bucket_cap_mb=")}
    assert graphs == {"bucket_cap_mb=25": 2, "bucket_cap_mb=1": 4}
    assert "same result: True" in printed
    check_outputs(result)


@pytest.mark.parametrize("threads", [1, 2])
def test_bitwise_checkpoint_cases_hold_whatever_thread_count_each_side_runs_with(threads):
    # The batch grader computes the expectation in its own process and runs the student's code in
    # a sandboxed worker, whose intra-op thread counts may differ (the gradients then differ by
    # ~1e-8).
    from conftest import solutions

    from autograder.registry import get_task

    task, impl = get_task("7.3"), solutions(7).apply_checkpointing
    before = torch.get_num_threads()
    try:
        for case in task.cases[:2]:
            torch.set_num_threads(threads)
            got = case.run(impl, 0)
            torch.set_num_threads(3 - threads)
            case.compare(got, task.expected(case, 0))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bug, case, regime", [
    ("a frozen parameter's .grad (None) is tested and unscaled: TypeError", "a frozen parameter",
     "a frozen parameter (2.weight, .grad None)"),
    ("unscales fp16 gradients instead of refusing them as GradScaler does", "fp16 gradients",
     "fp16 gradients (the model cast to fp16"),
    ("refuses every gradient that is not fp32: bf16 too", "bf16 parameters", "bf16 gradients"),
])
def test_a_scaler_wrong_at_an_edge_fails_that_edge_alone_with_feedback_naming_the_regime(
        bugs, bug, case, regime):
    report = run_checks("7.1", dict(bugs["7.1"])[bug])
    failed = [c for c in report.cases if c.status != "passed"]
    assert [c.name[:len(case)] for c in failed] == [case], report.to_text()
    assert failed[0].message.startswith(regime), failed[0].message


def test_the_scaler_refuses_fp16_gradients_as_torch_does_and_takes_bf16(solution):
    from autograder.lesson07 import _fp16_step

    ours, theirs = _fp16_step(solution.DynamicLossScaler, 0), _fp16_step(_torch_scaler, 0)
    assert ours["raised"] == theirs["raised"] == "ValueError" and not ours["stepped"]
    assert "fp16" in ours["message"] and "FP16" in theirs["message"]
    a = _train_scaled(solution.DynamicLossScaler, 0, dtype=torch.bfloat16)
    b = _train_scaled(_torch_scaler, 0, dtype=torch.bfloat16)
    assert a["scales"] == b["scales"] and a["stepped"] == b["stepped"] and False in a["stepped"]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])

"""The hard gates: code that uses what its task re-implements, or the grader's code, scores 0.

Each exploit below once got full or most marks; each stands for a class of routes
(a name bound before the checks, a ProcessGroup method, a functional collective, a computed
name, a swallowed exception, a subclass, a wrapper around torch DDP, the grader's reference, a
copy of its code or of a library's made at load time, a deprecated alias, a private helper or
C++ op, a module's internals).
A failure here means a student can get the points of a task without doing it.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import re
import sys
import textwrap
import tokenize
import types
from pathlib import Path

import pytest

from autograder import course, gates
from autograder.checking import run_checks
from autograder.loading import load_tasks
from autograder.registry import get_task, lesson_tasks

sys.path.insert(0, str(Path(__file__).parent))

EXPLOITS = [
    ("0.1", "lesson00", "asks torch's DistributedSampler"),
    ("1.1", "lesson01", "calls broadcast imported before the checks started"),
    ("1.1", "lesson01", "calls ProcessGroup.broadcast"),
    ("1.2", "lesson01", "calls all_reduce imported before the checks started"),
    ("1.2", "lesson01", "a star: every rank sends to rank 0, which sums and sends back"),
    ("1.2", "lesson01", "calls ProcessGroup.allreduce"),
    ("1.2", "lesson01", "calls a functional collective"),
    ("1.2", "lesson01", "finds all_reduce by a computed name"),
    ("1.2", "lesson01", "catches the gate's exception and tries another route"),
    ("1.2", "lesson01", "calls the grader's reference"),
    ("1.4", "lesson01", "calls the grader's least-squares reference"),
    ("1.4", "lesson01", "predicts with kit.lessons.costmodel.ring_all_reduce_time"),
    ("3.1", "lesson03", "is torch's DistributedSampler (a subclass with no body)"),
    ("4.1", "lesson04", "wraps torch's DistributedDataParallel"),
    ("4.2", "lesson04", "wraps torch's DistributedDataParallel"),
    ("4.3", "lesson04", "wraps torch's DistributedDataParallel"),
    # code identity: copies made at load time, of the grader's code and of a library's private
    # helper
    ("1.2", "lesson01", "copies the grader's reference code at load time"),
    ("8.3", "lesson08", "sends through a load-time copy of torch's private schedules._batch_p2p"),
    ("9.4", "lesson09", "runs a load-time copy of the module's forward"),  # a forbidden kit method
    # a subclass of the grader's reference class
    ("6.2", "lesson06", "subclasses the grader's reference TrainingState"),
    ("10.2", "lesson10", "subclasses the grader's reference layer"),
    # deprecated aliases
    ("6.1", "lesson06", "wraps DCP's deprecated save_state_dict/load_state_dict"),
    ("7.1", "lesson07", "wraps the deprecated torch.cuda.amp.GradScaler"),
    # private helpers: a C++ op by a computed name, a module's private function
    ("7.1", "lesson07", "updates the scale with torch's private _amp_update_scale_ op"),
    ("8.4", "lesson08", "takes torch's order from the private schedules._get_1f1b_rank_ops"),
    ("8.5", "lesson08", "takes torch's order from ScheduleInterleaved1F1B's private rank ops"),
    # the kit's own module, whose forward the task writes
    ("9.4", "lesson09", "calls the module's own forward and pair_bias"),
    # a library's batching, called on an object the student made
    ("9.2", "lesson09", "fair-esm's get_batch_indices builds the batches"),
]


def _bug(module: str, task_id: str, what: str):
    return dict(importlib.import_module(f"bugs.{module}").BUGS[task_id])[what]


@pytest.mark.parametrize(("task_id", "module", "what"), EXPLOITS)
def test_exploit_scores_zero_on_its_task(task_id, module, what):
    report = run_checks(task_id, _bug(module, task_id, what))
    assert report.score == 0, report.to_text()


@pytest.mark.parametrize(("task_id", "module", "what"), [e for e in EXPLOITS if "star" not in e[2]])
def test_gate_names_what_was_used_and_where(task_id, module, what):
    report = run_checks(task_id, _bug(module, task_id, what))
    assert report.status == "forbidden", report.to_text()
    message = next(c.message for c in report.cases if c.status == "forbidden")
    assert f"Task {task_id} uses " in message
    # file:line of the student's code: the bugs module, or the edited solution a bug is built from
    stem = course.lesson(int(task_id.split(".")[0])).stem
    assert re.search(rf"(bugs/{module}|{stem}\w*)\.py:\d+", message), message


def test_blocking_hook_gets_at_most_half_of_task_4_2():
    report = run_checks(
        "4.2", _bug("lesson04", "4.2", "all-reduces in the hook but blocks there (no overlap)")
    )
    assert report.score <= get_task("4.2").points / 2, report.to_text()


def test_the_students_call_is_caught_inside_the_graders_harness():
    # 3.1's harness builds torch's DistributedSampler itself (its hypothesis search compares
    # with it): that is allowed, and solutions pass (tests/test_checks.py). A sampler the
    # student builds from it is not, even one made in a nested function.
    from torch.utils.data import DistributedSampler

    from autograder.checking import run_case

    def student_sampler(dataset, **kw):
        return DistributedSampler(dataset, **kw)

    task = get_task("3.1")
    result = run_case(task, task.cases[0], student_sampler)
    assert result.status == "forbidden"
    assert "torch.utils.data.DistributedSampler" in result.message
    assert "test_gates.py:" in result.message


def test_guard_restores_every_function_it_watched():
    import torch.distributed as dist

    code = dist.all_reduce.__code__
    with gates.guard(get_task("1.2"), None):
        assert dist.all_reduce.__code__ is not code
    assert dist.all_reduce.__code__ is code
    assert not gates._swapped


def test_inside_watching_a_tasks_cases_share_its_trampolines_and_every_use_is_still_caught():
    """gates.watching (run_checks, the sandbox worker): a task's functions are swapped once for
    all its cases; between cases a trampoline calls the original; another task's case gets its
    own set, without the first task's; on leaving, every function has its own code again."""
    import torch.distributed as dist

    code, bcast = dist.all_reduce.__code__, dist.broadcast.__code__
    ring, tree = get_task("1.2"), get_task("1.1")  # forbid all_reduce / broadcast (COLLECTIVES)
    ring_only = types.SimpleNamespace(id="99.2", forbidden=("torch.distributed.all_reduce",))

    def student():  # a student's call: its file is this test's, not the grader's
        dist.all_reduce(None)

    with gates.watching():
        with gates.guard(ring, None):
            trampoline = dist.all_reduce.__code__
            assert trampoline is not code
        assert dist.all_reduce.__code__ is trampoline  # kept between the cases
        with pytest.raises(TypeError, match="Expected parameter `tensor`"):  # no gate: the original
            student()
        with pytest.raises(gates.ForbiddenUse, match="all_reduce"), gates.guard(ring, None):
            student()  # the next case of the task: still caught
        swapped = dict(gates._swapped)
        with gates.guard(tree, None):
            assert gates._swapped.keys() == swapped.keys()  # the same names: nothing swapped again
        with gates.guard(ring_only, None):  # fewer names: broadcast is no longer watched
            assert dist.broadcast.__code__ is bcast and dist.all_reduce.__code__ is not code
    assert dist.all_reduce.__code__ is code and dist.broadcast.__code__ is bcast
    assert not gates._swapped and gates._installed is None


# --------------------------------------------------------------------------- the nets, one by one
# A task here is only what the gates read (an id and its forbidden names); the student's module
# is written to a file and imported, as load_tasks does with a notebook.


def _task(*forbidden: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(id="99.1", forbidden=forbidden)


@pytest.fixture
def student_module(tmp_path, monkeypatch):
    """``make(source)`` -> a module imported from a file holding ``source``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    made = []

    def make(source: str) -> types.ModuleType:
        name = f"student_{len(made)}_{tmp_path.name}".replace("-", "_")
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        made.append(name)
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)


def test_a_module_prefix_forbids_its_private_helpers_in_the_source(student_module):
    module = student_module("""
        from torch.distributed.pipelining import schedules

        def order(stages):
            return schedules._format_pipeline_order({})
        """)
    found = gates.check_source(_task("torch.distributed.pipelining"), module.order)
    assert found is not None
    assert found.what == ("torch.distributed.pipelining "
                          "(torch.distributed.pipelining.schedules._format_pipeline_order)")
    assert found.where.endswith(".py:5")


def test_a_module_prefix_forbids_its_functions_reached_by_computed_names(student_module):
    module = student_module("""
        import importlib

        def order(stages):
            schedules = importlib.import_module("torch.distributed." + "pipelining.schedules")
            return getattr(schedules, "_format_" + "pipeline_order")({})
        """)
    task = _task("torch.distributed.pipelining")
    assert gates.check_source(task, module.order) is None  # nothing to see in the source
    with pytest.raises(gates.ForbiddenUse, match="torch.distributed.pipelining"):
        with gates.guard(task, module.order):
            module.order(2)


def test_a_builtin_op_is_caught_on_every_route_while_a_case_runs(student_module):
    module = student_module("""
        import torch

        def update(scale, growth, found):
            getattr(torch, "_amp_" + "update_scale_")(scale, growth, found, 2.0, 0.5, 100)

        def update_by_op(scale, growth, found):
            torch.ops.aten._amp_update_scale_.default(scale, growth, found, 2.0, 0.5, 100)
        """)
    import torch

    args = torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.zeros(1)
    task = _task("torch._amp_update_scale_")
    for fn in (module.update, module.update_by_op):
        with pytest.raises(gates.ForbiddenUse, match="_amp_update_scale_"):
            with gates.guard(task, fn):
                fn(*args)
    fn(*args)  # outside a case the op is nobody's business


def test_a_forbidden_module_imported_at_run_time_is_caught(student_module, tmp_path):
    (tmp_path / "gate_library").mkdir()
    (tmp_path / "gate_library" / "__init__.py").write_text("")
    (tmp_path / "gate_library" / "helpers.py").write_text("def answer():\n    return 42\n")
    import gate_library  # noqa: F401 - the package is loaded, its submodule is not

    module = student_module("""
        import importlib

        def solve():
            return importlib.import_module("gate_library." + "helpers").answer()
        """)
    with pytest.raises(gates.ForbiddenUse, match="imported at run time: gate_library.helpers"):
        with gates.guard(_task("gate_library"), module.solve):
            module.solve()
    sys.modules.pop("gate_library.helpers", None)
    sys.modules.pop("gate_library", None)


def test_a_copy_of_the_graders_code_made_at_load_time_is_caught_anywhere_in_the_module(
    student_module,
):
    module = student_module("""
        import importlib
        import types

        _reference = importlib.import_module("autograder.gates")._trampoline
        _helper = types.FunctionType(_reference.__code__, globals())

        def solve(x):
            return globals()["_hel" + "per"](x)  # no name of the helper in the source
        """)
    found = gates.check_source(_task(), module.solve)
    assert found is not None and "a copy of autograder.gates._trampoline" in found.what
    assert found.where.endswith(".py:6")  # the line that made the copy


_REFERENCE = """
def reference_balanced_split(n, rank, world_size):
    sizes = [n // world_size + (1 if r < n % world_size else 0) for r in range(world_size)]
    if any(size < 0 for size in sizes):
        raise ValueError(f"cannot split {n} items over {world_size} ranks")
    start = sum(sizes[:rank])
    return range(start, start + sizes[rank])
"""


def _grader_module(monkeypatch):
    """A reference of the grader's, compiled from autograder/ as a lesson's are, its source
    readable as a file's would be (linecache)."""
    import linecache

    grader = types.ModuleType("autograder.references.lesson99")
    grader.__file__ = str(Path(gates.__file__).parent / "references" / "lesson99.py")
    monkeypatch.setitem(linecache.cache, grader.__file__,
                        (len(_REFERENCE), None, _REFERENCE.splitlines(True), grader.__file__))
    exec(compile(_REFERENCE, grader.__file__, "exec"), vars(grader))
    monkeypatch.setitem(sys.modules, grader.__name__, grader)
    return grader


def test_a_pasted_copy_of_a_reference_is_caught_by_its_bytecode(student_module, monkeypatch):
    _grader_module(monkeypatch)
    pasted = _REFERENCE.replace("reference_balanced_split", "shard_range")
    module = student_module(pasted)
    found = gates.check_source(_task(), module.shard_range)
    assert found is not None
    assert "a copy of autograder.references.lesson99.reference_balanced_split" in found.what
    assert found.where.endswith(".py:2")
    renamed = pasted.replace("sizes", "counts").replace("size", "count")  # other local names
    assert gates.check_source(_task(), student_module(renamed).shard_range) is not None
    edited = pasted.replace("cannot split", "can not split")  # a constant changed: other bytecode
    found = gates.check_source(_task(), student_module(edited).shard_range)
    assert found is not None and "a rewritten copy of" in found.what  # the same statements


def _relabelled(source: str, swap: tuple[int, int] | None = None) -> str:
    """``source`` with every name and argument renamed, every number nudged, reformatted by
    ast.unparse, and (``swap``) two statements of the function body exchanged."""
    tree = ast.parse(textwrap.dedent(source))
    names: dict[str, str] = {}

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            node.id = names.setdefault(node.id, f"n{len(names)}_x")
            return node

        def visit_arg(self, node):
            node.arg = names.setdefault(node.arg, f"n{len(names)}_x")
            return node

        def visit_Constant(self, node):
            if isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
                node.value = node.value + 1
            elif isinstance(node.value, str):
                node.value = node.value.upper()
            return node

    tree = Rename().visit(tree)
    fn = tree.body[0]
    fn.name = "relabelled"
    if swap is not None:
        i, j = swap
        fn.body[i], fn.body[j] = fn.body[j], fn.body[i]
    return ast.unparse(tree)


def test_a_reference_relabelled_reordered_and_reformatted_is_caught(student_module, monkeypatch):
    grader = _grader_module(monkeypatch)
    # names, constants, layout and the order of two independent statements all changed
    module = student_module(
        _relabelled(_REFERENCE, swap=(0, 1)).replace("relabelled", "shard_range")
    )
    assert module.shard_range.__code__.co_code != grader.reference_balanced_split.__code__.co_code
    found = gates.check_source(_task(), module.shard_range)
    assert found is not None, "a relabelled copy of a reference passed"
    assert (
        "a rewritten copy of autograder.references.lesson99.reference_balanced_split" in found.what
    )
    assert "100% of its statements" in found.what


def test_rdkits_enrichment_code_relabelled_is_refused_on_the_task_that_forbids_it(student_module):
    # Task 10.4 forbids rdkit.ML.Scoring: its code pasted with every name changed is still it.
    from rdkit.ML.Scoring import Scoring

    for fn in (Scoring.CalcEnrichment, Scoring.CalcBEDROC):
        module = student_module("import math\n\n" + _relabelled(inspect.getsource(fn)))
        found = gates.check_source(_task("rdkit.ML.Scoring"), module.relabelled)
        assert found is not None, f"{fn.__name__} relabelled passed"
        assert f"a rewritten copy of rdkit.ML.Scoring (rdkit.ML.Scoring.Scoring.{fn.__name__})" \
            in found.what, found.what


def test_solutions_are_no_rewritten_copies_and_only_the_solution_shaped_references_are_skipped():
    # The likeness gate must never refuse honest work: the solutions are the most alike honest
    # code there is. Those references a solution writes statement for statement are skipped by
    # name (gates.SOLUTION_SHAPED); the list holds exactly them.
    from autograder import likeness
    from autograder.registry import checked_lessons

    references = {}
    for lesson in checked_lessons():
        try:
            module = importlib.import_module(f"autograder.references.lesson{lesson:02d}")
        except ModuleNotFoundError:
            continue
        for value in vars(module).values():
            if (
                isinstance(value, (types.FunctionType, type))
                and value.__module__ == module.__name__
            ):
                references[f"{module.__name__}.{value.__qualname__}"] = likeness.shape(value)
    matched = set()
    for spec in course.LESSONS:
        path, tasks = spec.source, lesson_tasks(spec.number)
        if not tasks:
            continue
        solution = load_tasks(path)
        for task in tasks:
            impl = getattr(solution, task.name)
            assert gates.check_source(task, impl) is None, (
                f"{task.id}: {gates.check_source(task, impl)}"
            )
            mine = likeness.shape(impl) or {}
            matched |= {name for name, ref in references.items()
                        if ref and likeness.likeness(mine, ref) >= likeness.THRESHOLD}
    assert matched == gates.SOLUTION_SHAPED


def test_small_functions_alike_are_not_copies(student_module):
    # The bytecode of `return x` or a one-line formula is everyone's: only its file gives a copy
    # away.
    module = student_module("""
        def ring_all_reduce_time(nbytes, world_size, alpha, beta):
            return 2 * (world_size - 1) * alpha + 2 * (world_size - 1) / world_size * nbytes * beta
        """)
    assert gates.check_source(_task("kit.lessons.costmodel.ring_all_reduce_time"),
                              module.ring_all_reduce_time) is None


def test_a_subclass_of_a_graders_class_reached_by_a_computed_name_is_caught(student_module):
    module = student_module("""
        import importlib

        _Base = getattr(importlib.import_module("autograder." + "registry"), "Ca" + "se")

        class Case(_Base):
            pass
        """)
    found = gates.check_source(_task(), module.Case)
    assert found is not None and "autograder.registry.Case (as a base class of Case)" in found.what


def test_trampolines_keep_each_functions_signature():
    import torch.distributed as dist

    before = inspect.signature(dist.all_reduce)
    with gates.guard(get_task("1.2"), None):
        assert dist.all_reduce.__code__ is not gates._swapped[id(dist.all_reduce)][3]
        assert inspect.signature(dist.all_reduce) == before


# ------------------------------------------------------------------ every task says what it forbids

ROOT = Path(__file__).resolve().parents[1]
LESSON_CHECKS = sorted((ROOT / "autograder").glob("lesson[0-9][0-9].py"))
FORBIDS_NOTHING = re.compile(r"#\s*forbids nothing:\s*\S.{8,}")
# Libraries a forbidden name may point into without being installed: none is a dependency of the
# course (pyproject.toml), so a student's environment may lack them, and then so does the cheat.
OPTIONAL = {
    "deepchem": "DeepChem's ScaffoldSplitter (10.3): not a dependency, the grader re-states it",
    "scipy": "scipy.stats.linregress (1.4): not a dependency, installed only alongside others",
    "sklearn": "scikit-learn's linear models (1.4): not a dependency, installed only alongside "
               "others",
}


def _registrations(path: Path) -> list[tuple[ast.Call, ast.stmt]]:
    """Every ``task(...)`` call of a lesson's checks, with the statement it stands in."""
    found = []
    for stmt in ast.parse(path.read_text()).body:
        for node in ast.walk(stmt):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "task"
            ):
                found.append((node, stmt))
    return found


def _comments(path: Path) -> dict[int, str]:
    with path.open() as f:
        return {t.start[0]: t.string for t in tokenize.generate_tokens(f.readline)
                if t.type == tokenize.COMMENT}


@pytest.mark.parametrize("path", LESSON_CHECKS, ids=lambda p: p.stem)
def test_every_task_declares_what_it_forbids_or_says_why_nothing(path):
    comments, lines = _comments(path), path.read_text().splitlines()
    registrations = _registrations(path)
    assert registrations, f"{path.name} registers no task"
    for call, stmt in registrations:
        forbidden = next((k.value for k in call.keywords if k.arg == "forbidden"), None)
        if forbidden is not None and not (isinstance(forbidden, ast.Tuple) and not forbidden.elts):
            continue
        first = stmt.lineno
        while first > 1 and lines[first - 2].strip().startswith("#"):  # the comments right above
            first -= 1
        said = [comments[n] for n in range(first, stmt.end_lineno + 1) if n in comments]
        task_id = ast.literal_eval(call.args[0]) if call.args else "?"
        assert any(FORBIDS_NOTHING.search(c) for c in said), (
            f"{path.name}:{call.lineno}: task {task_id} forbids nothing; give it forbidden=(...) "
            "naming what it re-implements, or say why with a comment '# forbids nothing: <why>'")


def _forbidden_names() -> list[tuple[str, str]]:
    lessons = sorted(int(p.stem[len("lesson"):]) for p in LESSON_CHECKS)  # every lesson, 11-13 too
    return [
        (t.id, name) for lesson in lessons for t in lesson_tasks(lesson) for name in t.forbidden
    ]


@pytest.mark.parametrize(("task_id", "name"), _forbidden_names())
def test_every_forbidden_name_resolves(task_id, name):
    head = name.split(".")[0]
    if head in OPTIONAL and importlib.util.find_spec(head) is None:
        pytest.skip(f"{head} is not installed: {OPTIONAL[head]}")
    assert gates.resolve(name, load=True) is not None, (
        f"task {task_id} forbids {name!r}, which names nothing here: a typo, or it moved")


PASTED_IN_THE_WORKER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from autograder.grade.sandbox.worker import _NoReferences
sys.meta_path.insert(0, _NoReferences())  # as in the batch worker: the answers are out of reach
from autograder import gates
if sys.argv[2] == "with":
    gates.trust_answer_fingerprints(json.loads(open(sys.argv[3]).read()),
                                    json.loads(open(sys.argv[4]).read()))
import pasted
from autograder.registry import get_task
task = get_task("13.1")
try:  # what the worker does with each case: the untrusted half under the gates
    with gates.guard(task, pasted.route):
        task.cases[0].run(pasted.route, 0)
    print("STATUS ran")
except gates.ForbiddenUse as e:
    print("STATUS forbidden", e)
print("LOADED", sorted(m for m in sys.modules if m.startswith("autograder.references.")))
"""


@pytest.mark.parametrize(
    ("prints", "relabelled"), [("with", False), ("without", False), ("with", True)]
)
def test_a_pasted_reference_scores_zero_in_the_worker_with_the_parents_fingerprints(
    tmp_path, prints, relabelled
):
    # The worker never sees autograder/references/; the parent hands it the references'
    # fingerprints (hashes only), so a pasted copy of route scores 0 there as in check().
    import inspect
    import json
    import subprocess

    from autograder.references import lesson13

    get_task("13.1")
    source = inspect.getsource(lesson13.route)
    if relabelled:  # every name and constant changed: only the shape the parent sent gives it away
        source = _relabelled(source).replace("def relabelled(", "def route(")
    (tmp_path / "pasted.py").write_text(
        "from __future__ import annotations\nimport torch\nfrom kit.lessons.moe import Routing\n\n"
        + source)
    (tmp_path / "prints.json").write_text(json.dumps(gates.answer_fingerprints()))
    (tmp_path / "shapes.json").write_text(json.dumps(gates.answer_shapes()))
    done = subprocess.run([sys.executable, "-c", PASTED_IN_THE_WORKER, str(tmp_path), prints,
                           str(tmp_path / "prints.json"), str(tmp_path / "shapes.json")],
                          capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "LOADED []" in done.stdout, done.stdout
    if prints == "with":
        assert "STATUS forbidden" in done.stdout and "copy of" in done.stdout, done.stdout
        assert ("a rewritten copy of" in done.stdout) == relabelled, done.stdout
    else:  # the test can fail: without the fingerprints the paste runs as a correct route
        assert "STATUS ran" in done.stdout, done.stdout


def test_fingerprints_are_the_same_in_every_process():
    import json
    import subprocess

    from autograder.references import lesson13  # noqa: F401 - its references get fingerprints

    get_task("13.1")
    here = gates.answer_fingerprints()
    code = ("import json; from autograder import gates; from autograder.registry import get_task; "
            "import autograder.references.lesson13; get_task('13.1'); "
            "print(json.dumps(gates.answer_fingerprints()))")
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    theirs = json.loads(other.stdout.strip().splitlines()[-1])
    mine = {k: v for k, v in here.items() if v.startswith("autograder.references.lesson13")}
    assert mine and all(theirs.get(k) == v for k, v in mine.items()), (mine, theirs)


def test_threads_asking_for_the_answer_fingerprints_at_once_all_get_every_one(monkeypatch):
    """A batch's worker threads ask at the same moment: none may read the fingerprints while
    another, having marked them current, is still collecting them (its worker would then not
    recognise a pasted reference)."""
    import threading

    import autograder.references.lesson13  # noqa: F401 - references to fingerprint
    from autograder import gates

    get_task("13.1")
    monkeypatch.setattr(gates, "_grader", gates._GraderCode())
    start, got = threading.Barrier(8), []

    def ask():
        start.wait()
        got.append(gates.answer_fingerprints())

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and got[0] and all(g == got[0] for g in got), [len(g) for g in got]

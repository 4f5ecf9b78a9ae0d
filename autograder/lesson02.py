"""Checks for Lesson 02, "torchrun, elastic restarts and debugging hangs": tasks 2.1 to 2.3.

Task 2.1 ``dist_info_from_env`` is compared with a trusted reader on torchrun's environments
(one process, one node, the second of two nodes) and on malformed ones, which must raise a
``ValueError`` naming the variable. Task 2.2 ``resumable_train`` must reproduce, bit for bit,
an uninterrupted single-process run of the trusted training loop: in this process after a
simulated crash, and under torchrun's own elastic agent (``kit.torchrun.elastic_run``: the
``LocalElasticAgent`` and c10d rendezvous of ``torchrun --standalone --max-restarts=1``, forked
from the grader so no Python starts afresh) with rank 1 killed (SIGKILL) partway through the
first attempt. Task 2.3 ``first_mismatch`` is compared with a trusted
finder on hand-made call sequences. The trusted reader, training loop and finder live in
:mod:`autograder.references.lesson02`, named here by string.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import tempfile
import types
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autograder.compare import CheckFailed, assert_same, describe
from autograder.registry import pickle_for_worker, task

# --------------------------------------------------------------------------- task 2.1

FIELDS = ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "master_addr",
          "master_port", "is_distributed")


def _info_as_dict(info: Any) -> Any:
    """What the student returned, as plain data: the DistInfo fields, or a description."""
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        return {name: getattr(info, name, "<missing>") for name in FIELDS}
    return f"<a {type(info).__name__}, not a DistInfo>"


def _outcome(fn: Callable[..., Any], env: dict[str, str]) -> Any:
    try:
        return _info_as_dict(fn(env))
    except ValueError as e:
        return ["ValueError", str(e)]
    except NotImplementedError:
        raise
    except Exception as e:  # kept as data: on a bad environment, compare names the check missed
        return [type(e).__name__, str(e)[:200]]


# forbids nothing: no library reads torchrun's environment into these fields with these checks
# (torch.distributed reads it only inside init_process_group, which the task must not need).
INFO = task(
    "2.1", reference="dist_info_from_env",
    hint="The environment torchrun sets is the only truth about where a process runs: read "
         "every variable, fall back to one process when it is unset, and refuse (ValueError) "
         "values that are malformed or contradict each other, before anything uses them.",
    recipe="Parse each variable as an integer, turning a parse error into a ValueError that "
           "names the variable; default WORLD_SIZE to 1, RANK to 0, LOCAL_WORLD_SIZE to the "
           "world size, LOCAL_RANK and GROUP_RANK from the rank and the local world size, "
           "MASTER_PORT to 29500. Then check: rank below world size, local rank below local "
           "world size, local world size divides world size, rank equals node rank times local "
           "world size plus local rank, port within 1-65535. is_distributed says whether "
           "WORLD_SIZE was set.",
)

_TORCHRUN_4 = {"RANK": "2", "LOCAL_RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4",
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
_NODE_1_OF_2 = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}


def _info_case(name: str, envs: list[dict[str, str]], hint: str = "", recipe: str = "") -> None:
    def run(dist_info_from_env: Any, seed: int) -> list[Any]:
        return [_outcome(dist_info_from_env, dict(env)) for env in envs]

    INFO.case(name, compare=partial(_compare_infos, envs=envs), hint=hint, recipe=recipe)(run)


LOCAL_RANK_HINT = ("LOCAL_RANK is the process's rank on its own node (which GPU it drives), "
                   "RANK its rank in the whole job: they differ on every node but the first. "
                   "Read local_rank from LOCAL_RANK, not from RANK.")


def _local_rank_ignored(got: Any, env: dict[str, str]) -> bool:
    """True if the result's local rank is its global rank although LOCAL_RANK said otherwise:
    LOCAL_RANK was not read (RANK stood in for it)."""
    return (isinstance(got, dict) and "LOCAL_RANK" in env
            and got.get("local_rank") == got.get("rank")
            and env["LOCAL_RANK"] != str(got.get("local_rank")))


def _compare_infos(got: Any, expected: list[Any], envs: list[dict[str, str]]) -> None:
    if not isinstance(got, list) or len(got) != len(expected):
        raise CheckFailed("could not collect one result per environment", got=describe(got))
    for g, e, env in zip(got, expected, envs):
        if g != e and _local_rank_ignored(g, env):
            raise CheckFailed(f"with LOCAL_RANK={env['LOCAL_RANK']!r} the local rank is "
                              f"{g['local_rank']}, the global rank: LOCAL_RANK was not read",
                              expected=e if isinstance(e, dict) else f"ValueError: {e[1]}", got=g,
                              hint=LOCAL_RANK_HINT, cause="local rank is the rank")
        if isinstance(e, list):  # the reference raised: the student must too, naming the variable
            variable = e[1].split("=")[0]
            if isinstance(g, list) and g[0] != "ValueError":
                raise CheckFailed(f"with {e[1].split(' ')[0]} it raised {g[0]} ({g[1]}) instead of "
                                  f"a ValueError naming {variable}: the value was used before it "
                                  "was checked", expected=f"ValueError mentioning {variable}",
                                  got=f"{g[0]}: {g[1]}", cause="used before checked",
                                  hint="Check every value before anything uses it: a world has at "
                                       "least one process, a rank is at least 0, and the ranks "
                                       "lie inside their worlds.")
            if not isinstance(g, list):
                raise CheckFailed(f"accepted a bad environment ({e[1]}) instead of raising "
                                  "ValueError", expected=f"ValueError mentioning {variable}", got=g)
            if variable not in g[1]:
                raise CheckFailed(f"the ValueError does not name the variable {variable}",
                                  expected=f"a message mentioning {variable}", got=g[1],
                                  hint="Say which variable is wrong and what it should be.")
            continue
        if isinstance(g, list):
            raise CheckFailed(f"raised {g[0]} on a valid environment: {g[1]}", expected=e, got=g[1])
        assert_same(g, e)


_info_case("no torchrun variables: a single process", [{}],
           hint="Unset variables mean one process: rank 0 of a world of 1, not distributed.")
_info_case("torchrun --standalone --nproc-per-node=4, rank 2", [_TORCHRUN_4])
_info_case("torchrun with one worker: WORLD_SIZE=1 is still distributed",
           [{"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
             "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}],
           hint="is_distributed says whether WORLD_SIZE is set, not whether it is above 1.")
_info_case("rank 5 of 8 on the second of two nodes", [_NODE_1_OF_2],
           hint="GROUP_RANK is the node's rank; LOCAL_RANK counts from 0 on every node.")
_info_case("only RANK and WORLD_SIZE set", [{"RANK": "3", "WORLD_SIZE": "4"}],
           hint="Without LOCAL_WORLD_SIZE assume one node: the local world is the whole world.")
_info_case("malformed values raise ValueError", [
    {"RANK": "two", "WORLD_SIZE": "4"}, {"RANK": "0", "WORLD_SIZE": "0"},
    {"RANK": "-1", "WORLD_SIZE": "4"}, {"MASTER_PORT": "70000"}, {"LOCAL_RANK": "1.5"},
], hint="int() raises on '1.5' and 'two'; catch that and raise ValueError naming the variable.")
_info_case("inconsistent values raise ValueError", [
    {"RANK": "4", "WORLD_SIZE": "4"},
    {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3"},
    {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
    {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"},
], hint="The values must agree with each other: every rank inside its world, nodes of equal "
        "size, and the global rank fixed by the node's rank and the local rank.",
   recipe="Raise ValueError when the rank is not below the world size, the local rank not below "
          "the local world size, the local world size does not divide the world size, or the "
          "rank is not node rank times local world size plus local rank.")


def _read_environ_on_rank(dist_info_from_env: Any, seed: int) -> Any:
    info = _info_as_dict(dist_info_from_env())
    if isinstance(info, dict):
        info.pop("master_port")  # kit.launch picks a free port: not comparable
    return info


# A module-level rank function, wrapped apart from its name, so that spawned ranks import it.
_environ_on_ranks = INFO.shared(_read_environ_on_rank, world_size=2, timeout=30.0)
INFO.case("reads os.environ when env is None (2 ranks under kit.launch)", uses=_environ_on_ranks,
          expect="environ_of_two_ranks",
          hint="Called without an argument the function reads the real environment of the "
               "process (os.environ), as it must under torchrun.")


# --------------------------------------------------------------------------- task 2.2
# The expected parameters come from the references' copy of the lesson's model, data and
# train_step (its setup cell), never from the student's module.

GLOBAL_BATCH, MICROBATCHES, TOTAL_STEPS, CRASH_STEP = 8, 2, 6, 3


class SimulatedCrash(Exception):
    """Raised by the check's train_step to stop a run in this process, like a crash."""


def _hooked(impl: Any, hook: Callable[[Any], Any]) -> Any:
    """``impl`` with ``hook(original_train_step)`` in place of its global ``train_step``."""
    globs = getattr(impl, "__globals__", None)
    if not isinstance(impl, types.FunctionType) or globs is None or "train_step" not in globs:
        return None
    return types.FunctionType(impl.__code__, {**globs, "train_step": hook(globs["train_step"])},
                              impl.__name__, impl.__defaults__, impl.__closure__)


_NO_TRAIN_STEP = ("resumable_train must be a function that calls the lesson's train_step(model, "
                  "optimizer, step) once per step (the check watches those calls)")


def _plain_params(params: Any) -> Any:
    if isinstance(params, Mapping) and all(isinstance(v, torch.Tensor) for v in params.values()):
        return {str(k): v.detach().cpu().clone() for k, v in params.items()}
    return f"<a {type(params).__name__}, not a dict of tensors>"


def _compare_params(got: Any, expected: dict[str, torch.Tensor]) -> None:
    if isinstance(got, str):
        raise CheckFailed(got, expected="dict of parameter tensors (model.state_dict())", got=got)
    assert_same(got, expected, rtol=0.0, atol=0.0, path="final parameters")


# forbids nothing: the loop is built from torch.save, torch.load and os.replace, which it must
# call; no library resumes a training loop (DCP, a different format, is Lesson 06's).
TRAIN = task(
    "2.2",
    hint="A restart runs the script from the top: everything the next step depends on (the "
         "weights, the optimizer's state, the step number) must be on disk, written so that a "
         "crash never leaves half a checkpoint, and the run must continue from it exactly.",
    recipe="At the start, if the checkpoint file exists, load it (onto the CPU) and restore the "
           "model, the optimizer and the next step. For each remaining step call train_step with "
           "the real step number; after it, on rank 0 only, save model, optimizer and step + 1 "
           "to a temporary file and os.replace it over the checkpoint; then, when distributed, "
           "wait at a barrier. Return the final state_dict.",
)


@TRAIN.case("an uninterrupted run equals the reference exactly",
            expect="uninterrupted_run")
def _(resumable_train: Any, seed: int) -> Any:
    with tempfile.TemporaryDirectory(prefix="kit-ckpt-") as ckpt_dir:
        return _plain_params(resumable_train(ckpt_dir, TOTAL_STEPS))


def _compare_resumed(got: Any, expected: dict[str, torch.Tensor]) -> None:
    if isinstance(got, str):
        raise CheckFailed(got)
    first, second = got["steps"]
    if first != list(range(CRASH_STEP + 1)):
        raise CheckFailed(f"before the crash at step {CRASH_STEP}, train_step ran steps {first}",
                          expected=list(range(CRASH_STEP + 1)), got=first)
    if second and second[0] == 0 and len(second) < TOTAL_STEPS:
        # it resumed (it ran only the steps that were left) but numbered them from 0 again
        raise CheckFailed(f"after the crash the run resumed for the {len(second)} steps that were "
                          f"left, but called train_step with steps {second}: the step count "
                          "started again at 0, so the first batches were replayed",
                          expected=list(range(TOTAL_STEPS - len(second), TOTAL_STEPS)), got=second,
                          cause="step numbers restart",
                          hint="Pass the real step number to train_step: it picks the batch. "
                               "Counting from 0 again replays the data from the beginning.")
    if not second or second[0] == 0:
        raise CheckFailed("after the crash the run started again from step 0 instead of resuming "
                          "from its checkpoint",
                          expected=f"steps 1..{CRASH_STEP} to {TOTAL_STEPS - 1}",
                          got=second, hint="Load the checkpoint at the start of resumable_train.",
                          cause="never resumes")
    if second != list(range(second[0], TOTAL_STEPS)):
        raise CheckFailed("after resuming, train_step did not get the steps that were left, in "
                          "order",
                          expected=list(range(second[0], TOTAL_STEPS)), got=second,
                          hint="Pass the real step number to train_step: it picks the batch. "
                               "Counting from 0 again replays the data from the beginning.",
                          cause="wrong steps after resuming")
    try:
        _compare_params(got["params"], expected)
    except CheckFailed as e:
        # the steps were right: what differs is state the checkpoint did not carry over
        raise CheckFailed(f"the run resumed at the right step and ran the right steps, but "
                          f"{e.message}: part of the training state was not restored",
                          expected=e.expected, got=e.got, cause="state not restored",
                          hint="The step and the weights are not all a step depends on: the "
                               "optimizer's state (momentum buffers) must be saved and loaded "
                               "too, or the first steps after a restart move differently.") from e


@TRAIN.case(f"a crash at step {CRASH_STEP} then a rerun resumes and ends exactly as the reference",
            compare=_compare_resumed, expect="uninterrupted_run")
def _(resumable_train: Any, seed: int) -> Any:
    attempts: list[list[int]] = [[], []]
    attempt = [0]

    def hook(original: Callable[..., Any]) -> Callable[..., Any]:
        def train_step(model: Any, optimizer: Any, step: int) -> Any:
            attempts[attempt[0]].append(int(step))
            if attempt[0] == 0 and step == CRASH_STEP:
                raise SimulatedCrash(f"simulated crash at step {step}")
            return original(model, optimizer, step)
        return train_step

    run = _hooked(resumable_train, hook)
    if run is None:
        return _NO_TRAIN_STEP
    with tempfile.TemporaryDirectory(prefix="kit-ckpt-") as ckpt_dir:
        try:
            run(ckpt_dir, TOTAL_STEPS)
        except SimulatedCrash:
            pass
        else:
            return f"the run did not reach step {CRASH_STEP}: train_step ran {attempts[0]}"
        attempt[0] = 1
        params = _plain_params(run(ckpt_dir, TOTAL_STEPS))
    return {"steps": attempts, "params": params}


# ---- under torchrun's elastic agent: the worker, the kill, and the trusted side reading results

def torchrun_worker(workdir: str) -> None:
    """Inside a torchrun worker: run the pickled resumable_train with rank 1 killed at
    ``CRASH_STEP`` on the first attempt; log every step; save the final parameters."""
    import cloudpickle

    from kit.torchrun import init_process_group_per_attempt

    work = Path(workdir)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group_per_attempt("gloo")
    rank = dist.get_rank()
    impl = cloudpickle.loads((work / "impl.pkl").read_bytes())
    log = work / f"steps-rank{rank}-attempt{restart}.txt"

    def hook(original: Callable[..., Any]) -> Callable[..., Any]:
        def train_step(model: Any, optimizer: Any, step: int) -> Any:
            with open(log, "a") as f:
                f.write(f"{int(step)}\n")
            if restart == 0 and rank == 1 and step == CRASH_STEP:
                os.kill(os.getpid(), signal.SIGKILL)  # a hard crash: no Python cleanup at all
            return original(model, optimizer, step)
        return train_step

    run = _hooked(impl, hook)
    if run is None:
        raise TypeError(_NO_TRAIN_STEP)
    params = _plain_params(run(str(work / "ckpt"), TOTAL_STEPS))
    torch.save(params, work / f"params-rank{rank}.pt")
    dist.destroy_process_group()


def _steps(work: Path, rank: int, attempt: int) -> list[int]:
    path = work / f"steps-rank{rank}-attempt{attempt}.txt"
    return [int(s) for s in path.read_text().split()] if path.exists() else []


@TRAIN.case("under torchrun's elastic agent, --max-restarts=1, rank 1 killed at step "
            f"{CRASH_STEP}: resumes exactly",
            compare=_compare_resumed, expect="uninterrupted_run", weight=2.0)
def _(resumable_train: Any, seed: int) -> Any:
    from kit.torchrun import TorchrunError, elastic_run

    if _hooked(resumable_train, lambda f: f) is None:
        return _NO_TRAIN_STEP
    with tempfile.TemporaryDirectory(prefix="kit-torchrun-") as tmp:
        work = Path(tmp)
        (work / "ckpt").mkdir()
        (work / "impl.pkl").write_bytes(pickle_for_worker(resumable_train))
        try:
            # torchrun's own agent and restart policy, forked from this process (no new Python)
            elastic_run(torchrun_worker, str(work), nproc_per_node=2, max_restarts=1, timeout=120.0)
        except TorchrunError as e:
            return "torchrun failed:\n" + (e.summary or e.output[-2000:])
        per_rank = [torch.load(work / f"params-rank{r}.pt", weights_only=True) for r in range(2)]
        if any(not isinstance(p, dict) for p in per_rank):
            return "a rank returned something other than a dict of tensors"
        steps = [_steps(work, 1, 0), _steps(work, 1, 1)]
        if not steps[1]:
            return "torchrun did not restart the workers: rank 1 never ran a second attempt"
    try:
        assert_same(per_rank[1], per_rank[0], rtol=0.0, atol=0.0, path="rank 1 vs rank 0")
    except CheckFailed as e:
        return f"the ranks ended with different parameters: {e.message}"
    return {"steps": steps, "params": per_rank[0]}


# --------------------------------------------------------------------------- task 2.3

Call = tuple[str, tuple[int, ...]]


def _mismatch_as_dict(m: Any) -> Any:
    if m is None:
        return None
    if not (dataclasses.is_dataclass(m) and not isinstance(m, type)):
        return f"<a {type(m).__name__}, not a Mismatch or None>"
    try:
        calls = {int(r): (None if c is None else (str(c[0]), tuple(int(n) for n in c[1])))
                 for r, c in dict(m.calls).items()}
        return {"index": int(m.index), "ranks": sorted(int(r) for r in m.ranks), "calls": calls}
    except (AttributeError, TypeError, ValueError, IndexError) as e:
        return f"<a Mismatch that could not be read: {e}>"


MISMATCH = task(
    "2.3", reference="first_mismatch",
    # torch's own desync analyser: the flight recorder's fr_trace matches every rank's
    # collectives and reports where they part.
    forbidden=("torch.distributed.flight_recorder",),
    hint="Ranks must call the same collectives, with the same shapes, in the same order: the "
         "first call number where they disagree (a missing call included) is the mismatch, and "
         "the odd ranks are those that differ from the majority.",
    recipe="Walk the call index from 0 up to the length of the longest sequence; a rank with no "
           "call at that index has None there. At the first index where the calls are not all "
           "equal (name and shape), count how often each call occurs; the most common one is "
           "the norm (on a tie, the call of the lowest rank among the tied). Report the index, "
           "every rank's call there, and the sorted ranks whose call differs.",
)


_MISMATCH_HINTS = {  # the hint of each named failure, by its cause
    "missing call ignored": "A rank whose sequence ended early has no call where the others "
                            "have one: that is a mismatch too (zip() would silently stop at the "
                            "shortest).",
    "shape ignored": "Compare the shape as well as the name: same collective, different size.",
    "wrong ranks blamed": "The mismatched ranks are only those whose call differs from the most "
                          "common call at that index (on a tie, the call of the lowest rank "
                          "among the tied): the others are the norm.",
}


def _compare_mismatch(got: Any, expected: Any) -> None:
    """The default comparison, but a wrong set of odd ranks (or none found where there is one)
    is named by what the answer shows: every rank blamed, the majority blamed, a shape ignored,
    a missing call ignored."""
    if isinstance(expected, dict) and got is None:
        at = list(expected["calls"].values())
        names = {c[0] for c in at if c is not None}
        if None in at:
            raise CheckFailed(f"returned None, but at call {expected['index']} rank(s) "
                              f"{expected['ranks']} have no call where the others have one",
                              expected=expected, got=None, cause="missing call ignored",
                              hint=_MISMATCH_HINTS["missing call ignored"])
        if len(names) == 1:
            raise CheckFailed(f"returned None, but at call {expected['index']} the ranks call "
                              f"{names.pop()} with different shapes", expected=expected, got=None,
                              cause="shape ignored", hint=_MISMATCH_HINTS["shape ignored"])
    if (isinstance(expected, dict) and isinstance(got, dict)
            and got.get("index") == expected["index"]
            and got.get("ranks") != expected["ranks"] and isinstance(got.get("ranks"), list)):
        every = sorted(expected["calls"])
        blamed, odd = got["ranks"], expected["ranks"]
        why = ("blamed every rank" if blamed == every else
               "blamed the ranks that make the majority" if sorted(set(every) - set(odd)) == blamed
               else "blamed other ranks")
        raise CheckFailed(f"found the right call ({expected['index']}), but {why}: {blamed}; the "
                          f"odd ones are {odd}, whose call differs from the most common one",
                          expected=odd, got=blamed, cause="wrong ranks blamed",
                          hint=_MISMATCH_HINTS["wrong ranks blamed"])
    assert_same(got, expected)


def _mismatch_case(name: str, calls: dict[int, list[Call]], hint: str = "") -> None:
    def run(first_mismatch: Any, seed: int) -> Any:
        return _mismatch_as_dict(first_mismatch({r: list(c) for r, c in calls.items()}))

    MISMATCH.case(name, hint=hint, compare=_compare_mismatch)(run)


_AR, _BC = "all_reduce", "broadcast"
_mismatch_case("all ranks call the same sequence: None",
               {r: [(_AR, (4, 4)), (_BC, (2,)), ("barrier", ())] for r in range(4)})
_mismatch_case("rank 2 all-reduces a different shape at call 1",
               {r: [(_AR, (4,)), (_AR, (3,) if r == 2 else (8,)), ("barrier", ())]
                for r in range(4)},
               hint=_MISMATCH_HINTS["shape ignored"])
_mismatch_case("rank 0 broadcasts where the others all-reduce",
               {r: [(_BC if r == 0 else _AR, (16,))] for r in range(3)})
_mismatch_case("rank 3 is missing its last call",
               {r: [(_AR, (2,))] * (2 if r == 3 else 3) for r in range(4)},
               hint="A rank whose sequence ended early has no call where the others have one: "
                    "that is a mismatch too (zip() would silently stop at the shortest).")
_mismatch_case("two against two: the tie goes to rank 0's call",
               {r: [("barrier", ()), (_AR if r in (1, 3) else _BC, (5,))] for r in range(4)})
_mismatch_case("two ranks with empty sequences: None",
               {0: [], 1: []})

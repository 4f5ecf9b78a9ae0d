"""Checks for Lesson 12, "Where the time goes": tasks 12.1 to 12.3.

Task 12.1 ``training_flops`` runs in this process on shapes where the MLPs, the attention scores
or the tied output layer dominate, and on shapes drawn from the seed; each count is compared with
``FlopCounterMode``'s count of a real forward and backward of that ``TinyTransformer`` under the
math attention backend (:mod:`autograder.references.lesson12`). Task 12.2 ``step_traffic`` is
asked for every layout on 2 and 4 ranks, for a model whose sizes the seed draws so that FSDP pads;
the answers are the recorder's bytes of the third step of real runs of each layout (DDP,
``ZeroRedundancyOptimizer``, ``fully_shard``, ``parallelize_module``). Task 12.3
``find_straggler`` reads the profiler traces of one 4-rank run of five scenarios of three noisy
steps each (every rank's loader jitters; in one step the slow rank is on time and another
hiccups): one rank made slow in its data loader, its forward or its send; a slow link (every
all-reduce long, no rank late); and a compute straggler among overlapped all-reduces beside a rank
that launches late and one that computes while it waits, on ranks and steps the seed draws.
"""

from __future__ import annotations

import random
from functools import partial
from typing import Any

from autograder.compare import CheckFailed, describe
from autograder.registry import plain, task

LAYOUTS = ("ddp", "zero1", "fsdp", "tp")
WORLD_SIZES = (2, 4)
# What 12.2's trusted runs import before ranks fork: DDP's constructor imports torch._dynamo
# (2 s), FSDP2 and DTensor take seconds more.
TRAFFIC_PRELOAD = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.optim",
                   "torch.distributed.fsdp", "torch.distributed.tensor.parallel")

# --------------------------------------------------------------------------- task 12.1

# (vocab, dim, layers, heads, batch, seq_len) -> what dominates its FLOPs
FLOP_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "the lesson's model": (256, 64, 4, 4, 8, 64),
    "long sequences (attention's scores dominate)": (64, 16, 2, 2, 2, 512),
    "a large vocabulary (the tied output layer dominates)": (8192, 16, 1, 2, 4, 16),
    "one layer, one head, one sequence": (50, 8, 1, 1, 1, 7),
}


# The edges of the count, each against FlopCounterMode's.
EDGE_FLOP_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "no blocks (layers=0): the output layer alone": (50, 8, 0, 2, 3, 5),
    "an empty batch (batch=0): nothing to multiply": (50, 8, 2, 2, 0, 5),
    "one token per sequence and head dim 1 (seq_len=1, dim == heads)": (7, 4, 1, 4, 2, 1),
}
# Shapes TinyTransformer refuses to build: the count must refuse them too.
REFUSED_FLOP_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "dim 10 on 4 heads (dim not a multiple of heads)": (50, 10, 2, 4, 2, 8),
    "no heads (heads=0)": (50, 8, 2, 0, 2, 8),
}


def seeded_flop_shapes(seed: int) -> list[tuple[int, int, int, int, int, int]]:
    """Three shapes drawn from the seed (dim a multiple of heads)."""
    rng = random.Random(seed * 7919 + 12)
    shapes = []
    for _ in range(3):
        heads = rng.choice([1, 2, 3, 4])
        shapes.append((rng.randint(20, 900), heads * rng.randint(2, 12), rng.randint(1, 3), heads,
                       rng.randint(1, 5), rng.randint(3, 80)))
    return shapes


FLOPS = task(
    "12.1",
    # the count is a formula: no counter (FlopCounterMode, the profiler's with_flops, a dispatch
    # mode of one's own) and no model to run it on (the lesson's, or its blocks)
    forbidden=("torch.utils.flop_counter", "kit.meter.count_flops", "kit.lessons.models",
               "torch.profiler", "torch.autograd.profiler",
               "torch.utils._python_dispatch.TorchDispatchMode"),
    hint="Count the matrix multiplications, layer by layer: a (m, k) @ (k, n) product costs "
         "2mkn FLOPs. Per token and layer: the QKV, output and two MLP projections; per sequence "
         "and layer, the scores Q K^T and their product with V over all T x T positions (the "
         "math backend computes every one, masked or not); then the tied output layer over the "
         "vocabulary. Backward costs twice forward: one product for the input's gradient, one "
         "for the weight's.",
    recipe="With N = batch * seq_len tokens and D = dim: per layer 2N(3D)D + 2N D D + 2 * 2N D(4D) "
           "for the projections, plus 2 * 2 batch seq_len^2 D for the two attention products "
           "(heads split D, they do not change the total); add 2 N D vocab for the output layer. "
           "Embeddings, layer norms, GELU, softmax and the loss cost no matmul. Multiply the "
           "forward's sum by 3 and return an int.",
)


@FLOPS.shared
def _flop_answers(training_flops: Any, seed: int) -> dict[str, Any]:
    out = {name: plain(training_flops(*shape)) for name, shape in FLOP_SHAPES.items()}
    out["seeded"] = [plain(training_flops(*shape)) for shape in seeded_flop_shapes(seed)]
    out["edges"] = [_counted_or_raised(training_flops, shape)
                    for shape in EDGE_FLOP_SHAPES.values()]
    out["refused"] = {label: _counted_or_raised(training_flops, shape)
                      for label, shape in REFUSED_FLOP_SHAPES.items()}
    return out


def _counted_or_raised(training_flops: Any, shape: tuple[int, ...]) -> Any:
    try:
        return plain(training_flops(*shape))
    except Exception as e:  # noqa: BLE001 - what it raised is judged by the edge cases
        return f"raised {type(e).__name__}: {str(e)[:160]}"


def _compare_refusals(got: Any, expected: Any = None) -> None:
    for label, did in (got.items() if isinstance(got, dict) else ()):
        if not str(did).startswith("raised ValueError"):
            raise CheckFailed(f"{label}: TinyTransformer refuses to build this model, and "
                              f"training_flops returned {describe(did, 80)}",
                              expected="a ValueError naming the constraint", got=did,
                              hint="A count of a model that cannot exist is a silent wrong "
                                   "answer. Heads split dim into equal parts: refuse a dim that "
                                   "heads do not divide, and sizes below 1, with a ValueError "
                                   "that names the numbers.")
    if not isinstance(got, dict) or set(got) != set(REFUSED_FLOP_SHAPES):
        raise CheckFailed("could not read the refused shapes", got=describe(got, 120))


def _compare_flops(got: Any, expected: Any, shapes: list[tuple[int, ...]]) -> None:
    got = got if isinstance(got, list) else [got]
    for shape, g, e in zip(shapes, got, expected["counts"]):
        v, d, n_layers, h, b, t = shape
        where = f"vocab={v}, dim={d}, layers={n_layers}, heads={h}, batch={b}, seq_len={t}"
        if not isinstance(g, int) or isinstance(g, bool):
            raise CheckFailed(f"{where}: training_flops returned {describe(g, 60)}, not an int",
                              expected=e, got=describe(g, 60), cause="not an int")
        if g != e:
            parts = expected["parts"][shapes.index(shape)]
            ratio = f"{g / e:.3f}x" if e else "none at all"
            raise CheckFailed(f"{where}: {g:,} FLOPs, FlopCounterMode counts {e:,} "
                              f"({ratio}); of the forward's {parts['forward']:,}, the "
                              f"projections are {parts['projections']:,}, attention's two "
                              f"products {parts['attention']:,}, the output layer "
                              f"{parts['head']:,}", expected=e, got=g, cause="FLOPs differ",
                              hint=FEWER_FLOPS if g < e else MORE_FLOPS)


# The direction of a count that differs: one shape's count names the mistake, and the other
# shapes, counted by the same formula, follow it.
FEWER_FLOPS = ("Too few FLOPs: some matrix multiplication is left out or undercounted. Compare "
               "your parts with the breakdown (the projections, attention's two products, the "
               "output layer), and remember that backward costs twice the forward.")
MORE_FLOPS = ("Too many FLOPs: something is counted that is not a matrix multiplication in the "
              "model (an embedding lookup is an index, not a product), or counted twice.")


for _name, _shape in FLOP_SHAPES.items():
    FLOPS.case(f"{_name}: {_shape}", uses=_flop_answers, pick=_name,
               compare=partial(_compare_flops, shapes=[_shape]),
               expect=partial(lambda seed, s: FLOPS.trusted("counted_flops")([s]), s=_shape))


def _compare_listed_flops(got: Any, expected: Any, seed: Any = None) -> None:
    """``_compare_flops`` over the shapes the expected answer lists."""
    _compare_flops(got, expected, expected["shapes"])


FLOPS.case("the edges: no blocks, an empty batch, one token per sequence with head dim 1",
           weight=0.5, uses=_flop_answers,
           pick="edges",
           compare=_compare_listed_flops,
           expect=lambda seed: FLOPS.trusted("counted_flops")(list(EDGE_FLOP_SHAPES.values())))
FLOPS.case("a shape the model refuses (dim not a multiple of heads, no heads): a ValueError "
           "naming the constraint", weight=0.5, uses=_flop_answers, pick="refused",
           compare=_compare_refusals)
FLOPS.case("three shapes drawn from the seed", uses=_flop_answers, pick="seeded",
           compare=_compare_listed_flops,
           expect=lambda seed: FLOPS.trusted("counted_flops")(seeded_flop_shapes(seed)))


# --------------------------------------------------------------------------- task 12.2


def traffic_sizes(seed: int) -> dict[str, int]:
    """The model and batch of 12.2's runs: vocabularies, widths and contexts no world size
    divides."""
    rng = random.Random(seed * 104729 + 122)
    dim = rng.choice([10, 14, 18])
    return {"vocab": rng.choice([37, 41, 43, 53]), "dim": dim, "layers": 2, "heads": 2,
            "seq_len": rng.choice([5, 6, 7]), "batch": 3}


def traffic_model(sizes: dict[str, int]) -> Any:
    from kit.lessons.models import TinyTransformer

    return TinyTransformer(sizes["vocab"], sizes["dim"], sizes["layers"], sizes["heads"],
                           context=sizes["seq_len"])


# What 12.2 must not do: run the layouts and read the bytes off the recorder. The answer is a
# formula of the parameters' shapes.
RUNNING_A_LAYOUT = ("kit.launcher", "kit.trace", "kit.recorder",
                    "torch.nn.parallel.DistributedDataParallel", "torch.distributed.fsdp",
                    "torch.distributed.optim.ZeroRedundancyOptimizer",
                    "torch.distributed.tensor.parallel", "torch.distributed.init_process_group")

TRAFFIC = task(
    "12.2", forbidden=RUNNING_A_LAYOUT,
    hint="Each layout moves a fixed set of tensors per step, and the recorder counts each "
         "collective's buffer: DDP all-reduces every gradient once (the tied weight is one "
         "parameter); ZeRO-1 adds one broadcast of every parameter from its owner after the "
         "step; FSDP all-gathers each unit's padded parameters in forward, again for every block "
         "in backward (the root unit stays gathered), and reduce-scatters each unit's padded "
         "gradients; tensor parallelism all-reduces one (batch, seq_len, dim) activation per "
         "block in forward and its gradient in backward.",
    recipe="Sum the bytes of model.parameters() (numel x element_size): that is DDP's all_reduce "
           "and ZeRO-1's broadcast. For FSDP pad every parameter's first dimension up to a "
           "multiple of world_size (ceil(rows / W) * W rows); all_gather_single is the root unit's "
           "padded bytes once plus every block's twice, reduce_scatter_single every unit's once. "
           "For TP, all_reduce is 2 x layers x batch x seq_len x dim x element_size. Use the "
           "recorder's op names as keys and leave out zeros. On one rank FSDP and TP move nothing.",
)


@TRAFFIC.shared
def _traffic_answers(step_traffic: Any, seed: int) -> dict[str, Any]:
    sizes = traffic_sizes(seed)
    out: dict[str, Any] = {}
    for layout in LAYOUTS:
        for world_size in (1, *WORLD_SIZES):
            got = step_traffic(layout, traffic_model(sizes), world_size, sizes["batch"],
                               sizes["seq_len"])
            if isinstance(got, dict):
                got = {str(k): plain(v) for k, v in got.items()}
            else:
                got = plain(got)
            out[f"{layout}@{world_size}"] = got
    return out


LAYOUT_HINTS = {
    "ddp": "DDP all-reduces each gradient once per step, in buckets: their sizes add up to the "
           "bytes of the parameters, each counted once (the embedding and the output layer share "
           "one).",
    "zero1": "ZeRO-1 keeps DDP's all-reduce and adds, after the optimizer step, one broadcast of "
             "each parameter from the rank that owns its optimizer state: every parameter once, "
             "and the recorder counts a broadcast's whole tensor on every rank.",
    "fsdp": "FSDP2 pads every parameter's first dimension to a multiple of the world size before "
            "sharding; each unit is all-gathered in forward, each block again in backward (it was "
            "resharded after forward; the root unit was not), and every unit's gradients are "
            "reduce-scattered. The recorder counts the whole gathered (or scattered) buffer.",
    "tp": "Column-wise then row-wise parallel MLPs need no communication inside the pair: the "
          "row-wise layer all-reduces its (batch, seq_len, dim) output in forward, and the "
          "column-wise layer all-reduces its input's gradient in backward: two per block. "
          "Nothing else is sharded, so nothing else moves.",
}


def _compare_traffic(got: Any, expected: dict[str, Any], layout: str,
                     world_sizes: tuple[int, ...] = WORLD_SIZES, hint: str | None = None) -> None:
    sizes = expected["sizes"]
    for world_size in world_sizes:
        key = f"{layout}@{world_size}"
        g, e = (got or {}).get(key) if isinstance(got, dict) else None, expected[key]
        if g != e:
            if isinstance(g, dict) and set(g) == set(e):
                diff = ", ".join(f"{op}: {g[op]:,} instead of {e[op]:,} ({g[op] / e[op]:.3f}x)"
                                 for op in e if g[op] != e[op])
            else:
                diff = f"ops {sorted(g) if isinstance(g, dict) else describe(g, 60)}, the " \
                       f"recorder saw {sorted(e)}"
            raise CheckFailed(f"{layout} on {world_size} ranks (vocab={sizes['vocab']}, "
                              f"dim={sizes['dim']}, layers={sizes['layers']}, "
                              f"seq_len={sizes['seq_len']}, batch={sizes['batch']}): {diff}",
                              expected=e, got=g, hint=hint or LAYOUT_HINTS[layout])


for _layout, _what in (("ddp", "torch DDP"), ("zero1", "ZeroRedundancyOptimizer under DDP"),
                       ("fsdp", "fully_shard per block, then the root (padded shards)"),
                       ("tp", "parallelize_module, column-wise then row-wise MLPs")):
    TRAFFIC.case(f"{_layout} ({_what}) on 2 and 4 ranks: the recorder's bytes of the third step",
                 uses=_traffic_answers, compare=partial(_compare_traffic, layout=_layout),
                 expect="measured_traffic", hint=LAYOUT_HINTS[_layout])

ONE_RANK_HINT = ("On one rank a shard is the whole tensor and a partial sum is already the sum: "
                 "FSDP2 gathers and reduce-scatters nothing and tensor parallelism all-reduces "
                 "nothing, so the recorder sees no collective (an empty dict). DDP and ZeRO-1 "
                 "still call all_reduce and broadcast on their whole buffers.")


def _compare_one_rank(got: Any, expected: dict[str, Any]) -> None:
    for layout in LAYOUTS:
        _compare_traffic(got, expected, layout, world_sizes=(1,), hint=ONE_RANK_HINT)


TRAFFIC.case("one rank (world size 1): FSDP and TP send nothing, DDP and ZeRO-1 still call "
             "their collectives", uses=_traffic_answers, compare=_compare_one_rank,
             expect="measured_traffic", hint=ONE_RANK_HINT)


# --------------------------------------------------------------------------- task 12.3

PHASES = ("data", "compute", "communication")
STRAGGLER_DELAY_S = 0.1  # 5-10x a profiled step of the model on a busy 2-core machine
STRAGGLER_JITTER_S = 0.02  # every rank's loader, every batch: noise a third of the delay
STRAGGLER_STEPS = 3
STRAGGLER_RANKS = 4
# The scenarios of one run, in order: the three phases, a slow link, and a compute straggler
# hidden by overlap (a late launch and a busy waiter beside it).
SCENARIOS = (*PHASES, "link", "overlap")


def straggler_plan(seed: int) -> dict[str, dict[str, Any]]:
    """Each scenario's ranks, drawn from the seed: the slow rank, the rank that hiccups instead in
    the step the slow one is on time (the off steps of the three phases are three different
    steps), and in "overlap" the rank that launches late and the one that computes while it
    waits."""
    rng = random.Random(seed * 31337 + 123)
    off = rng.sample(range(STRAGGLER_STEPS), len(PHASES))
    plan: dict[str, dict[str, Any]] = {}
    for phase, off_step in zip(PHASES, off):
        slow, hiccup = rng.sample(range(STRAGGLER_RANKS), 2)
        plan[phase] = {"slow_rank": slow, "phase": phase, "off_step": off_step,
                       "hiccup_rank": hiccup}
    plan["link"] = {"slow_rank": None, "phase": "link"}
    slow, late, busy, hiccup = rng.sample(range(STRAGGLER_RANKS), 4)
    # the hiccup as long as the delay: the busy waiter then computes a step's delay more than the
    # straggler (it hides every step's lateness, the straggler has it in all steps but one)
    plan["overlap"] = {"slow_rank": slow, "phase": "compute", "off_step": rng.randrange(
        STRAGGLER_STEPS), "hiccup_rank": hiccup, "hiccup": 1.0, "late_launch": late,
        "busy_wait": busy}
    return plan


def expected_straggler(seed: int, scenario: str) -> dict[str, Any]:
    """What find_straggler must say of a scenario: its slow rank and phase, or the link."""
    how = straggler_plan(seed)[scenario]
    return {"rank": how["slow_rank"], "phase": how["phase"]}


def _straggler_ranks(seed: int) -> list[dict[str, Any]]:
    """Runs on each rank: the scenarios in turn, one parsed trace each."""
    from kit.lessons.profiling import straggler_run

    return [straggler_run(how.pop("slow_rank"), how.pop("phase"), STRAGGLER_DELAY_S,
                          steps=STRAGGLER_STEPS, jitter=STRAGGLER_JITTER_S, seed=seed, **how)
            for how in straggler_plan(seed).values()]


STRAGGLER = task(
    "12.3", preload=("kit.lessons.profiling",),
    # forbids nothing: torch has no straggler finder; HTA's (GPU traces) is not installed
    hint="Everyone leaves a collective together, so in each collective the rank that waited "
         "least in its gloo: event entered last, and the others waited for it. Not every wait "
         "costs: a rank still loading or computing while its all-reduce is in flight loses "
         "nothing. Add up, collective by collective and step by step, how long each rank's late "
         "arrivals kept the others' main threads idle; if the collectives themselves idle "
         "everyone longer than any rank's lateness, the link is slow, not a rank. The phase is "
         "what the slow rank did before arriving late, against the others' median: the "
         "DataLoader's __next__ (data), aten and autograd ops (compute), or a gap on no event "
         "(communication).",
    recipe="Per rank: the main thread (most cpu_op events), its data and compute spans, and its "
           "gloo: spans in the order they end. For collective k, the last to enter has the "
           "shortest gloo: span. Each other rank idled from its entry until its exit minus that "
           "shortest wait: measure the part of that interval its main thread spent outside data "
           "and compute, take the median over the other ranks and add it to the late rank's "
           "total; the part of the last shortest-wait interval everyone spent idle adds to the "
           "link's total. The rank with the largest total is the straggler unless the link's "
           "total is larger. Its phase: over the collectives it entered last, from its entry "
           "into the previous collective (or the trace's start) to its late entry, compare its "
           "data, compute and gap (outside every event and collective) with the others' median, "
           "and name the largest excess.",
)


@STRAGGLER.shared
def _straggler_answers(find_straggler: Any, seed: int) -> dict[str, Any]:
    from kit.launcher import run_ranks
    from kit.lessons.profiling import warm_profiler

    warm_profiler()  # forked ranks then start their profilers in ms, not seconds each
    ranks = run_ranks(_straggler_ranks, (seed,), world_size=STRAGGLER_RANKS, timeout=60,
                      echo=False, preload=("kit.lessons.profiling",))
    out: dict[str, Any] = {}
    for i, scenario in enumerate(SCENARIOS):
        out[scenario] = _answer(find_straggler([r[i] for r in ranks]))
    # The edges, read off the same traces: two ranks (the slow one and the next; ranks 0 and 1
    # of the slow link), one rank, and a rank whose profiler recorded nothing.
    out["two ranks"] = {}
    for i, scenario in enumerate(TWO_RANK_SCENARIOS):
        pair = two_ranks(seed, scenario)
        out["two ranks"][scenario] = _answer_or_raised(find_straggler,
                                                       [ranks[r][i] for r in pair])
    out["refused"] = {
        "one rank's trace (world size 1)": _answer_or_raised(find_straggler, [ranks[0][0]]),
        "rank 2's trace holds no event": _answer_or_raised(
            find_straggler, [ranks[0][0], ranks[1][0], {"traceEvents": []}, ranks[3][0]]),
    }
    return out


# The overlap scenario has no two-rank edge: beside the busy waiter alone, the straggler keeps
# nobody idle.
TWO_RANK_SCENARIOS = (*PHASES, "link")


def two_ranks(seed: int, scenario: str) -> list[int]:
    """The two ranks of the two-rank edge: the slow one and the next, in rank order."""
    slow = straggler_plan(seed)[scenario]["slow_rank"]
    return [0, 1] if slow is None else sorted((slow, (slow + 1) % STRAGGLER_RANKS))


def _answer(answer: Any) -> Any:
    return ({str(k): plain(v) for k, v in answer.items()} if isinstance(answer, dict)
            else plain(answer))


def _answer_or_raised(find_straggler: Any, traces: list[Any]) -> Any:
    try:
        return _answer(find_straggler(traces))
    except Exception as e:  # noqa: BLE001 - what it raised is judged by the edge cases
        return f"raised {type(e).__name__}: {str(e)[:160]}"


def _compare_two_ranks(got: Any, expected: dict[str, Any]) -> None:
    for scenario in TWO_RANK_SCENARIOS:
        g = (got or {}).get(scenario) if isinstance(got, dict) else got
        e = expected[scenario]
        if g != e:
            slow = ("no rank is late" if e["rank"] is None
                    else f"the slow one is traces[{e['rank']}]")
            raise CheckFailed(
                f"two ranks (ranks {expected['pairs'][scenario]} of the {scenario!r} scenario, "
                f"{slow}): find_straggler returned {describe(g, 120)}",
                expected=e, got=g,
                hint="With two ranks the others are one rank: compare with its time itself "
                     "(the median of one value is that value; a standard deviation of one value "
                     "does not exist).")


def _compare_refused(got: Any, expected: Any = None) -> None:
    if not isinstance(got, dict) or len(got) != 2:
        raise CheckFailed("could not read the refused traces", got=describe(got, 120))
    for label, did in got.items():
        named = "rank" in str(did).lower()
        if not str(did).startswith("raised ValueError") or not named:
            raise CheckFailed(
                f"{label}: find_straggler returned {describe(did, 120)}",
                expected="a ValueError that names the ranks (fewer than 2 traces, or the rank "
                         "whose trace is empty)", got=did,
                hint="A straggler is slow against the others: one trace has no others, and a "
                     "trace without events (a profiler that never ran) is no evidence. Refuse "
                     "both with a ValueError that says which rank, or how many, instead of "
                     "naming a straggler or failing inside max() or statistics.")


SCENARIO_HINTS = {
    "link": "No rank is late here: every rank's all-reduce is long because the transfer itself "
            "is, so even the last rank to enter waits long. Time every rank spends idle after "
            "the last one entered belongs to the link: when it outweighs any rank's lateness, "
            "say {'rank': None, 'phase': 'link'}.",
    "overlap": "Two decoys: one rank launches its first all-reduce late, but the others are "
               "still loading and computing, so nobody idles for it (yet it waits least in "
               "total); another computes while its all-reduce is in flight (the most compute, "
               "none of it late). Count a late arrival by the time it keeps the others' main "
               "threads idle, not by the length of the waits or of the compute.",
}
NOISY_HINT = ("The steps are noisy: every rank's loader jitters, and in one step the slow rank is "
              "on time while another rank hiccups. Sum the lateness over every collective of "
              "every step; one step, or one rank's totals, is not enough.")


def _compare_straggler(got: Any, expected: dict[str, Any], scenario: str) -> None:
    want, how = expected["answer"], expected["plan"]
    if got == want:
        return
    if scenario == "link":
        where = f"4 ranks, {STRAGGLER_STEPS} steps, every all-reduce carrying 16 MiB more"
    else:
        slower = {"data": "data loader", "compute": "forward", "communication": "send"}
        where = (f"4 ranks, {STRAGGLER_STEPS} noisy steps, rank {how['slow_rank']} made "
                 f"{STRAGGLER_DELAY_S} s slower in its {slower[how['phase']]} except in step "
                 f"{how['off_step']} (rank {how['hiccup_rank']} hiccups there)")
        if scenario == "overlap":
            where += (f"; rank {how['late_launch']} launches late and rank {how['busy_wait']} "
                      f"computes while it waits")
    g = got if isinstance(got, dict) else describe(got, 80)
    raise CheckFailed(f"{where}: find_straggler returned {g}", expected=want, got=g,
                      hint=SCENARIO_HINTS.get(scenario, NOISY_HINT))


for _scenario, _how in (
        ("data", "a slow data loader (the dataset sleeps), noisy steps"),
        ("compute", "extra matrix products in forward, noisy steps"),
        ("communication", "a late send (a host-side sleep before the all-reduce), noisy steps"),
        ("link", "a slow link (every all-reduce long, no rank late): {'rank': None, 'phase': "
                 "'link'}"),
        ("overlap", "a compute straggler among overlapped all-reduces, a late launch and a busy "
                    "waiter beside it")):
    STRAGGLER.case(f"{_how}: the slow rank and phase", uses=_straggler_answers, pick=_scenario,
                   compare=partial(_compare_straggler, scenario=_scenario),
                   expect=partial(lambda seed, s: {"answer": expected_straggler(seed, s),
                                                   "plan": straggler_plan(seed)[s]}, s=_scenario))


def _two_rank_answers(seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario in TWO_RANK_SCENARIOS:
        want, pair = expected_straggler(seed, scenario), two_ranks(seed, scenario)
        out[scenario] = {**want, "rank": None if want["rank"] is None else pair.index(
            want["rank"])}
    out["pairs"] = {s: two_ranks(seed, s) for s in TWO_RANK_SCENARIOS}
    return out


STRAGGLER.case("two ranks (the slow one and the next): each scenario's rank and phase",
               weight=0.5, uses=_straggler_answers, pick="two ranks", compare=_compare_two_ranks,
               expect=_two_rank_answers)
STRAGGLER.case("no straggler to find (one rank's trace, a trace with no events): a ValueError "
               "naming the ranks", weight=0.5, uses=_straggler_answers, pick="refused",
               compare=_compare_refused)

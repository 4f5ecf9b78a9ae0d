"""Seeded bugs for Lesson 12: the typical mistakes each check of tasks 12.1-12.3 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every one
fails its task's checks. Each bug is a correct implementation with one step replaced, written as
a student would write it, plus the cheats the checks must stop: FlopCounterMode on the real
model, the recorder's bytes read off a real run, and blaming the rank that waits longest.
"""

from __future__ import annotations

import statistics

import torch
from torch.nn import functional as F

from bugs import edited_solution

# --------------------------------------------------------------------------- task 12.1


def _flops(vocab, dim, layers, heads, batch, seq_len, *, backward=2, attention=True, head=True,
           causal_half=False, mlp=4):
    tokens = batch * seq_len
    projections = 2 * tokens * dim * (3 * dim + dim + mlp * dim * 2)
    scores = 2 * 2 * batch * seq_len * seq_len * dim
    if causal_half:
        scores //= 2
    forward = layers * (projections + (scores if attention else 0))
    forward += 2 * tokens * dim * vocab if head else 0
    return (1 + backward) * forward


def flops_backward_equals_forward(vocab, dim, layers, heads, batch, seq_len):
    return _flops(vocab, dim, layers, heads, batch, seq_len, backward=1)


def flops_without_attention_scores(vocab, dim, layers, heads, batch, seq_len):
    return _flops(vocab, dim, layers, heads, batch, seq_len, attention=False)


def flops_without_lm_head(vocab, dim, layers, heads, batch, seq_len):
    return _flops(vocab, dim, layers, heads, batch, seq_len, head=False)


def flops_causal_half(vocab, dim, layers, heads, batch, seq_len):
    return _flops(vocab, dim, layers, heads, batch, seq_len, causal_half=True)


def flops_six_n_tokens(vocab, dim, layers, heads, batch, seq_len):
    params = vocab * dim + seq_len * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim
    return 6 * params * batch * seq_len


def flops_as_float(vocab, dim, layers, heads, batch, seq_len):
    return float(_flops(vocab, dim, layers, heads, batch, seq_len))


def flops_counted_on_the_model(vocab, dim, layers, heads, batch, seq_len):
    """The cheat: build the model and let FlopCounterMode count it (forbidden)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from kit.lessons.models import TinyTransformer

    model = TinyTransformer(vocab, dim, layers, heads, context=seq_len)
    x = torch.zeros(batch, seq_len, dtype=torch.long)
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        F.cross_entropy(model(x).reshape(-1, vocab), x.reshape(-1)).backward()
    return counter.get_total_flops()


_MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def flops_from_the_profiler_on_its_own_model(vocab, dim, layers, heads, batch, seq_len):
    """The cheat that passed every value case: a transformer of its own (nn.Linear blocks laid out
    as the lesson's), run under torch.profiler with with_flops=True, its matmuls' FLOPs summed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    tok, ln = torch.nn.Embedding(vocab, dim), torch.nn.LayerNorm(dim)
    blocks = [(torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim),
               torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)) for _ in range(layers)]
    x = torch.randint(0, vocab, (batch, seq_len))
    with torch.profiler.profile(with_flops=True) as prof, sdpa_kernel(SDPBackend.MATH):
        h = tok(x)
        for qkv, proj, up, down in blocks:
            q, k, v = (z.view(batch, seq_len, heads, dim // heads).transpose(1, 2)
                       for z in qkv(h).split(dim, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + proj(y.transpose(1, 2).reshape(batch, seq_len, dim))
            h = h + down(F.gelu(up(h)))
        F.cross_entropy(F.linear(ln(h), tok.weight).reshape(-1, vocab), x.reshape(-1)).backward()
    return int(sum(e.flops for e in prof.key_averages() if e.flops and e.key in _MATMULS))


def flops_from_the_lessons_blocks(vocab, dim, layers, heads, batch, seq_len):
    """The same cheat on kit.lessons.models' own block, counted by a dispatch mode of its own."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import TorchDispatchMode

    from kit.lessons.models import _Block

    class Count(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.startswith(("mm", "addmm", "bmm")):
                a, b = args[-2], args[-1]
                Count.total += 2 * a.numel() * b.shape[-1]
            return out

    tok, ln = torch.nn.Embedding(vocab, dim), torch.nn.LayerNorm(dim)
    blocks = [_Block(dim, heads) for _ in range(layers)]
    x = torch.randint(0, vocab, (batch, seq_len))
    with Count(), sdpa_kernel(SDPBackend.MATH):
        h = tok(x)
        for block in blocks:
            h = block(h)
        F.cross_entropy(F.linear(ln(h), tok.weight).reshape(-1, vocab), x.reshape(-1)).backward()
    return Count.total


# --------------------------------------------------------------------------- task 12.2


def _traffic(layout, model, world_size, batch, seq_len, *, tied_twice=False, fsdp_backward=True,
             pad=True, ring=False, tp_backward=True, zero_shard=False, zeros=False):
    def nbytes(p, padded=False):
        rows = p.shape[0]
        if padded and pad:
            rows = -(-rows // world_size) * world_size
        return rows * p[0].numel() * p.element_size()

    if layout in ("fsdp", "tp") and world_size == 1:  # as the solution: one rank sends nothing
        return {}
    params = ([p for _, p in model.named_parameters(remove_duplicate=False)] if tied_twice
              else list(model.parameters()))
    total = sum(nbytes(p) for p in params)
    if ring:  # the wire bytes of a ring, not the recorder's buffer size
        total = total * 2 * (world_size - 1) // world_size
    extra = {"broadcast": 0, "all_gather_single": 0} if zeros else {}
    if layout == "ddp":
        return {"all_reduce": total, **extra}
    if layout == "zero1":
        return {"all_reduce": total, "broadcast": total // world_size if zero_shard else total}
    if layout == "fsdp":
        in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
        root = sum(nbytes(p, True) for p in params if id(p) not in in_blocks)
        blocks = sum(nbytes(p, True) for b in model.blocks for p in b.parameters())
        return {"all_gather_single": root + (2 if fsdp_backward else 1) * blocks,
                "reduce_scatter_single": root + blocks}
    activation = batch * seq_len * model.tok.weight.shape[1] * model.tok.weight.element_size()
    return {"all_reduce": (2 if tp_backward else 1) * len(model.blocks) * activation}


def traffic_tied_weight_twice(layout, model, world_size, batch, seq_len):
    return _traffic(layout, model, world_size, batch, seq_len, tied_twice=True)


def traffic_fsdp_no_backward_all_gather(layout, model, world_size, batch, seq_len):
    return _traffic(layout, model, world_size, batch, seq_len, fsdp_backward=False)


def traffic_no_padding(layout, model, world_size, batch, seq_len):
    return _traffic(layout, model, world_size, batch, seq_len, pad=False)


def traffic_ring_wire_bytes(layout, model, world_size, batch, seq_len):
    return _traffic(layout, model, world_size, batch, seq_len, ring=True)


def traffic_tp_forward_only(layout, model, world_size, batch, seq_len):
    return _traffic(layout, model, world_size, batch, seq_len, tp_backward=False)


def traffic_zero1_broadcasts_a_shard(layout, model, world_size, batch, seq_len):
    return _traffic(layout, model, world_size, batch, seq_len, zero_shard=True)


def traffic_keeps_zero_entries(layout, model, world_size, batch, seq_len):
    return _traffic(layout, model, world_size, batch, seq_len, zeros=True)


def traffic_measured_on_real_ranks(layout, model, world_size, batch, seq_len):
    """The cheat: run the layout on real ranks and read the recorder (forbidden)."""
    from kit import launch
    from kit.trace import trace

    def on_rank():
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        m = DistributedDataParallel(model)
        x = torch.zeros(batch, seq_len, dtype=torch.long) + dist.get_rank()
        for _ in range(3):
            with trace() as t:
                m(x).sum().backward()
        totals = {}
        for e in t.events:
            totals[e.op] = totals.get(e.op, 0) + e.nbytes
        return totals

    return launch(on_rank, world_size=world_size, echo=False)[0]


# --------------------------------------------------------------------------- task 12.3


def _union(spans):
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _span(e):
    return e["ts"], e["ts"] + e["dur"]


def _inside(s, spans):
    return any(a <= s[0] and s[1] <= b for a, b in spans)


def _rows(traces, *, main_only=False):
    rows = []
    for trace in traces:
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
        counts = {}
        for e in events:
            if e.get("cat") == "cpu_op":
                counts[e["tid"]] = counts.get(e["tid"], 0) + 1
        main = max(counts, key=counts.get)
        mine = [e for e in events if e["tid"] == main]
        data = [_span(e) for e in mine if "DataLoader" in e["name"]]
        compute = [_span(e) for e in mine if e["name"].startswith(("aten::", "autograd::"))
                   and not _inside(_span(e), data)]
        comm = [_span(e) for e in (mine if main_only else events) if e["name"].startswith("gloo:")]
        start = min(e["ts"] for e in mine)
        end = max(e["ts"] + e["dur"] for e in mine)
        covered = _union(data + compute + [s for s in comm if start <= s[0] <= end])
        rows.append({"data": _union(data), "compute": _union(compute),
                     "communication": (end - start) - covered, "wait": _union(comm)})
    return rows


def _verdict(rows, slow):
    others = [row for r, row in enumerate(rows) if r != slow]
    excess = {p: rows[slow][p] - statistics.median(o[p] for o in others)
              for p in ("data", "compute", "communication")}
    return {"rank": slow, "phase": max(excess, key=excess.get)}


def straggler_longest_waiter(traces):
    """Blames the rank that waits longest in all_reduce: a victim, never the slow one."""
    rows = _rows(traces)
    return _verdict(rows, max(range(len(rows)), key=lambda r: rows[r]["wait"]))


def straggler_main_thread_only(traces):
    """Reads gloo: waits from the main thread only: they live on gloo's threads, so every rank
    seems to wait 0 and rank 0 is blamed (at most one scenario slows rank 0)."""
    rows = _rows(traces, main_only=True)
    return _verdict(rows, min(range(len(rows)), key=lambda r: rows[r]["wait"]))


def straggler_most_total_time(traces):
    """Blames the rank whose events last longest in all: waiting counts as busy."""
    totals = [sum(e.get("dur", 0) for e in t["traceEvents"] if e.get("ph") == "X")
              for t in traces]
    rows = _rows(traces)
    return _verdict(rows, max(range(len(totals)), key=totals.__getitem__))


def straggler_phase_by_largest_share(traces):
    """Finds the rank, then names its largest phase outright (compute, always), not its excess."""
    rows = _rows(traces)
    slow = min(range(len(rows)), key=lambda r: rows[r]["wait"])
    phases = {p: rows[slow][p] for p in ("data", "compute")}
    return {"rank": slow, "phase": max(phases, key=phases.get)}


BUGS = {
    "12.1": [
        ("backward counted as equal to the forward", flops_backward_equals_forward),
        ("attention's score matmuls forgotten", flops_without_attention_scores),
        ("the LM head (tied output layer) forgotten", flops_without_lm_head),
        ("causal attention counted as half the scores", flops_causal_half),
        ("6 N tokens with the embeddings in N", flops_six_n_tokens),
        ("returns a float", flops_as_float),
        ("FlopCounterMode on the real model", flops_counted_on_the_model),
        ("the profiler's with_flops on a transformer of its own", flops_from_the_profiler_on_its_own_model),
        ("a dispatch mode of its own on the lesson's blocks", flops_from_the_lessons_blocks),
        ("counts a model that cannot exist (dim not a multiple of heads, no heads)",
         edited_solution("12_profiling.py", (
             "    if dim % heads:\n"
             "        raise ValueError(f\"dim must be a multiple of heads ({dim} % {heads} != 0)\")\n",
             "",
         ), (
             "    if min(vocab, dim, heads, seq_len) < 1 or min(layers, batch) < 0:\n",
             "    if min(vocab, dim, seq_len) < 1 or min(layers, batch) < 0:\n",
         )).training_flops),
        ("the output layer counted in every block (none without blocks)",
         edited_solution("12_profiling.py", (
             "    forward = layers * (projections + attention) + head\n",
             "    forward = layers * (projections + attention + head // max(layers, 1))\n",
         )).training_flops),
    ],
    "12.2": [
        ("the tied output weight counted twice", traffic_tied_weight_twice),
        ("FSDP's second all-gather in backward forgotten", traffic_fsdp_no_backward_all_gather),
        ("no padding counted", traffic_no_padding),
        ("ring wire bytes instead of the recorder's buffer size", traffic_ring_wire_bytes),
        ("TP's backward all-reduce forgotten", traffic_tp_forward_only),
        ("ZeRO-1 broadcasts only a 1/W shard", traffic_zero1_broadcasts_a_shard),
        ("entries of zero kept", traffic_keeps_zero_entries),
        ("measured on real ranks with the recorder", traffic_measured_on_real_ranks),
        ("FSDP and TP traffic predicted on one rank, where nothing is sent",
         edited_solution("12_profiling.py", (
             "    if layout in (\"fsdp\", \"tp\") and world_size == 1:\n"
             "        return {}  # one rank: FSDP gathers and scatters nothing, TP's partial sums are whole\n",
             "",
         )).step_traffic),
    ],
    "12.3": [
        ("the longest waiter blamed", straggler_longest_waiter),
        ("phases read from the wrong thread (gloo waits looked for on the main thread)",
         straggler_main_thread_only),
        ("the rank with the most event time blamed", straggler_most_total_time),
        ("the phase named by its largest share, not its excess", straggler_phase_by_largest_share),
        ("the excess in standard deviations of the others (none with one other rank)",
         edited_solution("12_profiling.py", (
             "    excess = {phase: rows[slow][phase] - statistics.median(o[phase] for o in others)\n",
             "    excess = {phase: (rows[slow][phase] - statistics.mean(o[phase] for o in others))\n"
             "             / (statistics.stdev([o[phase] for o in others]) or 1.0)\n",
         )).find_straggler),
        ("names a straggler where there is none (one trace; an empty trace waited least)",
         edited_solution("12_profiling.py", (
             "    if len(traces) < 2:\n"
             "        raise ValueError(f\"find_straggler needs the traces of at least 2 ranks, got \"\n"
             "                         f\"{len(traces)}: a straggler is slow against the others\")\n",
             "    if len(traces) < 2:\n"
             "        return {\"rank\": 0, \"phase\": \"compute\"}\n",
         ), (
             "            raise ValueError(f\"rank {rank}'s trace has no operator events: was its profiler \"\n"
             "                             f\"started around the step (activities=[ProfilerActivity.CPU])?\")\n",
             "            rows.append(dict.fromkeys((\"data\", \"compute\", \"communication\", \"wait\"), 0.0))\n"
             "            continue\n",
         )).find_straggler),
    ],
}

"""Seeded bugs for Lesson 12: the typical mistakes each check of tasks 12.1-12.3 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every one
fails its task's checks. Each bug is a correct implementation with one step replaced, written as
a student would write it, plus the cheats the checks must stop: FlopCounterMode on the real
model, the recorder's bytes read off a real run, blaming the rank that waits longest, and the
rule that found three clean injections (least total wait, excess over the whole trace).
"""

from __future__ import annotations

from functools import partial

import torch
from torch.nn import functional as F

from bugs import edited_entry

_flops = partial(edited_entry, 12, "training_flops")
_traffic = partial(edited_entry, 12, "step_traffic")
_straggler = partial(edited_entry, 12, "find_straggler")

_RETURN = "    return 3 * forward  #"
_FORWARD = "forward = layers * (projections + attention) + head"
_SLOW = "slow = max(range(len(ranks)), key=held.__getitem__)"
_LAST = "last = min(range(len(ranks)), key=waits.__getitem__)"
_LINK = ("    if link > held[slow]:\n"
         "        return {\"rank\": None, \"phase\": \"link\"}\n")
_EXCESS = "excess[phase] += mine[phase] - statistics.median(o[phase] for o in others)"

# --------------------------------------------------------------------------- task 12.1


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


BUGS = {
    "12.1": [
        ("backward counted as equal to the forward",
         _flops((_RETURN, "    return 2 * forward  #"))),
        ("attention's score matmuls forgotten",
         _flops((_FORWARD, "forward = layers * projections + head"))),
        ("the LM head (tied output layer) forgotten",
         _flops((_FORWARD, "forward = layers * (projections + attention)"))),
        ("causal attention counted as half the scores", _flops((
            "attention = 2 * 2 * batch * seq_len * seq_len * dim",
            "attention = 2 * batch * seq_len * seq_len * dim"))),
        ("6 N tokens with the embeddings in N", _flops((_RETURN, (
            "    params = vocab * dim + seq_len * dim + layers * (12 * dim * dim + 13 * dim)"
            " + 2 * dim\n"
            "    return 6 * params * batch * seq_len  #")))),
        ("returns a float", _flops((_RETURN, "    return float(3 * forward)  #"))),
        ("FlopCounterMode on the real model", flops_counted_on_the_model),
        ("the profiler's with_flops on a transformer of its own",
         flops_from_the_profiler_on_its_own_model),
        ("a dispatch mode of its own on the lesson's blocks", flops_from_the_lessons_blocks),
        ("counts a model that cannot exist (dim not a multiple of heads, no heads)", _flops((
            "    if dim % heads:\n"
            "        raise ValueError(f\"dim must be a multiple of heads ({dim} % {heads} != "
            "0)\")\n",
            "",
        ), (
            "    if min(vocab, dim, heads, seq_len) < 1 or min(layers, batch) < 0:\n",
            "    if min(vocab, dim, seq_len) < 1 or min(layers, batch) < 0:\n",
        ))),
        ("the output layer counted in every block (none without blocks)", _flops((
            "    forward = layers * (projections + attention) + head\n",
            "    forward = layers * (projections + attention + head // max(layers, 1))\n",
        ))),
    ],
    "12.2": [
        ("the tied output weight counted twice", _traffic((
            "params = list(model.parameters())  # the tied weight once",
            "params = [p for _, p in model.named_parameters(remove_duplicate=False)]"))),
        ("FSDP's second all-gather in backward forgotten", _traffic((
            "\"all_gather_single\": root + 2 * blocks", "\"all_gather_single\": root + blocks"))),
        ("no padding counted", _traffic((
            "            rows = -(-rows // world_size) * world_size  # ceil to a multiple of W",
            "            pass"))),
        ("ring wire bytes instead of the recorder's buffer size", _traffic((
            "    total = sum(nbytes(p) for p in params)\n",
            "    total = sum(nbytes(p) for p in params) * 2 * (world_size - 1) // world_size\n"))),
        ("TP's backward all-reduce forgotten", _traffic((
            "return {\"all_reduce\": 2 * len(model.blocks) * activation}",
            "return {\"all_reduce\": len(model.blocks) * activation}"))),
        ("ZeRO-1 broadcasts only a 1/W shard", _traffic((
            "\"broadcast\": total}", "\"broadcast\": total // world_size}"))),
        ("entries of zero kept", _traffic((
            "        return {\"all_reduce\": total}\n",
            "        return {\"all_reduce\": total, \"broadcast\": 0, \"all_gather_single\": "
            "0}\n"))),
        ("measured on real ranks with the recorder", traffic_measured_on_real_ranks),
        ("FSDP and TP traffic predicted on one rank, where nothing is sent", _traffic((
            "    if layout in (\"fsdp\", \"tp\") and world_size == 1:\n"
            "        return {}  # one rank: FSDP gathers and scatters nothing, TP's partial sums "
            "are "
            "whole\n",
            "",
        ))),
    ],
    "12.3": [
        ("the longest waiter blamed", _straggler((_LAST, _LAST.replace("min(", "max(")))),
        ("phases read from the wrong thread (gloo waits looked for on the main thread)",
         _straggler(('comm = sorted((_span(e) for e in events if',
                     'comm = sorted((_span(e) for e in mine if'))),
        ("the rank with the most event time blamed", _straggler((_SLOW, (
            "slow = max(range(len(ranks)), key=lambda r: sum(\n"
            "        e.get(\"dur\", 0) for e in traces[r][\"traceEvents\"] if e.get(\"ph\") == "
            "\"X\"))")))),
        ("the phase named by its largest share, not its excess", _straggler(
            ("excess = dict.fromkeys((\"data\", \"compute\", \"communication\"), 0.0)",
             "excess = dict.fromkeys((\"data\", \"compute\"), 0.0)"),
            (_EXCESS, "excess[phase] += mine[phase]"))),
        ("the excess in standard deviations of the others (none with one other rank)",
         _straggler((_EXCESS, (
             "excess[phase] += ((mine[phase] - statistics.mean(o[phase] for o in others))\n"
             "                               / (statistics.stdev([o[phase] for o in others]) "
             "or 1.0))")))),
        ("names a straggler where there is none (one trace; an empty trace waited least)",
         _straggler((
             "    if len(traces) < 2:\n"
             "        raise ValueError(f\"find_straggler needs the traces of at least 2 ranks, "
             "got \"\n"
             "                         f\"{len(traces)}: a straggler is slow against the "
             "others\")\n",
             "    if len(traces) < 2:\n"
             "        return {\"rank\": 0, \"phase\": \"compute\"}\n",
         ))),
        ("the least total wait blamed and its phase read over the whole trace (the rule that "
         "found three clean injections)", _straggler(
             (_SLOW + "\n" + _LINK,
              "slow = min(range(len(ranks)), key=lambda r: union(ranks[r][\"comm\"]))\n"),
             ("for k in (k for k in range(collectives) if late[k] == slow):",
              "for k in range(collectives):"))),
        ("reads the first collective only (one step)", _straggler((
            "collectives = min(len(r[\"comm\"]) for r in ranks)",
            "collectives = min(1, *(len(r[\"comm\"]) for r in ranks))"))),
        ("the rank with the longest compute blamed", _straggler((_SLOW, (
            "slow = max(range(len(ranks)), key=lambda r: union(ranks[r][\"compute\"]))")))),
        ("late arrivals counted by the others' waits, busy or not (the late launch blamed)",
         _straggler(("idle(r, r[\"comm\"][k][0], r[\"comm\"][k][1] - waits[last])",
                     "r[\"comm\"][k][1] - waits[last] - r[\"comm\"][k][0]"))),
        ("never blames the link", _straggler((_LINK, ""))),
    ],
}

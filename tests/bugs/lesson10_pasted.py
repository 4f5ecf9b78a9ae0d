"""A seeded bug of 10.4, in a module of its own (a notebook of its own): RDKit's
CalcEnrichment and CalcBEDROC pasted with every name changed, called by the solution's
screen_metrics. The gate reads every function of a student's module, so this paste must not
sit beside the other seeded bugs."""

from __future__ import annotations

import inspect
import math
import textwrap

import torch
import torch.distributed as dist  # noqa: F401 - screen_metrics, defined below, uses it

from bugs import edited_solution


# RDKit's CalcEnrichment and CalcBEDROC (with its _RIEHelper) pasted, every name changed, the
# constants' spelling changed and independent lines swapped: other bytecode, the same statements.
def _hits_ratio(ranked, where, cuts):
    total = len(ranked)
    if not cuts:
        raise ValueError("no cut given")
    if total == 0:
        raise ValueError("nothing ranked")
    for c in cuts:
        if c > 1 or c < 0:
            raise ValueError("cut outside [0, 1]")
    found = 0
    sizes = [math.ceil(total * c) for c in cuts]
    sizes.append(total)
    out = []
    for k in range(total):
        if k > (sizes[0] - 1) and k > 0:
            out.append(1. * found * total / k)
            sizes.pop(0)
        hit = ranked[k][where]
        if hit:
            found += 1
    if found > 0:
        out = [x / found for x in out]
    else:
        out = [0.] * len(cuts)
    return out


def _early_sum(ranked, where, a):
    total = len(ranked)
    a = float(a)
    if total == 0:
        raise ValueError("nothing ranked")
    if a <= 0.:
        raise ValueError("a must be positive")
    found = 0
    norm = 1. / total * ((1 - math.exp(-a)) / (math.exp(a / total) - 1))
    acc = 0
    for k in range(total):
        hit = ranked[k][where]
        if hit:
            found += 1
            acc += math.exp(-(a * (k + 1)) / total)
    if found > 0:
        value = acc / (found * norm)
    else:
        value = 0.
    return value, found


def _early_score(ranked, where, a):
    value, found = _early_sum(ranked, where, a)
    if found > 0:
        total = len(ranked)
        share = 1. * found / total
        top = (1 - math.exp(-a * share)) / (share * (1 - math.exp(-a)))
        low = (1 - math.exp(a * share)) / (share * (1 - math.exp(a)))
        if top != low:
            result = (value - low) / (top - low)
        else:
            result = 1.
    else:
        result = 0.
    return result


def _pasted_ef(scores, labels, fraction=0.01):
    order = torch.sort(scores, descending=True, stable=True).indices
    return _hits_ratio([[0, int(labels[i])] for i in order], 1, [fraction])[0]


def _pasted_bedroc(scores, labels, alpha=20.0):
    order = torch.sort(scores, descending=True, stable=True).indices
    return _early_score([[0, int(labels[i])] for i in order], 1, alpha)


# The solution's screen_metrics, defined here, beside the paste: as a notebook holds both.
exec(compile(textwrap.dedent(inspect.getsource(edited_solution(10).screen_metrics)),
             __file__, "exec"))
enrichment_factor, bedroc = _pasted_ef, _pasted_bedroc

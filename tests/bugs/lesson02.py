"""Seeded bugs of Lesson 02: dist_info_from_env (2.1), resumable_train (2.2), first_mismatch (2.3).

Each bug is the solution with one step changed (edited_solution): the lesson's helpers
(``DistInfo``, ``Mismatch``, ``make_model``, ``train_step``...) come with it from its source,
exactly as a student's notebook provides them.
"""

from __future__ import annotations

from bugs import edited_solution


def _bug(name: str, *edits: tuple[str, str]):
    return getattr(edited_solution(2, *edits), name)


# --------------------------------------------------------------------------- 2.1 dist_info_from_env

_LOW = ("        if value < low:\n"
        '            raise ValueError(f"{name}={value} must be >= {low}")\n')

dist_info_local_rank_is_rank = _bug(
    "dist_info_from_env",
    ('    local_rank = number("LOCAL_RANK", rank % local_world_size)',
     "    local_rank = rank % local_world_size"),
    ("    return DistInfo(rank, local_rank, world_size",
     "    return DistInfo(rank, rank, world_size"))
dist_info_bare_int_errors = _bug("dist_info_from_env", (
    "        try:\n"
    "            value = int(env[name])\n"
    "        except ValueError:\n"
    '            raise ValueError(f"{name}={env[name]!r} is not an integer") from None\n',
    "        value = int(env[name])  # int()'s own message never names the variable\n"))
dist_info_distributed_only_above_one = _bug(
    "dist_info_from_env", ('master_port, "WORLD_SIZE" in env)', "master_port, world_size > 1)"))


_RETURN = ("    return DistInfo(rank, local_rank, world_size, local_world_size, node_rank,\n"
           '                    env.get("MASTER_ADDR", "127.0.0.1"), master_port, '
           '"WORLD_SIZE" in env)\n')
_CHECKS = "    if master_port > 65535:\n"  # the first of the range and consistency checks
dist_info_without_checks = _bug(  # returns before the checks
    "dist_info_from_env", (_LOW, ""), (_CHECKS, _RETURN + _CHECKS))

# --------------------------------------------------------------------------- 2.2 resumable_train

resumable_train_restarts_data = _bug("resumable_train", (
    "    for step in range(start, total_steps):\n        train_step(model, optimizer, step)\n",
    "    for i in range(total_steps - start):\n"
    "        step = start + i\n"
    "        train_step(model, optimizer, i)  # the step count restarts at 0: batches replayed\n"))
resumable_train_forgets_optimizer = _bug(  # momentum starts from zero
    "resumable_train", ('        optimizer.load_state_dict(state["optimizer"])\n', ""))
resumable_train_never_resumes = _bug(  # saves, but always starts over
    "resumable_train", ("    if os.path.exists(path):\n        # map_location",
                        "    if False:\n        # map_location"))

# --------------------------------------------------------------------------- 2.3 first_mismatch

first_mismatch_ignores_shapes = _bug("first_mismatch", (
    "        if len(set(at.values())) == 1:\n",
    "        if len({c if c is None else c[0] for c in at.values()}) == 1:\n"))
first_mismatch_zips = _bug("first_mismatch", (  # like zip()
    "    longest = max((len(seq) for seq in calls.values()), default=0)",
    "    longest = min((len(seq) for seq in calls.values()), default=0)"))
first_mismatch_all_ranks = _bug("first_mismatch", (  # blames everybody
    "return Mismatch(index, [r for r in ranks if at[r] != common], at)",
    "return Mismatch(index, ranks, at)"))


BUGS = {
    "2.1": [
        ("accepts inconsistent values (no range checks)", dist_info_without_checks),
        ("uses RANK as the local rank", dist_info_local_rank_is_rank),
        ("lets int() raise without naming the variable", dist_info_bare_int_errors),
        ("calls a one-worker torchrun not distributed", dist_info_distributed_only_above_one),
    ],
    "2.2": [
        ("restarts the data order after resuming", resumable_train_restarts_data),
        ("does not restore the optimizer state", resumable_train_forgets_optimizer),
        ("never loads the checkpoint", resumable_train_never_resumes),
    ],
    "2.3": [
        ("ignores shapes", first_mismatch_ignores_shapes),
        ("stops at the shortest sequence (zip)", first_mismatch_zips),
        ("blames every rank", first_mismatch_all_ranks),
    ],
}

"""Seeded bugs for Lesson 14: the typical mistakes each check of tasks 14.1-14.4 must catch.

``BUGS[task_id]`` lists ``(what is wrong, implementation)``; tests/test_checks.py proves every one
fails its task's checks. Each bug is the loaded solution with one step changed, as a student
would write it: the mesh's axes in the wrong order, tensor parallel without sequence parallel,
FSDP2 on the root alone, blocks kept gathered after forward, a traffic formula that forgets the
backward re-gather or the padding, GPipe for 1F1B, a stage that keeps every block, a checkpoint
without the optimizer or the step, and a save that gathers full tensors.
"""

from __future__ import annotations

from functools import partial

from bugs import edited_entry

_mesh = partial(edited_entry, 14, "build_mesh")
_parallel = partial(edited_entry, 14, "parallelize")
_pipe = partial(edited_entry, 14, "build_pipeline")
_save = partial(edited_entry, 14, "save_checkpoint")

_MESH_CALL = 'init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))'
_BLOCK_UNITS = '    for block in blocks:\n        fully_shard(block, mesh=mesh["dp"])\n'
_SPLIT = "    start = stage * share + min(stage, extra)\n"

BUGS = {
    "14.1": [
        ("tp outermost: tp groups are ranks far apart", _mesh(
            (_MESH_CALL, 'init_device_mesh(device, (tp, dp, pp), mesh_dim_names=("tp", "dp", '
                         '"pp"))'))),
        ("dp and tp sizes swapped under the same names", _mesh(
            (_MESH_CALL, 'init_device_mesh(device, (pp, tp, dp), mesh_dim_names=("pp", "dp", '
                         '"tp"))'))),
        ("sizes whose product is not the world size are not refused",
         _mesh(("    if dp * tp * pp != world_size:\n", "    if False:\n"))),
    ],
    "14.2": [
        ("plain tensor parallel: no sequence parallel, activations replicated", _parallel(
            ('"attn_norm": SequenceParallel(), "attn": gather,', ""),
            ('"mlp_norm": SequenceParallel(), "mlp": gather,', ""),
            ('"attn.out": RowwiseParallel(output_layouts=Shard(1))',
             '"attn.out": RowwiseParallel()'),
            ('"mlp.fc2": RowwiseParallel(output_layouts=Shard(1))',
             '"mlp.fc2": RowwiseParallel()'),
            ("        if blocks:  # the residual stream",
             "        if False:  # the residual stream"))),
        ("no tensor parallel: blocks whole on every tp rank",
         _parallel(("    if tp_mesh.size() > 1:\n", "    if False:\n"))),
        ("FSDP2 on the root alone: one unit gathered whole", _parallel((_BLOCK_UNITS, ""))),
        ("no FSDP2: everything replicated over dp", _parallel(
            (_BLOCK_UNITS, ""), ('    fully_shard(model, mesh=mesh["dp"])\n', ""))),
        ("blocks kept gathered after forward (reshard_after_forward=False)", _parallel(
            ('        fully_shard(block, mesh=mesh["dp"])',
             '        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)'))),
        ("axis_traffic forgets the backward re-gather of the blocks",
         _parallel(("2 * root + 3 * blocks", "2 * root + 2 * blocks"))),
        ("axis_traffic forgets FSDP2's padding",
         _parallel(("        shape[0] = -(-shape[0] // dp) * dp  # FSDP2 pads dim 0 to a "
                    "multiple of dp\n", ""))),
        ("axis_traffic forgets the two gathers at the model's ends",
         _parallel(("(8 * n_blocks + 2) * activation", "8 * n_blocks * activation"))),
    ],
    "14.3": [
        ("GPipe: every forward before any backward", _pipe(
            ("from torch.distributed.pipelining import PipelineStage, Schedule1F1B",
             "from torch.distributed.pipelining import PipelineStage, ScheduleGPipe"),
            ("Schedule1F1B(pipe, n_microbatches, loss_fn=loss_fn)",
             "ScheduleGPipe(pipe, n_microbatches, loss_fn=loss_fn)"))),
        ("every stage keeps every block", _pipe(
            ("        if key not in mine:\n            del model.blocks[key]\n",
             "        pass\n"))),
        ("the remainder goes to the last stage", _pipe(
            (_SPLIT, "    start = stage * share\n"),
            ("share + (stage < extra)", "share + (stage == pp - 1) * extra"))),
        ("the embedding stays on every stage", _pipe(
            ("    if stage > 0:\n        model.tok = None\n", ""))),
        ("fewer blocks than stages is not refused", _pipe(
            ("    if len(keys) < pp:\n", "    if False:\n"))),
    ],
    "14.4": [
        ("the optimizer's state is not restored", _save(
            ('    state = {"model": model_state, "optim": optim_state, "step": torch.tensor(0)}',
             '    state = {"model": model_state, "step": torch.tensor(0)}'),
            ('optim_state_dict=state["optim"])', "optim_state_dict=optim_state)"))),
        ("the step is not returned", _save(('    return int(state["step"])', "    return 0"))),
        ("the save gathers full tensors on every rank", _save(
            ("    model_state, optim_state = get_state_dict(model, optimizer)\n"
             '    dcp.save({"model"',
             "    from torch.distributed.checkpoint.state_dict import StateDictOptions\n\n"
             "    model_state, optim_state = get_state_dict(\n"
             "        model, optimizer, options=StateDictOptions(full_state_dict=True))\n"
             '    dcp.save({"model"'))),
    ],
}

# Each of these trains on the one-process curve: its first failing case (tests/test_checks.py
# runs every bug to its first failure) is a measurement below Python, never a value.
CAUGHT_BY = {
    "plain tensor parallel: no sequence parallel, activations replicated":
        "bytes per step on the dp and tp axes",
    "blocks kept gathered after forward (reshard_after_forward=False)":
        "bytes per step on the dp and tp axes",
    "GPipe: every forward before any backward": "1F1B's count, bytes and order",
    "the save gathers full tensors on every rank": "peak bytes while saving",
}

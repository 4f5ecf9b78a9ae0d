"""Facts that Lessons 11-13 state about PyG 2.8.1 and torch 2.13, pinned.

As tests/test_claims.py does for Lessons 05-10: each test runs the claim on the installed
libraries, or reads their installed source where the claim is about a condition in it, so that
an upgrade that changes the behaviour fails here and points at the sentence to rewrite.
"""

from __future__ import annotations

import inspect

# --------------------------------------------------------------------------- 11: scaling out


def test_torch_geometric_distributed_warns_that_it_is_deprecated_since_2_7():
    # Lesson 11, "Running at scale": deprecated since PyG 2.7, "will no longer be maintained",
    # pointing to the distributed-training tutorials and cuGraph.
    from torch_geometric.distributed import (
        DistLinkNeighborLoader,
        DistNeighborLoader,
        DistNeighborSampler,
    )

    for cls in (DistNeighborSampler, DistNeighborLoader, DistLinkNeighborLoader):
        source = " ".join(inspect.getsource(cls.__init__).split())
        assert "has been deprecated since 2.7.0" in source, cls
        assert "no longer be maintained" in source and "tutorial/distributed.html" in source, cls
        assert "cugraph" in source, cls


def test_neighbor_loader_takes_no_generator_so_pyg_lib_draws_cannot_be_replayed_from_one():
    # Lesson 11, the introduction: with pyg-lib, the batches are not the same draws.
    from torch_geometric.loader import NeighborLoader
    from torch_geometric.sampler import NeighborSampler

    assert "generator" not in inspect.signature(NeighborLoader.__init__).parameters
    assert "generator" not in inspect.signature(NeighborSampler.__init__).parameters
    source = inspect.getsource(NeighborSampler)
    assert "torch.ops.pyg.neighbor_sample(" in source and "generator" not in source


def test_metis_cuts_several_times_fewer_edges_than_a_random_split_on_the_lessons_graphs():
    # Lesson 11, section 4: "several times fewer" (the lesson prints the ratios it measures).
    from kit.lessons.graphs import metis_partition, partition_stats, peptide_graph, random_partition

    data = peptide_graph()
    for parts in (2, 4, 8):
        metis = partition_stats(
            data.edge_index, metis_partition(data.edge_index, data.num_nodes, parts), parts
        )
        rand = partition_stats(data.edge_index, random_partition(data.num_nodes, parts), parts)
        assert rand["edge_cut"] / metis["edge_cut"] > 2.5, parts

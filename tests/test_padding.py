"""Fixed-shape batches (workbench.train.padding, workbench.packing.shapes): a padded batch gives
the unpadded batch's energies, forces, stress, loss and every parameter gradient, in float64,
on e3nn and on the workbench's kernels; the shape bounds hold for every bin; a batch that does
not fit is refused naming its graphs."""

import copy
import itertools

import numpy as np
import pytest
import torch
from kernel_fixtures import build_model
from test_losses import _batch

from workbench.kernels import accelerate
from workbench.packing import pack
from workbench.packing.shapes import FixedShape, ShapeLadder, fixed_shape, padding_cost, shape_ladder
from workbench.train.config import TrainConfig
from workbench.train.losses import LOSSES, build_loss, outputs_needed
from workbench.train.padding import GRAPH_KEYS, NODE_KEYS, BatchTooLarge, pad_batch

R_MAX = 4.0  # test_losses._batch's cutoff


def _padded(ref, atoms: int = 9, edges: int = 61, graphs: int = 3):
    shape = FixedShape(ref.num_nodes + atoms, int(ref.edge_index.shape[1]) + edges, ref.num_graphs + graphs)
    return pad_batch(copy.deepcopy(ref), shape, R_MAX), shape


def _loss_and_grads(model, batch, name: str):
    stress, virials = (0.7 if "stress" in LOSSES[name].uses else 0.0), (0.4 if name == "virials" else 0.0)
    loss_fn = build_loss(TrainConfig(loss=name, stress_weight=stress, virials_weight=virials))
    compute_stress, compute_virials = outputs_needed(name, stress, virials)
    model.zero_grad(set_to_none=True)
    out = model(
        batch.to_dict(),
        training=True,
        compute_force=True,
        compute_stress=compute_stress,
        compute_virials=compute_virials,
    )
    loss = loss_fn(pred=out, ref=batch, ddp=False)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
    return loss.detach(), {k: v.detach() for k, v in out.items() if isinstance(v, torch.Tensor)}, grads


@pytest.mark.parametrize("backend", ["e3nn", "numba", "torch"])
def test_padded_batch_equals_unpadded(backend):
    """Every loss, with stress where the loss trains it: values, outputs and gradients to 1e-12."""
    ref, _ = _batch(stress_everywhere=False)
    padded, shape = _padded(ref)
    assert padded.num_nodes == shape.atoms and padded.edge_index.shape[1] == shape.edges
    assert padded.num_graphs == shape.graphs and int(padded.real_graphs) == ref.num_graphs
    model = build_model("ScaleShiftMACE", "8x0e+8x1o", 2, 3, n_elements=1)
    model = accelerate(model, backend=backend) if backend != "e3nn" else model
    G, A = ref.num_graphs, ref.num_nodes
    for name in LOSSES:
        loss, out, grads = _loss_and_grads(model, ref, name)
        loss_p, out_p, grads_p = _loss_and_grads(model, padded, name)
        assert abs(float(loss - loss_p)) <= 1e-12 * abs(float(loss)), name
        assert torch.allclose(out["forces"], out_p["forces"][:A], rtol=0, atol=1e-12)
        assert torch.equal(out_p["forces"][A:], torch.zeros_like(out_p["forces"][A:])), "ghost atoms feel no force"
        for key in ("energy", "stress", "virials"):
            if key in out and key in out_p:
                assert torch.allclose(out[key], out_p[key][:G], rtol=1e-12, atol=1e-12), (name, key)
        scale = max(float(g.abs().max()) for g in grads)
        assert scale > 0
        for g, gp in zip(grads, grads_p):
            assert float((g - gp).abs().max()) <= 1e-12 * scale, name


def test_ghosts_are_beyond_the_cutoff_and_carry_no_weight():
    ref, _ = _batch(stress_everywhere=True)
    padded, shape = _padded(ref)
    A, G, E = ref.num_nodes, ref.num_graphs, ref.edge_index.shape[1]
    ghost_edges = padded.edge_index[:, E:]
    assert torch.equal(ghost_edges, torch.full_like(ghost_edges, A))  # self-loops of the first ghost atom
    lengths = torch.linalg.norm(padded.shifts[E:], dim=1)
    assert bool((lengths > R_MAX).all())
    assert torch.equal(padded.batch[A:], torch.full((shape.atoms - A,), G))
    assert torch.equal(padded.ptr[G + 1 :], torch.full((shape.graphs - G,), shape.atoms))
    for key in ("weight", "energy_weight", "forces_weight", "stress_weight", "virials_weight"):
        assert torch.equal(padded[key][G:], torch.zeros_like(padded[key][G:])), key
    assert float(padded.node_attrs[A:].abs().sum()) == 0.0
    assert bool((torch.linalg.det(padded.cell.view(-1, 3, 3)[G:]) > R_MAX**3).all())


def test_every_field_of_a_mace_batch_is_known():
    """A mace upgrade that adds a field fails here, not by padding it misaligned."""
    from workbench.train import padding

    ref, _ = _batch(stress_everywhere=True)
    known = set(NODE_KEYS) | set(padding.EDGE_KEYS) | set(padding.CELL_KEYS) | set(GRAPH_KEYS) | {"ptr"}
    assert set(ref.keys) <= known
    ref.mystery = torch.zeros(ref.num_graphs)
    with pytest.raises(KeyError, match="'mystery'"):
        pad_batch(ref, FixedShape(ref.num_nodes + 1, int(ref.edge_index.shape[1]), ref.num_graphs + 1), R_MAX)


@pytest.mark.parametrize("what", ["atoms", "edges", "graphs"])
def test_a_batch_over_its_shape_is_refused(what):
    ref, _ = _batch(stress_everywhere=True)
    room = {"atoms": ref.num_nodes + 1, "edges": int(ref.edge_index.shape[1]), "graphs": ref.num_graphs + 1}
    room[what] -= 1
    with pytest.raises(BatchTooLarge, match=rf"training graphs 7, 3, 5\) has \d+ {what}"):
        pad_batch(ref, FixedShape(**room), R_MAX, indices=[7, 3, 5])


def _brute_force_bounds(atoms, edges, capacity):
    most_graphs, most_edges = 0, 0
    for k in range(1, len(atoms) + 1):
        for subset in itertools.combinations(range(len(atoms)), k):
            if atoms[list(subset)].sum() <= capacity:
                most_graphs = max(most_graphs, k)
                most_edges = max(most_edges, int(edges[list(subset)].sum()))
    return most_graphs, most_edges


@pytest.mark.parametrize("seed", range(4))
def test_shape_bounds_hold_for_every_possible_bin(seed):
    rng = np.random.default_rng(seed)
    atoms = rng.integers(1, 12, 11)
    edges = atoms * rng.integers(0, 9, 11) + rng.integers(0, 5, 11)
    capacity = int(rng.integers(12, 30))
    shape = fixed_shape(atoms, edges, capacity)
    most_graphs, most_edges = _brute_force_bounds(atoms, edges, capacity)
    assert shape.atoms == capacity + 1 and shape.graphs == most_graphs + 1  # exact
    assert most_edges <= shape.edges <= capacity * float(np.max(edges / atoms))  # a bound, at most the crude one
    for algorithm in ("paper", "ffd"):
        bins = pack(atoms, capacity, algorithm=algorithm).batches
        assert all(int(edges[b].sum()) <= shape.edges and len(b) < shape.graphs for b in bins)


def test_shape_errors_name_the_graph():
    with pytest.raises(ValueError, match="graph 2 \\(40 atoms\\) exceeds the capacity of 32"):
        fixed_shape([3, 5, 40], [6, 10, 80], 32)
    with pytest.raises(ValueError, match="edge_capacity 50 is below graph 2's 80 edges"):
        fixed_shape([3, 5, 30], [6, 10, 80], 32, edge_capacity=50)
    assert fixed_shape([3, 5, 30], [6, 10, 80], 32, edge_capacity=82).edges == 82
    assert fixed_shape([3, 5, 30], [6, 10, 80], 32, edge_capacity=90).edges == 84  # the bound is smaller


def test_padding_cost_counts_ghosts():
    cost = padding_cost([10, 7], [40, 30], FixedShape(atoms=11, edges=50, graphs=4))
    want = {"batches": 2, "shapes_used": 1, "ghost_atoms": 5, "ghost_edges": 30, "atoms_added": 5 / 17}
    assert cost == {**want, "edges_added": 30 / 70}
    cost = padding_cost([10, 7], [40, 30], ShapeLadder(atoms=11, graphs=4, edges=(30, 45, 50)))
    assert cost == {**want, "shapes_used": 2, "ghost_edges": 5, "edges_added": 5 / 70}
    with pytest.raises(ValueError, match="a bin has 51 edges, above the top shape's 50"):
        padding_cost([10], [51], FixedShape(atoms=11, edges=50, graphs=4))


@pytest.mark.parametrize("step", [0.0, 0.02, 0.05, 0.3])
def test_a_ladder_pads_each_batch_by_at_most_its_step(step):
    top = FixedShape(atoms=3073, edges=182_467, graphs=1974)
    ladder = shape_ladder(top, step)
    assert ladder.edges[-1] == top.edges and list(ladder.edges) == sorted(set(ladder.edges))
    assert ladder.top == top and (len(ladder.edges) == 1) == (step == 0)
    rng = np.random.default_rng(3)
    for edges in [*rng.integers(1, top.edges, 200), 1, top.edges, *ladder.edges]:
        shape = ladder.shape_for(int(edges))
        assert (shape.atoms, shape.graphs) == (top.atoms, top.graphs)
        assert edges <= shape.edges and (step == 0 or shape.edges <= max((1 + step) * edges + 1, ladder.edges[0]))
    with pytest.raises(ValueError, match="182468 edges: above the top fixed shape's 182467"):
        ladder.shape_for(top.edges + 1)
    with pytest.raises(ValueError, match="step must be in"):
        shape_ladder(top, 1.0)


@pytest.mark.parametrize("backend", ["e3nn", "numba"])
def test_a_fixed_shape_run_trains_as_the_variable_shape_run(tmp_path, backend):
    """The same run with and without ``fixed_shapes`` (float64, stress trained, molecules and
    crystals): the same step losses (so the same weights at every step), logged sizes and
    epoch errors; the fixed-shape run logs what padding added."""
    import json

    from train_fixtures import step_losses, tiny

    from workbench.train.loop import train
    from workbench.train.presets import small_dataset
    from workbench.train.rundir import read_epochs

    src = small_dataset(tmp_path / "mix.extxyz", n=40, families=("water_clusters", "hea", "mptrj"))
    run = dict(dataset=str(src), dtype="float64", loss="stress", stress_weight=5.0, capacity=300, max_steps=5)
    run |= dict(families=None, max_structures=None, backend=backend, export=False)
    plain, fixed = (train(tiny(tmp_path, f"{backend}-{f}", fixed_shapes=f, **run), resume=False) for f in (False, True))
    assert step_losses(fixed.run_dir) == pytest.approx(step_losses(plain.run_dir), rel=1e-12, abs=0)

    def steps(result):
        lines = (result.run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r.get("type") == "step"]

    sizes = [[(r["atoms"], r["edges"], r["graphs"]) for r in steps(run)] for run in (plain, fixed)]
    assert sizes[0] == sizes[1] and len(sizes[0]) == 5
    assert all(r["ghost_atoms"] >= 1 and r["ghost_edges"] >= 0 for r in steps(fixed))
    assert len({r["atoms"] + r["ghost_atoms"] for r in steps(fixed)}) == 1 and "ghost_atoms" not in steps(plain)[0]
    a, b = read_epochs(plain.run_dir)[-1], read_epochs(fixed.run_dir)[-1]
    for key in ("train_e_mae_mev_atom", "train_f_mae_mev_a", "train_s_mae_mev_a3"):
        assert b[key] == pytest.approx(a[key], rel=1e-10), key

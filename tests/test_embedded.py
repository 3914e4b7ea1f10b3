"""The shipped dataset: valid, Table-3 counts, and regenerable bit for bit from its seed."""

import gzip

import pytest

from workbench.data import FAMILY_NAMES, family_counts, read_structures
from workbench.data.embedded import EMBEDDED_N, EMBEDDED_PATH, EMBEDDED_SEED
from workbench.data.generators import generate
from workbench.data.io import structures_to_text
from workbench.data.mixture import mixture_tasks

pytestmark = pytest.mark.skipif(not EMBEDDED_PATH.exists(), reason="embedded dataset missing")


@pytest.fixture(scope="module")
def raw_frames():
    """The decompressed file cut into the exact text of each frame."""
    lines = gzip.decompress(EMBEDDED_PATH.read_bytes()).decode().splitlines(keepends=True)
    frames, i = [], 0
    while i < len(lines):
        n = int(lines[i])
        frames.append("".join(lines[i:i + n + 2]))
        i += n + 2
    return frames


@pytest.fixture(scope="module")
def structures():
    return read_structures(EMBEDDED_PATH, require_labels=True)


def test_size_and_validity(structures):
    assert EMBEDDED_PATH.stat().st_size <= 10e6
    assert len(structures) == EMBEDDED_N
    counts = {f: sum(a.info["config_type"] == f for a in structures) for f in FAMILY_NAMES}
    assert counts == family_counts(EMBEDDED_N)
    labelled = {a.info["config_type"] for a in structures if a.info["labelled"]}
    assert labelled == set(FAMILY_NAMES) - {"zeolite", "tmd"}  # the card explains why these two are unlabelled


def test_frame_order_is_make_mixture_order(structures):
    tasks = mixture_tasks(n=EMBEDDED_N, seed=EMBEDDED_SEED)
    assert [(a.info["config_type"], a.info["family_index"]) for a in structures] == [t[:2] for t in tasks]


@pytest.mark.parametrize("family", ["mptrj", "water_clusters", "liquid_water", "zeolite", "cuni", "hea", "tmd"])
def test_frames_regenerate_bit_for_bit(raw_frames, structures, family):
    # The first two frames of each family (al_hcl's one frame needs 2 minutes of GFN1-xTB: not here).
    picks = [k for k, a in enumerate(structures) if a.info["config_type"] == family]
    for k in picks[:2]:
        a = structures[k]
        again = generate(family, a.info["family_index"], a.info["seed"])
        assert structures_to_text([again]) == raw_frames[k], f"frame {k} ({family}) differs"

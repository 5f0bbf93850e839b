"""The bundles of a run's placement group and each actor's share of them, scorers included."""

from __future__ import annotations

import pytest

from tandem.cluster.placement import _layout


def gpu_shares(bundles: list[dict[str, float]], *parts: list[tuple[int, float, float]]) -> list:
    """Per bundle, the GPUs its actors ask for (must fit in the bundle's)."""
    asked = [0.0] * len(bundles)
    for part in parts:
        for index, _, gpus in part:
            asked[index] += gpus
    return asked


@pytest.mark.parametrize("mode", ["colocated", "split"])
@pytest.mark.parametrize("scorer_mode", ["colocated", "split"])
@pytest.mark.parametrize(("trainers", "generators", "scorers"), [(1, 1, 0), (1, 1, 2), (2, 1, 1)])
def test_every_bundle_holds_what_its_actors_ask(
    mode: str, scorer_mode: str, trainers: int, generators: int, scorers: int
) -> None:
    bundles, t, g, s = _layout(mode, trainers, generators, 0.5, 1.0, scorers, scorer_mode)  # type: ignore[arg-type]
    assert (len(t), len(g), len(s)) == (trainers, generators, scorers)
    for asked, bundle in zip(gpu_shares(bundles, t, g, s), bundles, strict=True):
        assert asked == pytest.approx(bundle["GPU"])
    cpus = [0.0] * len(bundles)
    for index, c, _ in [*t, *g, *s]:
        cpus[index] += c
    assert cpus == [b["CPU"] for b in bundles]


def test_colocated_scorers_share_the_first_device_split_ones_own_one() -> None:
    bundles, t, g, s = _layout("colocated", 1, 1, 1.0, 1.0, 2, "colocated")
    assert len(bundles) == 1 and {i for i, _, _ in [*t, *g, *s]} == {0}
    assert [gpus for _, _, gpus in [*t, *g, *s]] == pytest.approx([0.25] * 4)
    bundles, t, g, s = _layout("colocated", 1, 1, 1.0, 1.0, 2, "split")
    assert len(bundles) == 3 and [i for i, _, _ in s] == [1, 2]
    assert [gpus for _, _, gpus in s] == [1.0, 1.0] and t[0][2] == g[0][2] == 0.5


def test_without_gpus_no_bundle_asks_for_one() -> None:
    bundles, *_ = _layout("split", 1, 2, 1.0, 0.0, 1, "split")
    assert all("GPU" not in b for b in bundles) and len(bundles) == 4

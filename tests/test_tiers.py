"""The default tier's share of a sampled test (conftest.py): every n-th combination of its
parameters, and few more, that bring every value of every parameter; and the emulated
variants the platform tests' combinations take in turn."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from conftest import (
    _combination,
    _rotated_simt_platforms,
    _sampled_combinations,
    pytest_collection_modifyitems,
)
from helpers import SIMT_PLATFORMS


def _item(function, params: dict, n: int, extended: bool = False):
    markers = {"sampled": SimpleNamespace(args=(n,))}
    if extended:
        markers["extended"] = SimpleNamespace(args=())
    return SimpleNamespace(
        function=function,
        callspec=SimpleNamespace(params=params),
        get_closest_marker=markers.get,
        add_marker=lambda mark: markers.setdefault(mark.name, mark),
    )


def _grid(function, n: int, platforms=("cpu",), **values):
    names = list(values)
    return [
        _item(function, dict(zip(names, combination, strict=True), platform=platform), n)
        for combination in itertools.product(*values.values())
        for platform in platforms
    ]


def _values(combinations) -> set:
    return {pair for combination in combinations for pair in combination}


def test_every_value_of_every_parameter_in_few_combinations():
    def test_grid():
        pass

    items = _grid(test_grid, 1000, platforms=("cpu", "simt-a"), a=[1, 2, 3], b="wxyz", c=[0, 1])
    kept = _sampled_combinations(items)[test_grid]
    assert _values(kept) == _values(_combination(i) for i in items)
    # A cover needs at least one combination per value of the parameter with the most,
    # and on this grid the greedy cover needs no more.
    assert len(kept) == 4
    # The platform is not a parameter of the combination: its items share the choice.
    assert {_combination(i) for i in items if i.callspec.params["platform"] == "simt-a"} >= kept


def test_every_nth_combination_is_kept():
    def test_grid():
        pass

    items = _grid(test_grid, 6, a=range(4), b=range(5))
    kept = _sampled_combinations(items)[test_grid]
    in_order = [_combination(i) for i in items]
    # (0, 0), (1, 1), (2, 2), (3, 3), then the first that brings b = 4.
    assert kept == {*in_order[::6], (("a", "0"), ("b", "4"))}


def test_combinations_already_extended_take_no_part():
    def test_grid():
        pass

    items = _grid(test_grid, 1000, a=[1, 2])
    items.append(_item(test_grid, {"a": 3}, 1000, extended=True))
    kept = _sampled_combinations(items)[test_grid]
    assert kept == {(("a", "1"),), (("a", "2"),)}


def test_each_combination_takes_one_variant_and_each_variant_every_test():
    def test_grid():
        pass

    def test_few():
        pass

    def test_marked():
        pass

    platforms = ("cpu", *SIMT_PLATFORMS, "gpu")
    grid = _grid(test_grid, 1, platforms=platforms, a=range(len(SIMT_PLATFORMS) + 2))
    few = _grid(test_few, 1, platforms=platforms, a=range(len(SIMT_PLATFORMS) - 1))
    marked = _grid(test_marked, 1, platforms=platforms, a=range(5))
    for item in marked:
        item.get_closest_marker = {"default_platforms": SimpleNamespace(args=("cpu",))}.get
    extended = _item(test_grid, {"a": 99, "platform": SIMT_PLATFORMS[0]}, 1, extended=True)
    rotation = _rotated_simt_platforms([*grid, *few, *marked, extended])
    # Fewer combinations than variants, or a default_platforms marker: every variant kept.
    assert set(rotation) == {test_grid}
    chosen = rotation[test_grid]
    assert set(chosen) == {_combination(i) for i in grid}  # the extended one takes no part
    assert set(chosen.values()) == set(SIMT_PLATFORMS)
    assert len({chosen[_combination(i)] for i in grid[: len(platforms) * 3]}) == 3


def test_a_test_on_some_variants_keeps_one_of_its_own_per_combination():
    def test_some():
        pass

    ours = SIMT_PLATFORMS[1:]
    items = _grid(test_some, 1, platforms=("cpu", *ours), a=range(5))
    # One combination lacks a variant: it takes the other in its turn.
    items = [i for i in items if i.callspec.params != {"a": 2, "platform": ours[0]}]
    items = [i for i in items if i.callspec.params != {"a": 3, "platform": ours[1]}]
    pytest_collection_modifyitems(None, items)
    default = [i for i in items if not i.get_closest_marker("extended")]
    for a in range(5):
        platforms = [i.callspec.params["platform"] for i in default if i.callspec.params["a"] == a]
        assert platforms[0] == "cpu" and len(platforms) == 2 and platforms[1] in ours, platforms
    assert {i.callspec.params["platform"] for i in default} == {"cpu", *ours}

"""What an implementation is to the benchmark, and the registry that finds one by name.

An implementation says which ops and backends it computes, whether its outputs are held to
the spec's accuracy rule, its colour in every figure, and how it is timed on one shape
(:class:`Case`). ``fp8norm:<variant>`` names resolve through the implementation that
has variants (the kernel): one entry per CUDA kernel variant.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import jax


@dataclass(frozen=True)
class Case:
    """One op at one shape, as every implementation is timed on it."""

    op: str
    rows: int
    hidden: int
    dtype_name: str
    nbytes: int  # what the op must move (ops.op_bytes)
    input_sets: tuple[tuple, ...]  # one per call
    calls: int  # K
    repeats: int
    device: jax.Device


@dataclass(frozen=True)
class Timing:
    seconds: float  # device time per call
    calls: int  # calls per timed program (K), or 1 for what is timed call by call
    distinct_inputs: int  # different input sets those calls rotate among


@dataclass(frozen=True)
class Implementation:
    name: str
    colour: str  # the same in every panel of every figure
    description: str
    measure: Callable[[Case], Timing | None]  # None: not available here (a missing import)
    ops: tuple[str, ...] | None = None  # the ops it computes; None: every op
    backends: tuple[str, ...] | None = None  # the platforms it runs on; None: every one
    checked: bool = False  # outputs held to the reference's accuracy rule in the run
    ceiling: bool = False  # moves the op's bytes without computing it (a copy)
    build: Callable[[str], Callable] | None = None  # op -> its JAX function, if it has one
    variant: Callable[[str], Implementation] | None = None  # variant name -> that variant

    def supports(self, op: str, backend: str) -> bool:
        return (self.ops is None or op in self.ops) and (
            self.backends is None or backend in self.backends
        )


# For names no implementation fixes a colour for (a variant added later): picked by a
# checksum of the name, so that it is the same in every run and every figure.
SPARE_COLOURS = ("#332288", "#117733", "#44AA99", "#999933", "#AA4499", "#661100")


def spare_colour(name: str) -> str:
    return SPARE_COLOURS[zlib.crc32(name.encode()) % len(SPARE_COLOURS)]


class Registry:
    """Implementations by name, in the order a run times them."""

    def __init__(self, *implementations: Implementation) -> None:
        self._by_name = {impl.name: impl for impl in implementations}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def __contains__(self, name: str) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True

    def __iter__(self) -> Iterator[Implementation]:
        return iter(self._by_name.values())

    def __getitem__(self, name: str) -> Implementation:
        """The implementation of a name, ``base:variant`` names included."""
        if name in self._by_name:
            return self._by_name[name]
        base, _, variant = name.partition(":")
        impl = self._by_name.get(base)
        if variant and impl is not None and impl.variant is not None:
            return impl.variant(variant)
        raise KeyError(name)

    def expand(self, name: str, variants: Sequence[str] = ()) -> list[Implementation]:
        """What a run times for a name: the variants, for the implementation that has them
        when variants are asked for, else the implementation itself."""
        impl = self[name]
        if variants and impl.variant is not None:
            return [impl.variant(v) for v in variants]
        return [impl]

    def colour(self, name: str) -> str:
        """The colour of an implementation, or of an unknown name (an old result file)."""
        try:
            return self[name].colour
        except KeyError:
            return spare_colour(name)

    def is_ceiling(self, name: str) -> bool:
        return name in self and self[name].ceiling

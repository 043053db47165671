"""Which layer stashes and which pops each skip, checked before any step; and, for a split, the stage pairs
the skip tensors travel between."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_gpipe.engine.skip.skippable import is_skippable


@dataclass(frozen=True)
class Route:
    """One skip that crosses stages: stashed by backbone layer ``stash_layer`` on stage ``src``, popped on
    stage ``dst > src``."""

    key: Any
    stash_layer: int
    src: int
    dst: int


class SkipLayout:
    """The skips of a backbone split into stages: which ones cross stages, and between which.

    Args:
        backbone: the ``nn.Sequential`` whose direct children may be skippable layers.
        balance: layers per stage (``None``: all on one stage).

    Attributes:
        routes: the skips that cross stages (:class:`Route`), in the same order on every process.
        stages: the stages whose layers stash or pop a skip (the others run their layers without a skip tracker).

    Raises:
        ValueError: as :func:`verify_skippables`.
    """

    def __init__(self, backbone: nn.Sequential, balance: Sequence[int] | None = None) -> None:
        pairs = _pairs(backbone)
        balance = list(balance) if balance is not None else [len(backbone)]
        stage_of = [stage for stage, n in enumerate(balance) for _ in range(n)]
        self.stages = {stage_of[layer] for pair in pairs.values() for layer in pair}
        self.routes = sorted(
            (Route(key, s, stage_of[s], stage_of[p]) for key, (s, p) in pairs.items() if stage_of[s] != stage_of[p]),
            key=lambda route: (route.stash_layer, route.key[1]),  # the same order in every process
        )

    def outgoing(self, stage: int) -> dict[int, list[Any]]:
        """Keys stashed on ``stage`` and popped on a later one, by popping stage, in a fixed order."""
        found: dict[int, list[Any]] = {}
        for route in self.routes:
            if route.src == stage:
                found.setdefault(route.dst, []).append(route.key)
        return found

    def incoming(self, stage: int) -> dict[int, list[Any]]:
        """Keys popped on ``stage`` and stashed on an earlier one, by stashing stage, in the senders' order."""
        found: dict[int, list[Any]] = {}
        for route in self.routes:
            if route.dst == stage:
                found.setdefault(route.src, []).append(route.key)
        return found


def verify_skippables(backbone: nn.Sequential) -> None:
    """Check that every skip of ``backbone`` is stashed by exactly one layer and popped by exactly one later one.

    Only direct children of ``backbone`` are looked at (as in torchgpipe). Runs without a pipeline too.

    Raises:
        ValueError: naming every problem: a pop with no earlier stash, a name stashed (or popped) by two layers
            of one namespace, a stash never popped, a layer declaring one name both ways, or a skippable layer
            nested inside another module. Source: torchgpipe's ``verify_skippables`` (which raises TypeError).
    """
    _pairs(backbone)


def _pairs(backbone: nn.Sequential) -> dict[Any, tuple[int, int]]:
    """Each skip's (stashing layer, popping layer) positions; raises ValueError as :func:`verify_skippables`."""
    stashed: dict[Any, int] = {}
    pairs: dict[Any, tuple[int, int]] = {}
    problems: list[str] = []
    for index, (name, layer) in enumerate(backbone.named_children()):
        for inner, sub in layer.named_modules():
            if inner and is_skippable(sub):
                problems.append(
                    f"layer {name} holds the skippable `{inner}` ({type(sub).__name__}) inside it; skippable layers"
                    " must be direct children of the backbone nn.Sequential"
                )
        if not is_skippable(layer):
            continue
        for both in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"layer {name} declares {both!r} both as stash and as pop")
        for skip in sorted(layer.poppable_names - layer.stashable_names):
            key = layer.namespaced(skip)
            if key in pairs:
                problems.append(
                    f"layer {name} pops {skip!r}, already popped by layer {pairs[key][1]}; isolate each stash/pop pair"
                    " in its own Namespace (`.isolate(ns)`)"
                )
            elif key not in stashed:
                problems.append(f"layer {name} pops {skip!r} but no earlier layer stashes it")
            else:
                pairs[key] = (stashed.pop(key), index)
        for skip in sorted(layer.stashable_names - layer.poppable_names):
            key = layer.namespaced(skip)
            earlier = stashed.get(key, pairs.get(key, (None,))[0])
            if earlier is not None:
                problems.append(
                    f"layer {name} stashes {skip!r}, already stashed by layer {earlier}; isolate each stash/pop pair"
                    " in its own Namespace (`.isolate(ns)`)"
                )
            else:
                stashed[key] = index
    for key, index in stashed.items():
        problems.append(f"layer {index} stashes {key[1]!r} but no later layer pops it")
    if problems:
        raise ValueError("The backbone's skip connections do not pair up: " + "; ".join(problems) + ".")
    return pairs

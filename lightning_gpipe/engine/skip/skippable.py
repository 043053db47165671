"""Declaring skips: the :func:`skippable` class decorator, the :class:`stash` and :class:`pop` commands, and
:class:`Namespace` for layers repeated in one backbone (torchgpipe's public API)."""

import functools
import inspect
from collections.abc import Iterable
from typing import Any, Optional, Protocol, TypeGuard, TypeVar

from torch import Tensor, nn

from lightning_gpipe.engine.skip import tracker

Key = tuple[Optional["Namespace"], str]
"""A skip's identity: its namespace (``None`` for the default one) and its name."""


class Namespace:
    """A namespace that keeps the skips of one layer (or group of layers) apart from same-named ones.

    Two instances of one skippable class in one backbone would stash the same name twice; isolate each
    stash/pop pair in its own namespace with :meth:`isolate`::

        ns1, ns2 = Namespace(), Namespace()
        backbone = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2), Pop().isolate(ns2), Pop().isolate(ns1))

    Namespaces compare by identity; a copy of a layer (``copy.deepcopy``) keeps its namespace. Source: torchgpipe's
    ``torchgpipe.skip.Namespace``.
    """

    __slots__ = ()

    def __copy__(self) -> "Namespace":
        return self

    def __deepcopy__(self, memo: dict) -> "Namespace":
        return self

    def __repr__(self) -> str:
        return f"<Namespace {id(self):#x}>"


class stash:  # lower case: torchgpipe's name
    """The command ``yield stash(name, tensor)``: hand ``tensor`` to the later layer that pops ``name``.

    Args:
        name: a name the layer declared in ``@skippable(stash=[...])``.
        tensor: the tensor to pass (any shape and dtype; under a pipeline its dim 0 is the micro-batch's rows).
    """

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Tensor) -> None:
        self.name, self.tensor = name, tensor


class pop:  # lower case: torchgpipe's name
    """The command ``tensor = yield pop(name)``: take the tensor an earlier layer stashed under ``name``.

    Args:
        name: a name the layer declared in ``@skippable(pop=[...])``.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()):
    """Class decorator: a module whose ``forward`` may ``yield stash(name, tensor)`` and ``x = yield pop(name)``.

    The decorated class is a subclass of the original with the same name, parameters and state-dict names;
    its ``forward`` runs the original generator, answers each command, and returns what the generator returns.
    A ``forward`` that yields nothing is called as it is. Each declared name must be stashed (or popped)
    exactly once per call. Use such layers as direct children of the backbone ``nn.Sequential``; a stash
    must be popped by a later layer of the same backbone (checked by :func:`verify_skippables`).

    Args:
        stash: names this layer stashes.
        pop: names this layer pops.

    Returns:
        A decorator of ``nn.Module`` subclasses. The decorated class gains :meth:`isolate`, and the class
        attributes ``stashable_names`` and ``poppable_names`` (frozensets).

    Raises:
        TypeError: when decorating something that is not an ``nn.Module`` subclass, or a name that is not a
            string. At call time, ``RuntimeError`` for a command of an undeclared name, a declared name not
            stashed or popped, a name stashed twice in one call, a popped name nobody stashed, or a yielded
            object that is not a command; ``TypeError`` for a stashed value that is not a tensor.

    Source: torchgpipe's ``torchgpipe.skip.skippable`` (same names and semantics; the subclass keeps state-dict
    names where torchgpipe's wrapper adds ``.module``).
    """
    stashable, poppable = _names(stash, "stash"), _names(pop, "pop")

    def decorate(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"@skippable decorates nn.Module subclasses, not {cls!r}.")
        original = cls.forward

        @functools.wraps(original)
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return _dispatch(self, original(self, *args, **kwargs))

        attrs = {
            "forward": forward,
            "isolate": _isolate,
            "namespaced": _namespaced,
            "stashable_names": stashable,
            "poppable_names": poppable,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,  # the decorated class takes the original's place: picklable
            "__doc__": cls.__doc__,
        }
        return type(cls.__name__, (cls,), attrs)

    return decorate


class Skippable(Protocol):
    """What :func:`skippable` adds to a module class, as type checkers see a layer of it (see :func:`is_skippable`)."""

    stashable_names: frozenset[str]
    poppable_names: frozenset[str]

    def namespaced(self, name: str) -> Key: ...


_Layer = TypeVar("_Layer", bound=Skippable)


def is_skippable(module: nn.Module) -> TypeGuard[Skippable]:
    """Whether ``module`` is an instance of a class decorated with :func:`skippable`."""
    return hasattr(type(module), "stashable_names") and hasattr(type(module), "poppable_names")


def _names(names: Iterable[str], kind: str) -> frozenset[str]:
    names = (names,) if isinstance(names, str) else tuple(names)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"@skippable({kind}={names!r}): give the skip names as strings.")
    return frozenset(names)


def _isolate(self: _Layer, ns: Namespace, *, only: Iterable[str] | None = None) -> _Layer:
    """Put this layer's skip names (all, or ``only`` these) in namespace ``ns``; returns the layer itself.

    Raises:
        ValueError: if ``only`` names a skip this layer does not declare.
    """
    declared = self.stashable_names | self.poppable_names
    names = declared if only is None else frozenset(only)
    if names - declared:
        raise ValueError(f"{type(self).__name__}.isolate(only={sorted(names)}): it declares only {sorted(declared)}.")
    self.__dict__.setdefault("_skip_namespaces", {}).update(dict.fromkeys(names, ns))
    return self


def _namespaced(self: Skippable, name: str) -> Key:
    """The key of this layer's skip ``name``: ``(namespace, name)``."""
    return self.__dict__.get("_skip_namespaces", {}).get(name), name


def _dispatch(layer: Skippable, generator: Any) -> Any:
    """Run the ``forward`` generator of ``layer``, answering its commands from the current tracker."""
    done_stash: set[str]
    done_pop: set[str]
    if not inspect.isgenerator(generator):
        done_stash, done_pop = set(), set()
        output = generator
    else:
        output, done_stash, done_pop = _drive(layer, generator, tracker.current())
    for kind, declared, done in (("stash", layer.stashable_names, done_stash), ("pop", layer.poppable_names, done_pop)):
        missing = declared - done
        if missing:
            raise RuntimeError(
                f"{type(layer).__name__} declares {kind}={sorted(declared)} but its forward did not"
                f" `yield {kind}(...)` {', '.join(map(repr, sorted(missing)))}; every declared name must be"
                f" {'stashed' if kind == 'stash' else 'popped'} exactly once per call."
            )
    return output


def _drive(layer: Skippable, generator: Any, skips: "tracker.SkipTracker") -> tuple[Any, set[str], set[str]]:
    stashed: set[str]
    popped: set[str]
    stashed, popped, reply = set(), set(), None
    try:
        while True:
            command = generator.send(reply)
            reply = None
            if isinstance(command, stash):
                _check(layer, command.name, layer.stashable_names, stashed, "stash")
                if not isinstance(command.tensor, Tensor):
                    raise TypeError(
                        f"{type(layer).__name__} stashed {type(command.tensor).__name__} as {command.name!r};"
                        " stash a tensor."
                    )
                skips.save(layer.namespaced(command.name), command.tensor)
            elif isinstance(command, pop):
                _check(layer, command.name, layer.poppable_names, popped, "pop")
                reply = skips.load(layer.namespaced(command.name))
            else:
                raise RuntimeError(
                    f"{type(layer).__name__}'s forward yielded {command!r}; a skippable forward yields only"
                    " `stash(name, tensor)` and `pop(name)`."
                )
    except StopIteration as stop:
        return stop.value, stashed, popped


def _check(layer: Skippable, name: str, declared: frozenset[str], done: set[str], kind: str) -> None:
    if name not in declared:
        raise RuntimeError(
            f"{type(layer).__name__} yielded {kind}({name!r}) but declares {kind}={sorted(declared)}; add {name!r} to"
            f" `@skippable({kind}=[...])`."
        )
    if name in done:
        raise RuntimeError(f"{type(layer).__name__} yielded {kind}({name!r}) twice in one call; once per call.")
    done.add(name)

"""Modules registered under dotted paths of another module: how a backbone layer holds some of a whole model's modules
under their names in the model, so that its state-dict names are the model's (``model.layers.2.mlp.weight``)."""

from torch import nn

from lightning_gpipe._torch import children


class PathContainer(nn.Module):
    """An empty container standing for one component of a module path (``model`` in ``model.layers.2``)."""


def attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` in ``root`` under the dotted ``path`` (``"model.layers.2"``), creating a
    :class:`PathContainer` for each component above it that ``root`` does not have yet. ``module`` is shared, not
    copied."""
    *parents, last = path.split(".")
    node = root
    for name in parents:
        child = children(node).get(name)
        if child is None:
            child = PathContainer()
            node.add_module(name, child)
        node = child
    node.add_module(last, module)

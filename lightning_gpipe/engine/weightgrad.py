"""A micro-batch's backward in two halves: the input gradient first (B), the weight gradient later (W).

Zero-bubble pipeline parallelism (Qi et al. 2023, arXiv:2401.10241, section 2) splits each backward
into B, the gradient of the stage's input, which the previous stage waits for, and W, the gradient of
the stage's parameters, which nobody waits for. Sending B's result before computing W lets the previous
stage start its backward earlier. torch's peer is ``torch.distributed.pipelining._backward``
(``stage_backward_input`` / ``stage_backward_weight``); this is our own, written for one stage.

How (autograd does the arithmetic, we only choose what it computes when):

- B: ``torch.autograd.backward(outputs, grads, inputs=stage_inputs, retain_graph=True)``. Autograd computes
  only what leads to the inputs, so a layer's node (e.g. ``AddmmBackward``) computes its input gradient
  but not its weight gradient. Meanwhile a hook on every *branch node* (a node on the path to the inputs
  that also has an edge towards a parameter) keeps the gradient arriving there.
- W: for each group of branch nodes that share parameters, ``torch.autograd.backward`` from those nodes
  (``GradientEdge`` roots) with the kept gradients, ``inputs=`` the group's parameters. Autograd runs the
  branch nodes again computing only the parameters' side, and accumulates into ``.grad`` through the
  parameters' own ``AccumulateGrad`` nodes, so gradient hooks fire as in a plain backward. Where one branch
  node of a group lies below another, a hook pins its incoming gradient to the kept one (no double count).

Memory: between B and W the micro-batch's graph (its saved activations) is kept, plus the gradients
kept at the branch nodes (about one activation per layer with parameters).

Several micro-batches' W at once (:func:`run_together`): a plain linear layer's weight gradient summed over
micro-batches, ``sum_i G_i^T X_i``, is one ``G^T X`` over their rows stacked, one large matrix product instead of
several small ones (faster on a CPU, whose small products use its cores less well). A branch node qualifies when
it is a ``torch.addmm`` (or ``torch.mm``) of the layer's input and ``weight.t()`` (``nn.Linear``,
``F.linear``), its weight side is the parameters themselves (no cast, no sharing with another branch node), and
it is so in every micro-batch; every other group runs as in :meth:`DeferredWeightGradient.__call__`.
"""

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lightning_gpipe._torch import saved


class DeferredWeightGradient:
    """The W half of a backward, ready to run once: accumulates the parameters' gradients into ``.grad``.

    Made by :func:`backward_input`. Calling it twice raises ``RuntimeError`` (the graph is freed by the first call).
    """

    def __init__(self, groups: list["_Group"]) -> None:
        self._groups: list[_Group] | None = groups

    def __call__(self) -> None:
        """Compute the weight gradients and add them to the parameters' ``.grad``."""
        run_together([self])

    @property
    def kept_bytes(self) -> int:
        """Bytes of the gradients kept for W (each storage once; the saved activations, kept too, are not counted);
        0 once computed."""
        storages = {
            grad.untyped_storage().data_ptr(): grad.untyped_storage().nbytes()
            for group in self._groups or ()
            for _, grad_outputs in group.seeds
            for grad in grad_outputs
            if grad is not None
        }
        return sum(storages.values())

    def _take(self) -> list["_Group"]:
        """The groups, once (the graph is freed after them)."""
        groups, self._groups = self._groups, None
        if groups is None:
            raise RuntimeError("This weight gradient was already computed.")
        return groups


def run_together(weights: Sequence[DeferredWeightGradient], before_last: Callable[[], None] | None = None) -> None:
    """Run several micro-batches' deferred W, each plain linear layer's as one matrix product over their rows.

    Adds the same gradients to ``.grad`` as calling each of ``weights`` in turn (up to the order of the sums'
    rounding), through the parameters' own ``AccumulateGrad``. See the module docstring for which layers qualify;
    the others run one micro-batch at a time.

    Args:
        weights: the micro-batches' W, in the order of their B.
        before_last: called before the autograd calls that give each parameter its last gradient of the call
            (the last micro-batch's W of the layers that do not qualify, the products of those that do), so that
            from then on each parameter's hooks fire once (a data-parallel reducer is announced there).

    Raises:
        RuntimeError: if one of ``weights`` was already computed.
    """
    per_micro_batch = [weight._take() for weight in weights]
    linears = [
        {key: group for group in groups if (key := _linear_key(group)) is not None} for groups in per_micro_batch
    ]
    common = set.intersection(*(set(found) for found in linears)) if len(weights) > 1 else set()
    alone = []  # per micro-batch, the groups that do not join a product
    for groups, found in zip(per_micro_batch, linears):
        fused = {id(found[key]) for key in common}
        alone.append([group for group in groups if id(group) not in fused])
    for groups in alone[:-1]:
        for group in groups:
            group.run()
    if before_last is not None:
        before_last()
    for group in alone[-1]:
        group.run()
    if common:
        _run_linears({key: [found[key] for found in linears] for key in common})


PRODUCTS_IN_FLIGHT = 16 * 2**20
"""Bytes of fused weight gradients :func:`_run_linears` computes before handing them to autograd: up to this many
products wait for one autograd call (one call for a small stage), so that a large stage never holds a second full set
of its parameters' gradients beside ``.grad``."""


def _run_linears(layers: dict[tuple[Node, Node | None], list["_Group"]]) -> None:
    """Each linear layer's W (by ``(weight, bias)``, its groups, one per micro-batch, see :func:`_linear_key`) as one
    product over their rows (:func:`_products`), added to ``.grad`` by an autograd call once at least
    :data:`PRODUCTS_IN_FLIGHT` bytes of products wait (each call exceeds it by less than one layer's), and at the
    end."""
    params: list[Tensor] = []
    grads: list[Tensor] = []
    waiting = 0  # bytes of grads
    for (weight, bias), groups in layers.items():
        products = _products(groups, bias is not None)
        params += [node.variable for node in (weight, bias) if node is not None]  # type: ignore[attr-defined]
        grads += products
        waiting += sum(product.nbytes for product in products)
        if waiting >= PRODUCTS_IN_FLIGHT:
            torch.autograd.backward(params, grads)
            params, grads, waiting = [], [], 0
    if params:
        torch.autograd.backward(params, grads)


@torch.no_grad()
def _products(groups: list["_Group"], with_bias: bool) -> list[Tensor]:
    """One linear layer's weight gradient (and its bias's, ``with_bias``) over the stacked rows of its ``groups``, as
    values, not graphs: the stacked rows are freed once the product is computed."""
    rows = [_linear_rows(group) for group in groups]
    gradient, inputs = torch.cat([g for g, _ in rows]), torch.cat([x for _, x in rows])
    return [gradient.t().mm(inputs), *([gradient.sum(0)] if with_bias else [])]


def backward_input(
    outputs: Sequence[Tensor], grads: Sequence[Tensor], inputs: Sequence[Tensor]
) -> DeferredWeightGradient:
    """B: backpropagate ``grads`` from ``outputs`` to ``inputs`` only (added to their ``.grad``); defer W.

    Args:
        outputs: tensors of this micro-batch's forward that carry its output gradient.
        grads: one gradient per output, of its shape.
        inputs: leaves of the forward that require grad (the stage's micro-batch input).

    Returns:
        The deferred W: call it to add the parameters' gradients to their ``.grad``.
    """
    graph = _Graph([o.grad_fn for o in outputs], {_node(x) for x in inputs})
    kept: dict[Node, tuple[Tensor | None, ...]] = {}

    def keeper(node: Node):
        def keep(grad_outputs: tuple[Tensor | None, ...]) -> None:
            kept[node] = grad_outputs

        return keep

    handles = [node.register_prehook(keeper(node)) for node in graph.branches]
    try:
        torch.autograd.backward(list(outputs), list(grads), inputs=list(inputs), retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    seeds = [(node, kept.get(node, ())) for node in graph.branches]
    seeds += [(node, _seed(node, outputs, grads)) for node in graph.weight_only_roots]
    return DeferredWeightGradient(_groups(graph, seeds))


class _Graph:
    """The autograd graph below ``roots``: which nodes lead to the inputs, and where parameters branch off.

    Args:
        roots: the outputs' ``grad_fn`` nodes.
        input_nodes: the inputs' ``AccumulateGrad`` nodes.
    """

    def __init__(self, roots: Sequence[Node | None], input_nodes: set[Node]) -> None:
        self.order = _post_order([r for r in roots if r is not None])
        self.to_input: dict[Node, bool] = {}
        self.params: dict[Node, frozenset[Node]] = {}  # the parameters' AccumulateGrad nodes below each node
        for node in self.order:  # children first
            children = _children(node)
            self.to_input[node] = node in input_nodes or any(self.to_input[c] for c in children)
            leaf = hasattr(node, "variable") and node not in input_nodes
            self.params[node] = frozenset({node} if leaf else ()).union(*(self.params[c] for c in children))
        self.branches = [n for n in self.order if self.to_input[n] and self._weight_side(n)]
        roots_seen = {r for r in roots if r is not None}
        self.weight_only_roots = [r for r in roots_seen if not self.to_input[r] and self.params[r]]

    def _weight_side(self, node: Node) -> frozenset[Node]:
        """Parameters reached from ``node`` through children that do not lead to the inputs."""
        return frozenset().union(*(self.params[c] for c in _children(node) if not self.to_input[c]))

    def weight_params(self, node: Node) -> frozenset[Node]:
        """The parameters a W seed at ``node`` reaches: its weight side, or all below a weight-only root."""
        return self._weight_side(node) if self.to_input[node] else self.params[node]


class _Group:
    """Seeds (node, gradients) that share parameters: one autograd call computes their weight gradients."""

    def __init__(self) -> None:
        self.seeds: list[tuple[Node, tuple[Tensor | None, ...]]] = []
        self.params: set[Node] = set()

    def run(self) -> None:
        edges, grads = [], []
        for node, grad_outputs in self.seeds:
            for index, grad in enumerate(grad_outputs):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    grads.append(grad)
        if not edges:
            return
        pins = [node.register_prehook(_pinned(g)) for node, g in self.seeds] if len(self.seeds) > 1 else []
        try:
            # the graph is kept: another group's run may pass through the same nodes (it is freed with the outputs)
            variables = [p.variable for p in self.params]  # type: ignore[attr-defined]  # not in torch's stubs
            torch.autograd.backward(edges, grads, inputs=variables, retain_graph=True)
        finally:
            for handle in pins:
                handle.remove()


def _linear_key(group: _Group) -> tuple[Node, Node | None] | None:
    """``(weight, bias)`` (their ``AccumulateGrad`` nodes; bias ``None`` without one) if ``group`` is one plain
    linear layer's W (see the module docstring), else ``None``."""
    if len(group.seeds) != 1:
        return None
    node, grad_outputs = group.seeds[0]
    if len(grad_outputs) != 1 or grad_outputs[0] is None or grad_outputs[0].dim() != 2:
        return None
    if node.name() == "AddmmBackward0" and saved(node, "alpha") == 1 and saved(node, "beta") == 1:
        bias, _, transpose = (child for child, _ in node.next_functions)
    elif node.name() == "MmBackward0":
        bias, (_, transpose) = None, (child for child, _ in node.next_functions)
    else:
        return None
    if transpose is None or transpose.name() != "TBackward0":
        return None
    ((weight, _),) = transpose.next_functions
    if not hasattr(weight, "variable") or (bias is not None and getattr(bias, "variable", None) is None):
        return None
    assert weight is not None  # it has a variable
    # a bias of one row for every row, summed over the rows
    if bias is not None and bias.variable.dim() != 1:  # type: ignore[attr-defined]  # not in torch's stubs
        return None
    if group.params != {weight, *([bias] if bias is not None else [])}:
        return None
    return weight, bias


def _linear_rows(group: _Group) -> tuple[Tensor, Tensor]:
    """The output gradient and the input of the linear layer of ``group`` (see :func:`_linear_key`)."""
    node, (gradient,) = group.seeds[0]
    assert gradient is not None  # _linear_key: one output gradient
    return gradient, saved(node, "mat1" if node.name() == "AddmmBackward0" else "self")


def _groups(graph: _Graph, seeds: list[tuple[Node, tuple]]) -> list[_Group]:
    """Seeds joined into groups whose parameter sets are disjoint."""
    groups: list[_Group] = []
    for node, grad_outputs in seeds:
        params = set(graph.weight_params(node))
        joined = [g for g in groups if g.params & params]
        group = _Group()
        for other in joined:
            group.seeds += other.seeds
            group.params |= other.params
            groups.remove(other)
        group.seeds.append((node, grad_outputs))
        group.params |= params
        groups.append(group)
    return groups


def _pinned(grad_outputs: tuple):
    def pin(_: tuple) -> tuple:
        return grad_outputs

    return pin


def _seed(root: Node, outputs: Sequence[Tensor], grads: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """The output gradients arriving at ``root``, by its output index."""
    seed: dict[int, Tensor] = {}
    for output, grad in zip(outputs, grads):
        edge = get_gradient_edge(output)
        if edge.node is root:
            seed[edge.output_nr] = grad + seed[edge.output_nr] if edge.output_nr in seed else grad
    return tuple(seed.get(i) for i in range(max(seed, default=-1) + 1))


def _node(t: Tensor) -> Node:
    """The node that receives ``t``'s gradient: its ``grad_fn``, or a leaf's ``AccumulateGrad``."""
    return get_gradient_edge(t).node


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _post_order(roots: list[Node]) -> list[Node]:
    """Every node reachable from ``roots``, each after all of its children (iterative: graphs can be deep)."""
    order, seen, stack = [], set(), [(root, False) for root in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if child not in seen)
    return order

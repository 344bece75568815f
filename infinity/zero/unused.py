"""Which parameters get a gradient in this backward: the leaves reachable from the loss's autograd graph.

[Note: unused parameters]
Gradient buckets are reduced in a fixed order ([Note: fixed launch order] in reducer.py), so one parameter that
gets no gradient this step (a branch not taken) would hold back every later bucket, and with it every later
bucket's fp32 buffer, until the end of backward. DeepSpeed's ignore_unused_parameters promises a zero gradient
for such parameters. Before backward starts, the engine walks the graph from the loss (as DDP's
find_unused_parameters does): a parameter whose AccumulateGrad node is not reachable gets no gradient, and is
counted as arrived at once (its slot is zero when its bucket is reduced). Ranks may differ in what they use:
each still launches every bucket in the same order, only at different times.
A reentrant activation checkpoint hides its parameters inside one node, so then nothing is marked and buckets
with unused parameters wait for the end of backward, as before.
"""

from __future__ import annotations

import torch

_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"


def reachable_leaves(loss: torch.Tensor) -> set[int] | None:
    """ids of the leaf tensors that will receive a gradient from ``loss.backward()``; None when that cannot be
    known from the graph (a reentrant checkpoint)."""
    uses = last_uses(loss)
    return None if uses is None else set(uses)


def last_uses(loss: torch.Tensor) -> dict[int, int] | None:
    """Per leaf that will receive a gradient (by id), the smallest sequence number of the nodes that pass it one:
    backward runs nodes from the highest sequence number down (the reverse of forward), so the leaf's gradient is
    complete once that node has run; a higher number means sooner in backward. None where the graph hides its
    leaves (a reentrant checkpoint)."""
    root = loss.grad_fn
    if root is None:
        return {}
    uses: dict[int, int] = {}
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        if type(node).__name__ == _REENTRANT_CHECKPOINT:
            return None
        for following, _ in node.next_functions:
            if following is None:
                continue
            variable = getattr(following, "variable", None)  # AccumulateGrad holds its leaf
            if variable is not None:
                number = node._sequence_nr()
                uses[id(variable)] = min(uses.get(id(variable), number), number)
            if following not in seen:
                seen.add(following)
                stack.append(following)
    return uses

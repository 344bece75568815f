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
    root = loss.grad_fn
    if root is None:
        return set()
    leaves: set[int] = set()
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        if type(node).__name__ == _REENTRANT_CHECKPOINT:
            return None
        variable = getattr(node, "variable", None)  # AccumulateGrad holds its leaf
        if variable is not None:
            leaves.add(id(variable))
        for following, _ in node.next_functions:
            if following is not None and following not in seen:
                seen.add(following)
                stack.append(following)
    return leaves

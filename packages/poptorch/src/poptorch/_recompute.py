"""Recomputation (``_Popart.set("autoRecomputation", 3 or 4)``): the backward pass recomputes the forward
activations it reads instead of keeping them alive from the forward pass, trading cycles for tile memory.

Kept (read by the backward pass as they are): graph inputs, parameters and constants, values marked by
``recomputationCheckpoint`` and, with Pipeline recomputation, the values a stage hands to another stage (the
stage's inputs, which a pipeline stashes). Everything else the backward pass reads is recomputed from those
by copies of the forward ops that run in the backward pass: with Pipeline recomputation once, just before
its first backward reader; with RecomputeAll afresh for every backward reader (PopART recomputes every
forward op that is not a checkpoint), so a recomputed value lives only until its reader has run.
"""

import popir


def apply(graphs, program, mode):
    """Recompute in training program ``program`` of ``graphs`` ({name: popir.Graph}) under ``mode``
    ("pipeline" or "all"); "none" leaves the graphs alone."""
    if mode != "none" and program in graphs:
        pipeline = mode == "pipeline"
        graphs[program] = recompute(graphs[program], by_stage=pipeline, per_reader=not pipeline)


def recompute(graph, by_stage, per_reader=False):
    """A copy of ``graph`` whose backward nodes read recomputed forward values (see the module docstring).
    With ``per_reader`` (RecomputeAll) each backward node recomputes what it reads afresh from the kept
    values, so no recomputed value outlives its reader: the least tile memory, at the cost of recomputing a
    chain once per reader (checkpoints keep the chains short)."""
    kept = _kept_values(graph, by_stage)
    new = popir.Graph(graph.name)
    values = {v.id: new.add_input(v.name, v.shape, v.dtype, v.kind) for v in graph.inputs}
    recomputed = {}

    def emit(node, inputs, role):
        with new.annotate(**{**node.annotations(), "role": role}):
            return new.apply(node.op, inputs, node.attrs)

    def again(value):
        """``value`` for a backward reader: the forward one if kept, else its recomputed copy."""
        pending = [value]
        while pending:
            v = pending[-1]
            if v.id in kept or v.id in recomputed:
                pending.pop()
                continue
            missing = [i for i in v.producer.inputs if i.id not in kept and i.id not in recomputed]
            if missing:
                pending.extend(missing)
                continue
            node = v.producer
            outs = emit(node, [values[i.id] if i.id in kept else recomputed[i.id] for i in node.inputs], "backward")
            recomputed.update((o.id, n) for o, n in zip(node.outputs, outs))
            pending.pop()
        return values[value.id] if value.id in kept else recomputed[value.id]

    for node in graph.nodes:
        backward = node.role == "backward"
        if backward and per_reader:
            recomputed.clear()
        inputs = [again(v) if backward else values[v.id] for v in node.inputs]
        for old, out in zip(node.outputs, emit(node, inputs, node.role)):
            values[old.id] = out
    for name, v in graph.outputs.items():
        new.output(name, values[v.id])
    for state, v in graph.updates.items():
        new.update(values[state.id], values[v.id])
    return new


def _kept_values(graph, by_stage):
    """Ids of the values the backward pass reads as they are."""
    kept = {v.id for v in graph.inputs}
    readers = {}
    for node in graph.nodes:
        if node.role != "forward":
            kept.update(v.id for v in node.outputs)
            continue
        for v in node.inputs:
            readers.setdefault(v.id, []).append(node)
        if node.op == "constant" or node.checkpoint:
            kept.update(v.id for v in node.outputs)
    if by_stage:
        for node in graph.nodes:
            for v in node.outputs:
                if any(_stage(r) != _stage(node) for r in readers.get(v.id, ())):
                    kept.add(v.id)
    return kept


def _stage(node):
    return node.placement[0] if node.placement is not None else None

"""Recomputation (``_Popart.set("autoRecomputation", n)``, popart.RecomputationType 1-4): the backward pass
recomputes some forward activations it reads instead of keeping them alive from the forward pass, trading
cycles for tile memory.

Kept (read by the backward pass as they are): graph inputs, parameters and constants, values marked by
``recomputationCheckpoint``, and per type:

- Standard (1): the outputs of the forward ops PopART's Standard heuristic checkpoints. It walks the forward
  ops in order, noting after each one the set of ops whose outputs a later forward op still reads (the live
  set) and those outputs' bytes; it cuts the ops into intervals of decreasing length (``_decreasing_intervals``)
  and keeps every op of the smallest live set of each interval. The other forward ops are recomputed. As in
  PopART, only the ops on a path to the loss take part: a side branch that does not reach the loss is kept and
  moves no checkpoint.
- NormOnly (2): every forward value except the outputs of normalisation layers (layer, group, batch and
  instance norm), whose outputs are large and cheap to recompute.
- Pipeline (3): every forward value except those computed and read inside one pipeline stage (the values a
  stage hands to another stage, which a pipeline stashes, are kept).
- RecomputeAll (4): nothing else.

Everything else the backward pass reads is recomputed from the kept values by copies of the forward ops that
run in the backward pass: once, just before its first backward reader; with RecomputeAll afresh for every
backward reader (PopART recomputes every forward op that is not a checkpoint), so a recomputed value lives
only until its reader has run.
"""

import math

import popir

# The torch.export ops of the normalisation layers NormOnly recomputes (PopART's ``Op::isNorm``).
NORM_ATEN_OPS = frozenset(
    {
        "native_layer_norm",
        "native_group_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
        "instance_norm",
    }
)
# PopART's Standard heuristic shortens its first interval to 3/4 of the largest K with 1 + 2 + ... + K < N:
# less recomputation for about the same memory (its experiments on ResNet-50).
_STANDARD_INTERVAL_SCALE = 0.75


def apply(graphs, program, mode, loss=None):
    """Recompute in training program ``program`` of ``graphs`` ({name: popir.Graph}) under ``mode``
    ("standard", "norm_only", "pipeline" or "all"); "none" leaves the graphs alone. ``loss`` names the
    program's output holding the final loss, if the model returns it."""
    if mode != "none" and program in graphs:
        graph = graphs[program]
        graphs[program] = recompute(graph, _kept_values(graph, mode, loss), per_reader=mode == "all")


def recompute(graph, kept, per_reader=False):
    """A copy of ``graph`` whose backward nodes read recomputed copies of the forward values not in ``kept``
    (value ids; see the module docstring). With ``per_reader`` (RecomputeAll) each backward node recomputes
    what it reads afresh from the kept values, so no recomputed value outlives its reader: the least tile
    memory, at the cost of recomputing a chain once per reader (checkpoints keep the chains short)."""
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


def _kept_values(graph, mode, loss=None):
    """Ids of the values the backward pass reads as they are under recomputation ``mode`` (``loss``: the
    output holding the final loss, or None)."""
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
    forward = [n for n in graph.nodes if n.role == "forward"]
    if mode == "pipeline":
        for node in forward:
            for v in node.outputs:
                if any(_stage(r) != _stage(node) for r in readers.get(v.id, ())):
                    kept.add(v.id)
    elif mode == "norm_only":
        kept.update(v.id for node in forward if not _is_norm(node) for v in node.outputs)
    elif mode == "standard":
        to_loss = _to_loss(graph, loss)
        ops = [n for n in forward if n.op != "constant" and id(n) in to_loss]  # constants are tensors in PopART
        kept.update(v.id for node in forward if id(node) not in to_loss for v in node.outputs)
        kept.update(v.id for node in _standard_checkpoints(ops) for v in node.outputs)
    return kept


def _to_loss(graph, loss):
    """ids of the forward nodes on a path to the loss: those the ``loss`` output (if any) or a value some
    backward node reads depends on (a VJP reads only values of its op, which is on such a path; the loss's
    last ops that no VJP reads are dead code unless the loss is an output)."""
    needed = {graph.outputs[loss].id} if loss is not None else set()
    on_path = set()
    for node in reversed(graph.nodes):
        if node.role == "backward":
            needed.update(v.id for v in node.inputs)
        elif node.role == "forward" and any(v.id in needed for v in node.outputs):
            on_path.add(id(node))
            needed.update(v.id for v in node.inputs)
    return on_path


def _is_norm(node):
    """Whether forward ``node`` belongs to a normalisation layer (by its torch.export op, ``aten.NAME.OVERLOAD``)."""
    parts = (node.aten or "").split(".")
    return len(parts) > 1 and parts[1] in NORM_ATEN_OPS


def _standard_checkpoints(forward):
    """The nodes among ``forward`` (the forward nodes in program order) whose outputs PopART's Standard
    heuristic keeps: each interval's live set of fewest bytes (see the module docstring). A node stays live
    until its last forward reader has run; one that no forward node reads stays live to the end."""
    position = {id(n): i for i, n in enumerate(forward)}
    waits_on = [{id(v.producer): v.producer for v in n.inputs if id(v.producer) in position} for n in forward]
    pending = {}  # id(node) -> forward nodes that still have to read its outputs
    for producers in waits_on:
        for key in producers:
            pending[key] = pending.get(key, 0) + 1
    live, live_sets, live_bytes = {}, [], []
    for node, producers in zip(forward, waits_on):
        for key in producers:
            pending[key] -= 1
            if not pending[key]:
                del live[key]
        live[id(node)] = node
        live_sets.append(list(live.values()))
        live_bytes.append(sum(v.type.nbytes for n in live.values() for v in n.outputs))
    checkpoints = {}
    for begin, end in _decreasing_intervals(len(forward)):
        best = min(range(begin, end), key=live_bytes.__getitem__)
        checkpoints.update((id(n), n) for n in live_sets[best])
    return list(checkpoints.values())


def _decreasing_intervals(n):
    """[begin, end) intervals covering range(n): lengths K, K - 1, ..., 1 from the start (K from
    ``_STANDARD_INTERVAL_SCALE``), then intervals of one."""
    if n == 1:
        return [(0, 1)]
    size = int((int(math.sqrt(2 * n)) - 1) * _STANDARD_INTERVAL_SCALE) if n else 0
    intervals, begin = [], 0
    while size > 0 and begin + size <= n:
        intervals.append((begin, begin + size))
        begin, size = begin + size, size - 1
    return intervals + [(i, i + 1) for i in range(begin, n)]


def _stage(node):
    return node.placement[0] if node.placement is not None else None

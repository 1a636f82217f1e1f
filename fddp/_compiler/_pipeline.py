"""From a step to a runnable program: capture, the passes, then the ranks compare the result."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fddp._base._errors import ScheduleMismatchError
from fddp._compiler import _backend, _plan
from fddp._compiler._cache import _persistent
from fddp._compiler._capture._trace import Captured, capture
from fddp._compiler._options import CompileOptions
from fddp._compiler._passes import (
    _across_steps,
    _bucket,
    _cost,
    _gate,
    _identity,
    _overlap,
    _param_gathers,
    _reinplace,
    _rematerialize,
    _replication,
)
from fddp._compiler._program import Compiled, Program, collector_paused
from fddp._ranks import _machine, _runtime
from fddp._ranks._agree import Line, digest, find_difference, raise_everywhere
from fddp._ranks._machine import Machine


def schedule_graph(
    captured: Captured,
    options: CompileOptions,
    donated: set[int],
    machine: Machine | None = None,
    agreed_cap: int | None = None,
) -> Program:
    """Bucket, overlap and reinplace the captured graph, then build its runner.

    ``donated`` holds the indices (into the step's flat tensor arguments) whose storage the
    program may overwrite; ``machine``, the measurements the default bucket cap is chosen from
    (None in a world of one: a sixteenth of the gradient bytes).
    """
    gm = captured.graph
    assert gm is not None  # a capture, not a loaded program
    graph = gm.graph
    _param_gathers.drop_unused_collectives(graph)
    # Inductor draws random numbers its own way: there a random op's output is kept instead
    remat = _rematerialize.rematerialise(graph, options.remat, replay_rng=options.backend == "fx")
    output_dependencies, rank_bit = _replication.dependencies(graph)
    _overlap.hoist_gradient_sums(graph)
    members = _bucket.find_members(graph)
    profile = _cost.profile(graph, members)
    cap = _cost.choose_cap(profile, options.cap, machine, agreed_cap)
    buckets = _bucket.assign(members, cap.cap, options.cap.first)
    in_place = options.in_place
    bucket_nodes = _bucket.rewrite(graph, buckets, options.comm_dtype, functional=not in_place)
    if in_place:
        _bucket.pack_concatenations_in_place(graph)
    _overlap.overlap(graph)
    _param_gathers.place(graph)
    across_steps = None
    gate = _gate.insert(graph) if in_place else None  # Inductor cannot compile a Python call
    if in_place:
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        is_donated = [isinstance(s, int) and s in donated for s in captured.inputs]
        if options.overlap_steps:
            gm.recompile()
            across_steps = _across_steps.AcrossSteps(gm, is_donated)
            across_steps = across_steps if across_steps.active else None
        # a donated argument is written only after the gate: a call that the ranks' agreement
        # refuses leaves it as it was
        donated_nodes = {n for n, d in zip(placeholders, is_donated) if d}
        _reinplace.reinplace(graph, donated_nodes, donated_writable_after=gate)
    graph.lint()
    gm.recompile()  # the captured module is lazy (see _capture): this only marks it stale
    code = graph.python_code(root_module="self")
    plan = _plan.describe(graph, bucket_nodes, captured.seconds, captured.method)
    plan = dataclasses.replace(plan, bucket_cap=str(cap) if members else "", remat=remat)
    runner, generated = _backend.build(gm, options.backend, code)
    sequence = _plan.collective_sequence(graph)
    return Program(
        lambda: gm,
        plan,
        sequence,
        runner,
        output_dependencies,
        rank_bit,
        profile,
        cap.cap,
        across_steps,
        gate is not None,
        generated,
    )


def compile_step(
    step_fn: Callable[..., Any],
    args: tuple,
    tensors: list[torch.Tensor],
    options: CompileOptions,
    donated: set[int],
    group: dist.ProcessGroup | None,
    name: str,
    *,
    kept_as: _persistent.Identity | None = None,
    method: str = "make_fx",
) -> Compiled:
    """Capture ``step_fn(*args)`` and schedule it, or load the program scheduled from the same
    capture from the persistent cache, then compare the outcome across ranks (every rank of
    ``group`` at once).

    Where the cost model chooses the bucket cap on several ranks, the link is measured on the
    group's first compile, and every compile takes the cap rank 0 proposes (a broadcast:
    ``_persistent.agreed_cap``, after the ranks agree that every capture succeeded).
    ``kept_as``: what the step's programs are kept under in the persistent cache
    (``fddp.set_cache_dir``), beside the captured program; None: they are not kept. A program
    found there is loaded instead of scheduled; one scheduled is written there after its first
    run.

    ``method`` is how this step was captured before (see ``capture``). The ranks compare what
    they compiled (a collective): a capture error on one rank is raised on every rank
    (``_agree.raise_everywhere``: the others raise it as that rank's), ranks that compiled
    different collective sequences raise instead of running them into a hang, and then the
    captured programs are compared whole (``_identity.program_lines``: every node, every
    constant by value; what a sharded layout or the rank makes per rank is named so).
    """
    device = _runtime.step_device(tensors)
    machine = None  # measured before a capture error can split the ranks
    if options.cap.measures(_runtime.world_size(group)):
        machine = _machine.measured(group, device)
    error: Exception | None = None
    compiled: Compiled | None = None
    identity: list[Line] = []  # the captured program's, before the passes rewrite it
    try:
        with collector_paused():  # a capture and its passes allocate millions of objects
            if options.remat is not None:  # the model's repeated blocks become regions
                step_fn = _rematerialize.marking_blocks(step_fn)
            captured, dynamo = capture(
                step_fn, args, tensors, fused_backward=options.in_place, method=method
            )
            assert captured.graph is not None  # the passes below rewrite it in place
            held = _identity.held_tensors(captured.graph, captured.inputs)
            identity = _identity.program_lines(captured.graph, captured.inputs, held)
    except Exception as e:  # every rank must learn about it before anyone runs a collective
        error = e
    key = agreed_cap = None
    if kept_as is not None:
        if machine is not None:  # rank 0 proposes the cap from its key: a broadcast to follow
            raise_everywhere(error, group)
        key = None if error else _persistent.key_for(kept_as, captured, donated, group)
        agreed_cap = _persistent.agreed_cap(key, options, machine, device, group)
    try:
        if error is None:
            with collector_paused():
                program = None
                if key is not None:
                    program = _persistent.load(key, captured, options, machine, agreed_cap)
                loaded = program is not None
                if program is None:
                    program = schedule_graph(captured, options, donated, machine, agreed_cap)
                program.known_graph_digest = digest(identity)
                compiled = Compiled(program, captured, dynamo, from_cache=loaded, held=held)
                if key is not None and not loaded:
                    compiled.after_first_run = functools.partial(_persistent.save, key)
    except Exception as e:
        error = e
    sequence = compiled.program.sequence if compiled else []
    lines = [(f"collective #{i}", s) for i, s in enumerate(sequence)]
    difference = raise_everywhere(error, group, lines)
    assert compiled is not None
    if difference is None:
        # compared once the sequences agree, so that a missing collective is named as one
        program_digest = [("the captured program", f"{compiled.program.graph_digest():014x}")]
        difference = find_difference(program_digest, group)
        if difference is not None:
            difference = find_difference(identity or program_digest, group) or difference
    if difference is None:
        return compiled
    if difference.label.startswith("node ") or difference.label == "the captured program":
        raise ScheduleMismatchError(
            f"{name}: ranks compiled different programs: {difference}: every rank must build "
            "the step with the same settings (optimizer hyperparameters, constants and "
            "modules the step closes over). A value meant to differ per rank comes from "
            "fddp.axis_index() or from the batch."
        )
    raise ScheduleMismatchError(
        f"{name}: ranks compiled different collective sequences: {difference}. The step must "
        "issue the same collectives with the same shapes on every rank: check that every rank "
        "passes batches of the same shape and that no branch depends on the rank."
    )

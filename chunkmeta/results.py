"""A step build's result objects, from one recipe per layout, made in C or in Python.

``StepTablesBuilder.build`` returns a new frozen ``StepTables`` every build (its generation is
the liveness check, and FLA memoizes by tensor identity). Its tables are views of the slot's
arena at fixed offsets, sized by the plan's per-entry counts and host facts, and host ints from
the same plan. A *recipe* says, once per builder and layout, where every field of every object
comes from; an executor makes the objects of one build from it: ``chunkmeta.native``'s
``results`` (one C call, the objects' slots set directly: the per-build object making is most
of a step build's host time in Python), or ``python_results`` (the same recipe, where the
extension does not load). Both read views from one cache, the ring's ``views``, keyed
``(slot, region, count, shape)``; on a miss the Python one calls the ring's ``make_view``, the C
one slices the ring's ``view_base`` as ``make_view`` does (``ROW`` views: ``make_view``). The C
one first looks at each field's memo of the view it got last in that slot: a slot that sees the
count it saw last time (a repeated step) costs a compare, not a key and a lookup.

A recipe is ``(outputs, top)``: ``outputs`` a tuple of ``(name, cls, fields)``, ``top`` the
``StepTables``' ``(cls, fields)``; ``fields`` one tuple per attrs field of ``cls``, in order:

* ``(CONST, value)``;
* ``(ITEM, source, index)``: ``source[index]`` of the build (``COUNTS``: the per-entry counts;
  ``FACTS``: the host facts, ``chunkmeta.step_builder.StepFacts``'s order);
* ``(VIEW, region, shape, fresh, source, index, add, when)``: the view of ``count`` entries of
  ``region`` (an arena offset, or a host buffer's name) of the build's slot, ``count =
  source[index] + add`` (``source`` ``FIXED``: ``add`` itself), shaped ``FLAT`` ``[n]``,
  ``PAIRS`` ``[n, 2]`` or ``ROW`` ``[1, n]``; a new object over it (``.data``) with ``fresh``; None
  where ``when`` is a facts index whose fact is false (``ALWAYS``: never None);
* ``(GENERATION,)``, ``(LEASE,)``, ``(SLOT,)``: the build's; ``(TABLES,)``: the outputs by name
  (``top`` only), also the top object's instance ``__dict__`` (``StepTables.__attrs_post_init__``
  makes it so; the C executor, which sets slots directly, does the same).
"""

from __future__ import annotations

import functools

import attrs

from chunkmeta import tables as _tables
from chunkmeta.metadata import ChunkMetadata, ConvBlocks, Mamba2Chunks, SglangMamba2Chunks, StepTables

CONST, ITEM, VIEW, GENERATION, LEASE, SLOT, TABLES = range(7)
COUNTS, FACTS, FIXED = range(3)
FLAT, PAIRS, ROW = range(3)
ALWAYS = -1

# StepFacts' fields by index (chunkmeta.step_builder.StepFacts, the C step's facts tuple)
_NUM_SEQS, _NUM_TOKENS, _MAX_SEQLEN, _BATCH_SEQS, _BATCH_TOKENS, _BATCH_MAX, _PREP, _ANY_CHECKPOINT = range(1, 9)


def step_recipe(
    specs: dict, layout: _tables.SlotLayout, padded: bool, fla_seqs_pad: int, pad: str, seqs: int, single=False
):
    """The recipe of a step builder's results (``specs`` and ``layout`` its own; ``padded``: the
    capacity-shaped layout, FLA tables with ``fla_seqs_pad`` sequences and ``pad`` rows, the
    other per-sequence tables with ``seqs``, the builder's capacity). ``single``: the one
    table's object is the top one (no outputs, no ``StepTables``)."""

    def count(index, add=0, fixed=None):  # a count from the plan's entry counts, or fixed when padded
        return (FIXED, 0, fixed + add) if padded else (COUNTS, index, add)

    def fact(index, add=0, fixed=None):
        return (FIXED, 0, fixed + add) if padded else (FACTS, index, add)

    def view(region, shape, sized, fresh=False, when=ALWAYS):
        return (VIEW, region, shape, fresh, *sized, when)

    outputs = []
    for name, spec in specs.items():
        index = layout.owners.index(name)
        at = [region.offset for region in layout.regions[name].values()]
        rows = layout.rows_pad[index]
        if isinstance(spec, _tables.Fla):
            batch = spec.rows == "batch"
            seqs_out = fact(_BATCH_SEQS if batch else _NUM_SEQS, 1, fla_seqs_pad)
            cls, fields = (
                ChunkMetadata,
                [
                    # new objects unless asked not to: FLA memoizes by identity
                    view(at[0], FLAT, seqs_out, fresh=spec.fresh_cu_seqlens),
                    view(name, FLAT, seqs_out, fresh=spec.fresh_cu_seqlens),
                    view(at[1], PAIRS, count(index, 0, rows)),
                    view(at[2], FLAT, seqs_out),
                    (CONST, spec.chunk_size),
                    (ITEM, FACTS, _BATCH_SEQS if batch else _NUM_SEQS),
                    (ITEM, FACTS, _BATCH_TOKENS if batch else _NUM_TOKENS),
                    (ITEM, COUNTS, index),
                    (ITEM, FACTS, _BATCH_MAX if batch else _MAX_SEQLEN),
                    (CONST, pad if padded else None),
                    (GENERATION,),
                    (LEASE,),
                    (SLOT,),
                ],
            )
        elif isinstance(spec, _tables.Conv):
            sized, none = count(index, 0, rows), (CONST, None)
            if spec.paired:  # SGLang's [tot, 2] block table
                batch_ptr, token_chunk_offset_ptr, block_table = none, none, view(at[0], PAIRS, sized)
            else:  # vLLM's two tables
                batch_ptr, token_chunk_offset_ptr = view(at[0], FLAT, sized), view(at[1], FLAT, sized)
                block_table = none
            cls, fields = (
                ConvBlocks,
                [
                    batch_ptr,
                    token_chunk_offset_ptr,
                    block_table,
                    (ITEM, COUNTS, index),
                    (CONST, spec.block_m),
                    (ITEM, FACTS, _BATCH_SEQS if spec.rows == "batch" else _NUM_SEQS),
                ],
            )
        elif isinstance(spec, _tables.Mamba2):
            per_seq = fact(_NUM_SEQS, 0, seqs)
            checkpoint = view(at[3], FLAT, per_seq, when=_ANY_CHECKPOINT) if spec.checkpoints else (CONST, None)
            cls, fields = (
                Mamba2Chunks,
                [
                    view(at[0], FLAT, count(index, 1, rows)),
                    view(at[1], FLAT, count(index, 0, rows)),
                    view(at[2], FLAT, per_seq),
                    checkpoint,
                    (CONST, spec.chunk_size),
                    (ITEM, COUNTS, index),
                    (ITEM, FACTS, _NUM_SEQS),
                    (ITEM, FACTS, _PREP),
                ],
            )
        else:  # SglangMamba2: a token entry, then the logical chunks' entry
            logical = count(index + 1, 0, layout.rows_pad[index + 1])
            cls, fields = (
                SglangMamba2Chunks,
                [
                    view(at[0], ROW, fact(_NUM_TOKENS, 0, rows)),
                    view(at[1], FLAT, logical),
                    view(at[2], FLAT, logical),
                    view(at[3], FLAT, fact(_NUM_SEQS, 0, seqs)),
                    (CONST, spec.chunk_size),
                    (ITEM, COUNTS, index + 1),
                    (ITEM, FACTS, _NUM_SEQS),
                    (ITEM, FACTS, _NUM_TOKENS),
                    (ITEM, FACTS, _PREP),
                ],
            )
        outputs.append((name, cls, _check_fields(cls, fields)))
    if single:
        ((_, cls, fields),) = outputs
        return (), (cls, fields)
    top_fields = [
        (TABLES,),
        (CONST, padded),
        (GENERATION,),
        (LEASE,),
        (SLOT,),
        (ITEM, FACTS, _NUM_SEQS),
        (ITEM, FACTS, _NUM_TOKENS),
    ]
    top = (StepTables, _check_fields(StepTables, top_fields))
    return tuple(outputs), top


def _check_fields(cls, fields) -> tuple:
    # a recipe sets slots positionally: one field per attrs field, no more, no fewer
    assert len(fields) == len(attrs.fields(cls)), (cls, len(fields))
    return tuple(fields)


def results_maker(recipe, ring, lease, module):
    """``(slot, generation, counts, facts) -> StepTables`` for ``recipe`` over ``ring``'s views
    (a ``chunkmeta.ring.TableRing``): the C executor of ``module`` (``chunkmeta.native.module()``),
    which makes a missing view from the ring's ``view_base`` itself, or ``python_results`` where
    it is None."""
    if module is not None:
        outputs, (top_cls, top_fields) = recipe
        compiled = module.make_results(
            tuple((name, cls, _descriptors(cls), fields) for name, cls, fields in outputs),
            (top_cls, _descriptors(top_cls), top_fields),
            ring.views,
            ring.make_view,
            ring.view_base,
            ring.depth,
            ring.view_limit,
            lease,
        )
        return functools.partial(module.results, compiled)  # no Python frame per build
    return python_results(recipe, ring.views, ring.make_view, lease)


def _descriptors(cls) -> tuple:
    """The slot descriptors of ``cls``'s attrs fields, in order (C sets them as
    ``object.__setattr__`` would: the classes are frozen)."""
    return tuple(getattr(cls, field.name) for field in attrs.fields(cls))


def python_results(recipe, views: dict, make_view, lease):
    """The executor in Python: the same objects as the C one, through the classes' constructors."""
    outputs, (top_cls, top_fields) = recipe

    def results(slot, generation, counts, facts):
        sources = (counts, facts)

        def value(field, tables=None):
            op = field[0]
            if op == CONST:
                return field[1]
            if op == ITEM:
                return sources[field[1]][field[2]]
            if op == VIEW:
                _, region, shape, fresh, source, index, add, when = field
                if when != ALWAYS and not facts[when]:
                    return None
                count = add if source == FIXED else sources[source][index] + add
                key = (slot, region, count, shape)
                made = views.get(key)
                if made is None:
                    made = make_view(slot, region, count, shape)
                return made.data if fresh else made  # a new object, as the C executor's
            return {GENERATION: generation, LEASE: lease, SLOT: slot, TABLES: tables}[op]

        tables = {name: cls(*[value(field) for field in fields]) for name, cls, fields in outputs}
        return top_cls(*[value(field, tables) for field in top_fields])

    return results

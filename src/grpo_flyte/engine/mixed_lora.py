"""This module computes a batch whose rows use different LoRA adapters in two matmuls per LoRA layer.

PEFT's mixed adapter batches (the forward's `adapter_names=`, one name per row) run each LoRA
layer once per adapter on that adapter's rows: an index, two small matmuls, a scale and a scatter,
per adapter, per layer, per decode step, which made a mixed batch on a CPU cost clearly more than
a batch of as many rows on one adapter (docs/measurements.md#sweeps-on-one-warm-pool-issue-39-2026-11-26).

`install(model)` gives each plain LoRA `Linear` of a PEFT model another way: the batch's adapters'
A matrices stacked, so one matmul gives every row every adapter's low-rank projection; a 0/1
selection keeps each row's own adapter's columns; one matmul through the stacked B matrices (each
scaled by its adapter's `lora_alpha / r`) gives each row its delta. Per row this is PEFT's sum: the
other adapters' columns are exact zeros. A layer with a LoRA variant (DoRA), a bias on B or
dropout in training keeps PEFT's own path.

Both caches are bounded: each layer keeps the stacked weights of its last `STACKS_PER_LAYER`
adapter sets (`forget` drops them when the engine loads or deletes an adapter), and the selections
of the last `SELECTIONS` batches of names. Heavy imports are inside the functions.
"""

from __future__ import annotations

from collections import OrderedDict

STACKS_PER_LAYER = 2
SELECTIONS = 8
NO_ADAPTER = "__base__"  # PEFT's name for a row without an adapter

_selections: OrderedDict[tuple, object] = OrderedDict()


def stacked(a_weights: list, b_weights: list, scalings: list[float]):
    """(A, B): the adapters' A matrices (r_k x in) stacked by rows, and their B matrices (out x r_k),
    each times its scaling, side by side, so `x @ A.T` holds every adapter's projection and
    `h @ B.T` sums the deltas of the columns `h` keeps."""
    import torch

    return torch.cat(a_weights, 0), torch.cat([b * s for b, s in zip(b_weights, scalings, strict=True)], 1)


def selection(names: tuple[str, ...], order: tuple[str, ...], ranks: tuple[int, ...], like):
    """(rows, 1, sum(ranks)): 1 where a row's adapter owns the column (its `order` slot's `ranks`
    span), 0 elsewhere and on rows of no adapter; `like`'s dtype and device."""
    import torch

    key = (names, order, ranks, like.dtype, like.device)
    if (found := _selections.get(key)) is not None:
        _selections.move_to_end(key)
        return found
    starts, total = {}, 0
    for name, rank in zip(order, ranks, strict=True):
        starts[name] = (total, total + rank)
        total += rank
    select = torch.zeros(len(names), 1, total, dtype=like.dtype, device=like.device)
    for row, name in enumerate(names):
        if name in starts:
            begin, end = starts[name]
            select[row, 0, begin:end] = 1
    _selections[key] = select
    while len(_selections) > SELECTIONS:
        _selections.popitem(last=False)
    return select


def mixed_delta(x, a, b, select):
    """Each row's LoRA delta: `((x @ A.T) * select) @ B.T`, with `select` broadcast over x's
    middle dimensions (the sequence)."""
    h = x @ a.T
    h = h * select.reshape(select.shape[0], *([1] * (x.dim() - 2)), select.shape[-1])
    return h @ b.T


def _plain(layer, order: tuple[str, ...]) -> bool:
    """Whether every adapter of `order` is plain LoRA on `layer`: loaded, no variant, no bias on B,
    not training (dropout would draw)."""
    return not layer.training and all(
        name in layer.lora_A and name not in layer.lora_variant and layer.lora_B[name].bias is None for name in order
    )


def _stack(layer, order: tuple[str, ...]):
    stacks: OrderedDict = layer.__dict__.setdefault("_grpo_flyte_stacks", OrderedDict())
    if (found := stacks.get(order)) is None:
        found = stacked([layer.lora_A[n].weight for n in order], [layer.lora_B[n].weight for n in order], [layer.scaling[n] for n in order])
        stacks[order] = found
        while len(stacks) > STACKS_PER_LAYER:
            stacks.popitem(last=False)
    return found


def _mixed_batch_forward(layer, x, *args, adapter_names: list[str], **kwargs):
    """The LoRA `Linear`'s forward for a batch of several adapters (`adapter_names`, one per row)."""
    from peft.tuners.lora.layer import VARIANT_KWARG_KEYS

    order = tuple(name for name in dict.fromkeys(adapter_names) if name != NO_ADAPTER)
    if not order or not _plain(layer, order):
        return type(layer)._mixed_batch_forward(layer, x, *args, adapter_names=adapter_names, **kwargs)
    for key in VARIANT_KWARG_KEYS:  # for LoRA variants only, not the base layer's
        kwargs.pop(key, None)
    result = layer.base_layer(x, *args, **kwargs)
    a, b = _stack(layer, order)
    ranks = tuple(layer.r[name] for name in order)
    select = selection(tuple(adapter_names), order, ranks, a)
    return result + mixed_delta(x.to(a.dtype), a, b, select).to(result.dtype)


def lora_linears(model) -> list:
    """`model`'s PEFT LoRA `Linear` layers."""
    from peft.tuners.lora.layer import Linear

    return [module for module in model.modules() if isinstance(module, Linear)]


def install(model) -> int:
    """Give every LoRA `Linear` of the PEFT `model` the stacked mixed-batch forward; returns how
    many layers have it. Call again after loading an adapter that adds layers (idempotent)."""
    import types

    layers = lora_linears(model)
    for layer in layers:
        layer._mixed_batch_forward = types.MethodType(_mixed_batch_forward, layer)
        layer.__dict__.pop("_grpo_flyte_stacks", None)  # what `forget` drops, in the same walk
    _selections.clear()
    return len(layers)


def forget(model) -> None:
    """Drop the stacked weights every layer keeps (an adapter was loaded or deleted)."""
    for layer in lora_linears(model):
        layer.__dict__.pop("_grpo_flyte_stacks", None)
    _selections.clear()

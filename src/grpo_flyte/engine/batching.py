"""This module batches a replica's generation: concurrent groups meet in one
`flyte.extras.DynamicBatcher` and decode in as few engine batches as their settings allow.

Concurrent `generate` calls on one replica (local mode, or a reusable pool with `concurrency > 1`)
land in one engine batch, even when their adapters differ (a sweep's configs, a pipelined run's
versions; each row with its own adapter: PEFT's mixed adapter batches on transformers, a
LoRARequest per prompt on vLLM). Every row draws from its own random stream seeded by (request
seed, row), so a completion does not depend on its batch mates, and a batch's failure reaches every
group in it (a batch of several adapters is decoded again one adapter at a time, so a damaged one
fails alone). Identical groups are decoded once (`identical_calls`: the same request with adapters
of the same content, e.g. a sweep's configs before their first train step), each caller getting its
own copy. The engines themselves come from `cache.engine_call`, on the torch thread (an engine that
died is dropped there and its batch's calls fail retriably).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from async_lru import alru_cache
from flyte.extras import DynamicBatcher

from grpo_flyte.engine import cache
from grpo_flyte.engine.cache import EngineKey
from grpo_flyte.engine.interface import SamplingRequest
from grpo_flyte.runtime.device import best_device
from grpo_flyte.runtime.files import files_of
from grpo_flyte.runtime.torch_thread import run_on_torch_thread, until_idle
from grpo_flyte.types import OPTIMIZER_FILE, STATE_FILE, Rollout

logger = logging.getLogger(__name__)
T = TypeVar("T")
TRAINER_FILES = frozenset({OPTIMIZER_FILE, STATE_FILE})  # in an adapter's folder, for the trainer only

# How long the batcher waits for more groups once one arrived (the groups of one iteration arrive
# within milliseconds of each other), and the most completion rows one engine batch decodes.
BATCH_WINDOW_S = 0.05
MAX_BATCH_ROWS = 4096
# How many adapter folders' content digests a replica keeps (identical_calls): a sweep's configs
# times the versions each has in flight, with room to spare.
ADAPTER_DIGESTS = 256


def batch_order(request: SamplingRequest) -> tuple[int, list[int]]:
    """Where a request sits in an engine batch: by seed, then prompt (not by arrival)."""
    return request.seed, request.prompt_ids


@dataclass(frozen=True)
class EngineCall:
    """One group for the batcher: which engine and adapter, and what to sample."""

    key: EngineKey
    adapter_path: str | None  # None: the model without an adapter (the judge)
    request: SamplingRequest

    def mixes(self) -> bool:
        """Whether this group may share an engine batch with other adapters' groups (a sweep's
        configs, a pipelined run's versions): on vLLM any adapter's group (a LoRARequest per
        prompt); on transformers, where mixed batches pay (`mixed_batches_pay`), one without a
        multi-turn context to keep or a regex (PEFT's mixed adapter batches)."""
        if self.adapter_path is None:
            return False
        if self.key.backend == "vllm":
            return True
        return mixed_batches_pay(self.key.backend) and not self.request.continues and self.request.regex is None

    def batches_with(self) -> tuple:
        """Calls decode in one engine batch when these are equal."""
        if self.mixes():
            return self.key, self.request.sampling()
        return self.key, self.adapter_path, self.request.sampling()


def mixed_batches_pay(backend: str) -> bool:
    """Whether one engine batch of several adapters' rows decodes faster than one batch per adapter.
    On transformers, on a CPU only: PEFT's mixed batches run each LoRA layer once per adapter, on
    its rows. On a CPU the shared base layers' larger matmuls win; on a GPU the extra small kernels
    lose (an H200, benchmarks/device_check_h200.json), so there the batcher keeps one adapter a
    batch (docs/measurements.md#sweeps-on-one-warm-pool-issue-39-2026-11-26)."""
    return backend == "hf" and best_device() == "cpu"


def identical_calls(calls: list[EngineCall], contents: list[str | None]) -> tuple[list[EngineCall], list[int]]:
    """The calls to decode, one for each set of identical ones, and for each call the index of the
    one decoded for it. `contents[i]` identifies the content of `calls[i]`'s adapter (`adapter_content`).

    Identical: the same engine, adapter content and request (a sweep's configs that differ only in
    what they train start from the same adapter and sample the same prompts with the same seeds).
    A multi-turn turn (`continues`) is its own: the engine keeps its context per adapter path. An
    adapter's content is decoded under one of its paths, the least (whichever batch it is in), so
    the engine loads it once."""
    canonical: dict[str | None, str] = {}
    for call, content in zip(calls, contents, strict=True):
        if call.adapter_path is not None and not call.request.continues:
            canonical[content] = min(canonical.get(content, call.adapter_path), call.adapter_path)
    decoded: list[EngineCall] = []
    index: dict[object, int] = {}
    owners: list[int] = []
    for i, (call, content) in enumerate(zip(calls, contents, strict=True)):
        same = i if call.request.continues else (call.key, content, call.request.model_dump_json())
        if same not in index:
            index[same] = len(decoded)
            path = call.adapter_path if call.request.continues else canonical.get(content, call.adapter_path)
            decoded.append(replace(call, adapter_path=path))
        owners.append(index[same])
    return decoded, owners


@functools.lru_cache(maxsize=ADAPTER_DIGESTS)
def _folder_digest(path: str, files: tuple) -> str:
    """The sha256 of a folder's files (names and bytes). `files` (`files.files_of`) is part of the
    cache's key: a folder replaced at the same path (a train step's retry) is hashed again."""
    digest = hashlib.sha256()
    for name, *_ in files:
        with open(Path(path) / name, "rb") as f:
            digest.update(name.encode() + b"\0" + hashlib.file_digest(f, "sha256").digest())
    return "sha256:" + digest.hexdigest()


def adapter_content(path: str | None) -> str | None:
    """What identifies an adapter's content: the digest of its folder's files an engine loads, the
    trainer's own (`TRAINER_FILES`: the optimizer state holds the config's learning rate) left out
    (None: no adapter). A folder that cannot be read is identified by its path: it fails on its
    own, as it would have."""
    if path is None:
        return None
    try:
        return _folder_digest(path, tuple(f for f in files_of(path) if f[0] not in TRAINER_FILES))
    except OSError:
        return path


async def _contents(calls: list[EngineCall]) -> list[str | None]:
    """Each call's `adapter_content`; a batch with one adapter path (every flush of a lone run)
    needs no digest, its path says it, and no hop to a thread to read files."""
    paths = [call.adapter_path for call in calls]
    if len(set(paths) - {None}) < 2:
        return paths
    return await asyncio.to_thread(lambda: [adapter_content(path) for path in paths])


async def _process(calls: list[EngineCall]) -> list[list[Rollout] | BaseException]:
    """The batcher's function: the calls of one batch, identical ones decoded once
    (`identical_calls`; each caller gets its own copy), one engine batch per shared settings."""
    decoded, owners = identical_calls(calls, await _contents(calls))
    results = await _decode_calls(decoded)
    answers: list[list[Rollout] | BaseException] = []
    answered: set[int] = set()
    for j in owners:
        shared = j in answered and not isinstance(results[j], BaseException)
        # a deep copy for each caller after the first: what one caller changes stays its own
        answers.append([rollout.model_copy(deep=True) for rollout in results[j]] if shared else results[j])
        answered.add(j)
    return answers


async def _decode_calls(calls: list[EngineCall]) -> list[list[Rollout] | BaseException]:
    """The calls of one batch, decoded one engine batch per shared settings.

    A failing engine batch fails every group in it (its exception is each one's result) and no other.
    """
    results: list[list[Rollout] | BaseException | None] = [None] * len(calls)
    batches: dict[tuple, list[int]] = {}
    for i, call in enumerate(calls):
        batches.setdefault(call.batches_with(), []).append(i)
    for members in batches.values():
        # Sorted, so the batch does not depend on arrival order: the same groups give the same rollouts.
        members.sort(key=lambda i: (batch_order(calls[i].request), calls[i].adapter_path or ""))
        for chunk in _adapter_chunks(members, calls):
            paths = [calls[i].adapter_path for i in chunk]
            if len(set(paths)) > 1:
                try:
                    out = await run_on_torch_thread(_decode_mixed, calls[chunk[0]].key, [calls[i].request for i in chunk], paths)
                    for i, rollouts in zip(chunk, out, strict=True):
                        results[i] = rollouts
                    continue
                except Exception:  # noqa: BLE001 -- e.g. one config's damaged adapter: decoded per adapter below, so it fails alone
                    logger.warning("a batch of %d adapters failed; decoding it one adapter at a time", len(set(paths)))
            for path in dict.fromkeys(paths):
                await _decode_into(results, calls, [i for i in chunk if calls[i].adapter_path == path])
    return results  # type: ignore[return-value]


async def _decode_into(results: list, calls: list[EngineCall], members: list[int]) -> None:
    """One engine batch of calls that share an adapter; its failure is every member's result."""
    first = calls[members[0]]
    try:
        out = await run_on_torch_thread(_decode, first.key, [calls[i].request for i in members], first.adapter_path)
    except Exception as exc:  # noqa: BLE001 -- handed to every group of this engine batch, raised there
        out = [exc] * len(members)
    for i, rollouts in zip(members, out, strict=True):
        results[i] = rollouts


def _adapter_chunks(members: list[int], calls: list[EngineCall]) -> list[list[int]]:
    """The engine batches of one batch's calls: as many adapters in each as the engine holds at once."""
    chunks: list[list[int]] = []
    adapters: set[str | None] = set()
    for i in members:
        path = calls[i].adapter_path
        if not chunks or (path not in adapters and len(adapters) >= max(1, calls[i].key.max_adapters)):
            chunks.append([])
            adapters = set()
        chunks[-1].append(i)
        adapters.add(path)
    return chunks


def _decode(key: EngineKey, requests: list[SamplingRequest], adapter_path: str | None) -> list[list[Rollout]]:
    return cache.engine_call(key, lambda engine: engine.generate_many(requests, adapter_path))


def _decode_mixed(key: EngineKey, requests: list[SamplingRequest], adapter_paths: list[str | None]) -> list[list[Rollout]]:
    return cache.engine_call(key, lambda engine: engine.generate_mixed(requests, adapter_paths))


@alru_cache(maxsize=1)
async def replica_batcher() -> DynamicBatcher:
    """The replica's one DynamicBatcher, started on first use: every generate call on this replica
    submits its groups here, and only its consumer drives the engine."""
    batcher = DynamicBatcher(
        _process,
        cost_estimator=lambda call: call.request.group_size,
        target_batch_cost=MAX_BATCH_ROWS,
        max_batch_size=MAX_BATCH_ROWS,
        batch_timeout_s=BATCH_WINDOW_S,
    )
    await batcher.start()
    return batcher


async def generate_groups(key: EngineKey, adapter_path: str | None, requests: list[SamplingRequest]) -> list[list[Rollout]]:
    """Each request's group of rollouts, through the replica's batcher (so they batch with others')."""
    batcher = await replica_batcher()
    await until_idle()  # the calls that arrive while the engine's thread works join one batch
    futures = [await batcher.submit(EngineCall(key, adapter_path, r)) for r in requests]
    results = await asyncio.gather(*futures)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


async def all_or_none(coroutines: list[Awaitable[T]]) -> list[T]:
    """Every coroutine's result, run concurrently; when one fails, the others are cancelled (not
    left running on a failed task's behalf) and its exception is raised as it is, with its own cause
    (an `EngineDiedError` keeps the error that killed the engine) and without the task group around it."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coroutines]
    except BaseExceptionGroup as failed:
        first = failed
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from first.__cause__
    return [t.result() for t in tasks]

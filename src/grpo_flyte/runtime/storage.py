"""This module knows where task data lives: a local path (Flyte local mode) or an object-store URI
(a cluster).

It is the one place that tells the two apart. Tasks read inputs through `LocalDirCache`
(download once per replica, bounded) and write outputs through `publish_dir` (never half-written).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

import flyte
from flyte.io import Dir
from pydantic import BaseModel

from grpo_flyte.runtime.cache import cache_root
from grpo_flyte.runtime.files import build_dir_atomic, write_bytes_atomic
from grpo_flyte.runtime.torch_thread import run_on_torch_thread
from grpo_flyte.types import Rollout, RolloutGroup


def is_remote(path: str) -> bool:
    """Whether `path` is an object-store URI (s3://, gs://, ...) rather than a local path (a
    `file://` URI is local: a cluster whose raw data is a shared file system gives those)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    """A local path or `file://` URI as a plain path."""
    return path.removeprefix("file://")


def _local_raw_data() -> Path | None:
    """The task's raw data folder when it is local (Flyte local mode), else None."""
    ctx = flyte.ctx()
    raw = ctx.raw_data_path.path if ctx and ctx.raw_data_path else None
    return Path(local_path(raw)).resolve() if raw and not is_remote(raw) else None


def portable_path(path: str) -> str:
    """A local path under the task's raw data folder, written relative to it (so a run folder can
    be moved or copied and still resumed); any other path or URI as it is."""
    raw = _local_raw_data()
    if raw is None or is_remote(path) or not Path(local_path(path)).is_absolute():
        return path
    try:
        return Path(local_path(path)).resolve().relative_to(raw).as_posix()
    except ValueError:
        return path


def located_path(path: str) -> str:
    """The inverse of `portable_path` in the task running now: a relative path joined to its raw
    data folder."""
    raw = _local_raw_data()
    if raw is None or is_remote(path) or Path(path).is_absolute():
        return path
    return str(raw / path)


async def save_checkpoint(checkpoint: flyte.Checkpoint, payload: bytes) -> None:
    """flyte.Checkpoint.save, whole or not at all where the checkpoint is a local file: Flyte writes
    a local checkpoint in place, so a kill in the middle would leave a truncated one to resume from."""
    destination = local_path(checkpoint.remote_destination)
    if is_remote(destination):
        await checkpoint.save(payload)
    else:
        await asyncio.to_thread(write_bytes_atomic, destination, payload)


class LocalDirCache:
    """Remote directories downloaded once per replica, at most `capacity` kept on disk.

    A folder a call is using (`use`) is never deleted: past `capacity`, the least recently used of
    the folders no call holds go first, and while more than `capacity` are held at once the cache
    holds them all until their calls end. A directory that is already local (local mode) is used
    in place and never deleted.
    """

    def __init__(self, root: Path, capacity: int):
        self.root = root
        self.capacity = capacity
        self.entries: OrderedDict[str, str] = OrderedDict()
        self.holders: dict[str, int] = {}  # remote path -> calls using its folder now
        self._lock = asyncio.Lock()

    async def get(self, d: Dir) -> str:
        """The folder's local path, for a use that ends before the next download (no call holds it)."""
        if not is_remote(d.path):
            return local_path(d.path)
        async with self._lock:
            return await self._fetch(d)

    @asynccontextmanager
    async def use(self, d: Dir) -> AsyncIterator[str]:
        """The folder's local path, kept on disk until the block ends."""
        if not is_remote(d.path):
            yield local_path(d.path)
            return
        async with self._lock:
            self.holders[d.path] = self.holders.get(d.path, 0) + 1
            try:
                local = await self._fetch(d)
            except BaseException:
                self._release(d.path)
                raise
        try:
            yield local
        finally:
            self._release(d.path)

    async def _fetch(self, d: Dir) -> str:
        if d.path in self.entries:
            self.entries.move_to_end(d.path)
            return self.entries[d.path]
        target = self.root / hashlib.sha256(d.path.encode()).hexdigest()[:16]
        shutil.rmtree(target, ignore_errors=True)
        local = await d.download(str(target))
        self.entries[d.path] = local
        self._evict()
        return local

    def _release(self, path: str) -> None:
        self.holders[path] -= 1
        if not self.holders[path]:
            del self.holders[path]
        self._evict()

    def _evict(self) -> None:
        """Delete the least recently used folders no call holds while more than `capacity` are kept."""
        idle = [path for path in self.entries if path not in self.holders]
        while len(self.entries) > self.capacity and idle:
            shutil.rmtree(self.entries.pop(idle.pop(0)), ignore_errors=True)


def replica_cache(name: str, capacity: int) -> LocalDirCache:
    """A per-process download cache under the user cache (one folder per process and purpose)."""
    return LocalDirCache(cache_root() / "replica" / f"{name}-{os.getpid()}", capacity=capacity)


class NodeDirCache:
    """Remote directories downloaded once per node, shared by the processes of a data-parallel train
    step (one per GPU, in one pod): the first process to ask downloads, the others wait for it on
    a file lock and use its copy. The pod lives one step, so nothing is evicted."""

    def __init__(self, root: Path):
        self.root = root

    async def get(self, d: Dir) -> str:
        from filelock import AsyncFileLock

        if not is_remote(d.path):
            return local_path(d.path)
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.root / hashlib.sha256(d.path.encode()).hexdigest()[:16]
        done = target.with_name(target.name + ".done")  # holds the downloaded path, written last
        async with AsyncFileLock(str(target) + ".lock"):
            if not done.is_file():
                shutil.rmtree(target, ignore_errors=True)  # a process that died while downloading
                done.write_text(await d.download(str(target)))
            return done.read_text()


def node_cache(name: str) -> NodeDirCache:
    """A download cache shared by every process of this node (this pod) that uses `name`."""
    return NodeDirCache(cache_root() / "node" / name)


async def publish_dir(build: Callable[[Path], T], name: str, folder: str = "adapters", key: str | None = None) -> tuple[Dir, T]:
    """Write a directory with `build(path)` and return it as a Dir, never half-written, with what
    `build` returned.

    `key` (a hash of the content) stands for the folder wherever Flyte hashes task inputs, so a
    task given this folder gets the same action name in a rerun of the run, and
    `flyte.rerun(..., recover=True)` reuses its output instead of running it again.

    `build` runs on the process's torch thread, which also serializes the steps that share a
    replica's models (locally every task shares one process). With local raw data (local mode) the
    folder is built in a staging folder beside `<raw data>/<folder>/<name>` and renamed, and stays
    there; on a cluster it is built in a temp folder and uploaded before the folder is removed.
    """
    raw = _local_raw_data()
    if raw is not None:
        # Replaces a folder left by an attempt that died before the checkpoint.
        final = raw / folder / name
        value = await run_on_torch_thread(build_dir_atomic, final, build)
        return await Dir.from_local(str(final), dir_cache_key=key), value
    with tempfile.TemporaryDirectory() as tmp:
        value = await run_on_torch_thread(build, Path(tmp))
        return await Dir.from_local(tmp, dir_cache_key=key), value


# Flyte's remote controller refuses a call whose inputs, or whose outputs, serialize to more than the
# task's max_inline_io_bytes: flyte.models.MAX_INLINE_IO_BYTES, 10 MiB (checked in
# flyte/_internal/controllers/remote/_controller.py, upload_inputs_with_retry and
# load_and_convert_outputs; local mode and a pod's own upload of its outputs do not check).
FLYTE_INLINE_LIMIT_BYTES = 10 * 2**20
# A list that could outgrow that (the token ids and log-probs of a large batch: 32 groups x 8 x 2048
# tokens is about 13 MB) travels as a folder holding one JSON line per item once its JSON passes
# this size.
INLINE_LIMIT_BYTES = 4 * 2**20
PAYLOAD_FILE = "items.jsonl"
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def payload_text(items: list[BaseModel]) -> str | None:
    """The items as JSON lines when they are too large to pass inline, else None."""
    lines = [item.model_dump_json() for item in items]
    if sum(len(line) + 1 for line in lines) <= INLINE_LIMIT_BYTES:
        return None
    return "".join(line + "\n" for line in lines)


def payload_key(text: str) -> str:
    """The content hash that stands for a payload folder in Flyte's input hashes."""
    return hashlib.sha256(text.encode()).hexdigest()


def write_payload(folder: Path, text: str) -> None:
    (folder / PAYLOAD_FILE).write_text(text, encoding="utf-8")


async def as_payload(items: list[M], name: str) -> tuple[list[M], list[Dir]]:
    """(items, []) when they are small enough to pass inline, else ([], [a published folder
    holding them]): pass both to the task, which reads them back with `from_payload`.

    A list rather than `Dir | None`: Flyte honours a Dir's content hash inside a list when it names
    the task's action, and not inside an optional, so only the list keeps a rerun's names stable."""
    text = payload_text(items)
    if text is None:
        return items, []
    folder, _ = await publish_dir(lambda out: write_payload(out, text), name, folder="payloads", key=payload_key(text))
    return [], [folder]


async def from_payload(items: list[M], payload: list[Dir], model: type[M], cache: LocalDirCache | NodeDirCache) -> list[M]:
    """The items `as_payload` split: inline, or read back from the folder."""
    for folder in payload:
        path = await cache.get(folder)
        text = await asyncio.to_thread((Path(path) / PAYLOAD_FILE).read_text, encoding="utf-8")
        items = [*items, *(model.model_validate_json(line) for line in text.splitlines() if line)]
    return items


# --------------------------------------------------------------------------- groups as files

# The generate tasks' groups past this inline size, together, travel as folders: a long episode's
# group (about 24 bytes a token inline: its id, log-prob, mask and text, twice in an episode) passes
# Flyte's 10 MiB near 450k tokens. Under it, with room for the other inputs of the calls that take a
# group (score_group, judge_group, reward_model_group).
GROUPS_INLINE_BYTES = 4 * 2**20
GROUP_FILE = "group.json"


class _GroupBody(BaseModel):
    """What a stowed group's folder holds."""

    prompt_ids: list[int]
    rollouts: list[Rollout]


def inline_size(value: BaseModel) -> int:
    """The bytes of `value`'s Flyte literal: MessagePack of its JSON (flyte's PydanticTransformer)."""
    import msgpack

    return len(msgpack.dumps(value.model_dump(mode="json")))


async def stow_groups(groups: list[RolloutGroup]) -> list[RolloutGroup]:
    """The groups as a task returns them: while their inline size (`inline_size`) passes
    GROUPS_INLINE_BYTES, the largest one's prompt ids and rollouts go to a published folder
    (`RolloutGroup.stowed`, named by its content's hash), so that what crosses the task boundary
    stays far under Flyte's limit however long the episodes."""
    sizes = [inline_size(g) for g in groups]
    total, out = sum(sizes), list(groups)
    for i in sorted(range(len(groups)), key=lambda i: -sizes[i]):
        if total <= GROUPS_INLINE_BYTES:
            break
        text = _GroupBody(prompt_ids=groups[i].prompt_ids, rollouts=groups[i].rollouts).model_dump_json()
        key = payload_key(text)

        def write(folder: Path, text: str = text) -> None:
            (folder / GROUP_FILE).write_text(text, encoding="utf-8")

        folder, _ = await publish_dir(write, f"group-{key[:16]}", folder="groups", key=key)
        out[i] = groups[i].model_copy(update={"prompt_ids": [], "rollouts": [], "stowed": folder})
        total += inline_size(out[i]) - sizes[i]
    return out


async def fetch_group(group: RolloutGroup) -> RolloutGroup:
    """The group with its prompt ids and rollouts, read back from its folder when it was stowed."""
    if group.stowed is None:
        return group
    if is_remote(group.stowed.path):
        with tempfile.TemporaryDirectory() as tmp:
            local = await group.stowed.download(str(Path(tmp) / "group"))
            text = await asyncio.to_thread((Path(local) / GROUP_FILE).read_text, encoding="utf-8")
    else:
        text = await asyncio.to_thread((Path(local_path(group.stowed.path)) / GROUP_FILE).read_text, encoding="utf-8")
    body = _GroupBody.model_validate_json(text)
    return group.model_copy(update={"prompt_ids": body.prompt_ids, "rollouts": body.rollouts, "stowed": None})


def discard_stowed(group: RolloutGroup) -> None:
    """Delete a stowed group's folder once its last reader (the driver, after scoring) has it, in
    Flyte local mode only: there a run folder would keep every long group, and a resume generates
    again whatever was in flight. On a cluster the folder is the generate action's output, which a
    recovered run reuses."""
    ctx = flyte.ctx()
    if group.stowed is not None and ctx and ctx.mode == "local" and not is_remote(group.stowed.path):
        shutil.rmtree(local_path(group.stowed.path), ignore_errors=True)

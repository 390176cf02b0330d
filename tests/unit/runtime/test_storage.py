"""grpo_flyte.runtime.storage: local paths used in place, remote folders downloaded once per replica and evicted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import ClassVar

from flyte.io import Dir

from grpo_flyte.runtime.storage import LocalDirCache, is_remote


def test_is_remote():
    assert is_remote("s3://bucket/a") and is_remote("gs://b/x")
    assert not is_remote("/tmp/a") and not is_remote("runs/a")


# --------------------------------------------------------------------------- LocalDirCache


def test_local_dir_is_used_in_place(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cache = LocalDirCache(tmp_path / "cache", capacity=1)
    assert asyncio.run(cache.get(Dir(path=str(model)))) == str(model)
    assert asyncio.run(cache.get(Dir(path=str(model)))) == str(model)
    # nothing downloaded, nothing recorded, the directory untouched
    assert not (tmp_path / "cache").exists()
    assert cache.entries == {}
    assert (model / "config.json").read_text() == "{}"


class FakeRemoteDir:
    """Stands in for a remote flyte.io.Dir: download() writes a marker file into the target."""

    downloads: ClassVar[list[str]] = []

    def __init__(self, path: str):
        self.path = path

    async def download(self, local_path: str) -> str:
        FakeRemoteDir.downloads.append(self.path)
        Path(local_path).mkdir(parents=True)
        (Path(local_path) / "from.txt").write_text(self.path)
        return local_path


def test_remote_dirs_are_downloaded_once_and_evicted(tmp_path):
    FakeRemoteDir.downloads = []
    cache = LocalDirCache(tmp_path / "cache", capacity=2)

    async def scenario():
        a1 = await cache.get(FakeRemoteDir("s3://b/a"))
        a2 = await cache.get(FakeRemoteDir("s3://b/a"))
        b = await cache.get(FakeRemoteDir("s3://b/b"))
        a3 = await cache.get(FakeRemoteDir("s3://b/a"))  # a becomes the newest
        c = await cache.get(FakeRemoteDir("s3://b/c"))  # capacity 2: evicts b, the oldest
        return a1, a2, b, a3, c

    a1, a2, b, a3, c = asyncio.run(scenario())
    assert a1 == a2 == a3
    assert Path(a1).parent == tmp_path / "cache"
    assert (Path(a1) / "from.txt").read_text() == "s3://b/a"
    assert len({a1, b, c}) == 3
    assert FakeRemoteDir.downloads == ["s3://b/a", "s3://b/b", "s3://b/c"]
    assert not Path(b).exists()
    assert Path(a1).exists() and Path(c).exists()
    assert list(cache.entries) == ["s3://b/a", "s3://b/c"]


def test_a_folder_in_use_is_never_evicted(tmp_path):
    """Capacity 2, three folders held at once: all three stay until their calls end; then the
    least recently used idle one goes, and a folder asked for again while held is not downloaded again."""
    FakeRemoteDir.downloads = []
    cache = LocalDirCache(tmp_path / "cache", capacity=2)

    async def scenario():
        async with cache.use(FakeRemoteDir("s3://b/a")) as a, cache.use(FakeRemoteDir("s3://b/b")) as b:
            async with cache.use(FakeRemoteDir("s3://b/c")) as c:
                held = [Path(p).exists() for p in (a, b, c)]
                async with cache.use(FakeRemoteDir("s3://b/a")) as a_again:
                    assert a_again == a
            after_c = sorted(cache.entries)
        return a, b, c, held, after_c

    a, b, c, held, after_c = asyncio.run(scenario())
    assert held == [True, True, True]
    assert after_c == ["s3://b/a", "s3://b/b"]  # c, released first while a and b were held, went
    assert FakeRemoteDir.downloads == ["s3://b/a", "s3://b/b", "s3://b/c"]
    assert not Path(c).exists() and Path(a).exists() and Path(b).exists()
    assert cache.holders == {}


# --------------------------------------------------------------------------- NodeDirCache


def test_the_processes_of_a_node_download_a_folder_once_and_share_it(tmp_path):
    """The processes of a multi-GPU train step (one per GPU, in one pod) ask for the base at once:
    one downloads, the others wait on the file lock and get the same folder. Two threads, each with
    its own cache object and event loop, stand in for two processes."""
    import threading
    import time

    from grpo_flyte.runtime.storage import NodeDirCache

    class SlowRemoteDir(FakeRemoteDir):
        async def download(self, local_path: str) -> str:
            time.sleep(0.2)  # long enough for the other process to ask meanwhile
            return await super().download(local_path)

    FakeRemoteDir.downloads = []
    got: list[str] = []
    threads = [
        threading.Thread(target=lambda: got.append(asyncio.run(NodeDirCache(tmp_path / "node").get(SlowRemoteDir("s3://b/base")))))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert FakeRemoteDir.downloads == ["s3://b/base"]
    assert len(got) == 2 and got[0] == got[1] and (Path(got[0]) / "from.txt").read_text() == "s3://b/base"
    # a later process of the node (a retried step on the same pod) finds it too
    assert asyncio.run(NodeDirCache(tmp_path / "node").get(FakeRemoteDir("s3://b/base"))) == got[0]
    assert FakeRemoteDir.downloads == ["s3://b/base"]


# --------------------------------------------------------------------------- groups as files (issue 54, item 7)


def test_a_long_episode_group_crosses_task_boundaries_as_a_file(tmp_path):
    """A group of 8 episodes of 56k tokens serializes to more than Flyte's 10 MiB inline limit
    (flyte.models.MAX_INLINE_IO_BYTES, which the remote controller enforces on a call's inputs and
    outputs). Returned by a task (Flyte local mode here), it comes back stowed: the literals of
    generate's output and of score_group's inputs and output, as Flyte's own converters build
    them, stay under 1 MiB, and the group reads back whole. Small groups stay inline."""
    from flyte._internal.runtime import convert
    from flyte.models import MAX_INLINE_IO_BYTES

    from grpo_flyte.config.run import RunConfig
    from grpo_flyte.reward import score_group
    from grpo_flyte.rollout import generate
    from grpo_flyte.runtime.storage import FLYTE_INLINE_LIMIT_BYTES, fetch_group, inline_size
    from grpo_flyte.types import RewardParts, ScoredGroup
    from tests.support.long_group import long_group, stowed_in_local_run

    assert FLYTE_INLINE_LIMIT_BYTES == MAX_INLINE_IO_BYTES == 10 * 2**20
    big, small = long_group(), long_group(group_size=2, tokens=50, seed=1)
    assert inline_size(big) > MAX_INLINE_IO_BYTES  # inline, the remote controller would refuse it
    stub, same_small = stowed_in_local_run([big, small], tmp_path / "raw")
    assert same_small == small  # under the threshold: inline, as before
    assert stub.stowed is not None and stub.rollouts == [] and stub.prompt_ids == []
    assert Path(stub.stowed.path).is_relative_to(tmp_path / "raw")

    config = RunConfig()
    output = asyncio.run(convert.convert_from_native_to_outputs(stub, generate.native_interface))
    inputs = asyncio.run(convert.convert_from_native_to_inputs(score_group.native_interface, config.scoring, config.sampling, stub))
    scored = ScoredGroup(group=stub, rewards=[RewardParts(reward=1.0, correct=True, format=True)] * 8)
    scored_output = asyncio.run(convert.convert_from_native_to_outputs(scored, score_group.native_interface))
    for literal in (output.proto_outputs, inputs.proto_inputs, scored_output.proto_outputs):
        assert literal.ByteSize() < 2**20
    assert asyncio.run(fetch_group(stub)) == big

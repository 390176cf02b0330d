"""What a finished run ships (loop/shipping.py), with the merge, the held-out evaluation and the
Hub replaced by stand-ins: a form that fails its check is neither kept nor pushed, a form that
passes is pushed with export.json and a model card stating the check's figures."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import huggingface_hub
import pytest
from flyte.io import Dir

from grpo_flyte.config.run import RunConfig
from grpo_flyte.loop import shipping
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.guard import BestAdapter, GuardState
from grpo_flyte.loop.state import LoopState
from grpo_flyte.runtime.storage import LocalDirCache
from grpo_flyte.types import OPTIMIZER_FILE, AdapterRef, Example

QUESTIONS = [Example(question=f"q{i}", answer=str(i)) for i in range(5)]


def _answers(completions: list[str], correct: list[bool]) -> list[EvalAnswer]:
    return [
        EvalAnswer(question=f"q{i}", answer=str(i), completion=c, reward=float(ok), correct=ok, format=True, scores={})
        for i, (c, ok) in enumerate(zip(completions, correct, strict=True))
    ]


# the adapter's answers: 3 of 5 correct
ADAPTER = _answers(["a", "b", "c", "d", "e"], [True, True, True, False, False])


class StandInHub:
    """huggingface_hub.HfApi's create_repo and upload_folder against a local folder (no network here)."""

    root: Path

    def create_repo(self, repo_id, private=False, exist_ok=False):
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)
        return type("RepoUrl", (), {"url": f"https://huggingface.co/{repo_id}"})()

    def upload_folder(self, folder_path, repo_id, commit_message=""):
        shutil.copytree(folder_path, self.root / repo_id, dirs_exist_ok=True)


class Shipping:
    """The stand-ins: `merged` (the merged model's answers), `uploaded` (the staged adapter
    files' answers) and `gguf` (the GGUF file's); `evaluated` records each evaluation's (model,
    adapter) paths, `backends` its engine backend, `written` each GGUF written (merged folder, quant)."""

    def __init__(
        self,
        tmp: Path,
        monkeypatch: pytest.MonkeyPatch,
        merged: list[EvalAnswer],
        uploaded: list[EvalAnswer],
        gguf: list[EvalAnswer] = ADAPTER,
    ):
        self.tmp, self.evaluated, self.backends, self.written = tmp, [], [], []
        adapter_dir = tmp / "adapters" / "v0003"
        adapter_dir.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors", OPTIMIZER_FILE):
            (adapter_dir / name).write_text(name)
        self.adapter = AdapterRef(version=3, dir=Dir(path=str(adapter_dir)))
        self.base = Dir(path=str(tmp / "base"))

        async def run_eval(config, model, adapter, questions, iteration):
            assert config.evaluation.num_generations_eval is None  # greedy, whatever the run's setting
            self.evaluated.append((model.path, adapter.dir.path if adapter else None))
            self.backends.append(config.engine.backend)
            if adapter is None:
                return None, gguf if Path(model.path).name.startswith("gguf-") else merged
            return None, uploaded if Path(adapter.dir.path).name.startswith("upload-") else ADAPTER

        async def merge_adapter(base_model, adapter):
            out = tmp / "adapters" / f"merged-v{adapter.version:04d}"
            out.mkdir()
            (out / "model.safetensors").write_text("weights")
            return Dir(path=str(out))

        async def publish_dir(build, name, folder="adapters", key=None):
            out = tmp / folder / name
            out.mkdir(parents=True)
            return Dir(path=str(out)), build(out)

        monkeypatch.setattr(shipping, "run_eval", run_eval)

        async def write_gguf(merged_dir, quant):
            self.written.append((merged_dir.path, quant))
            out = tmp / "exports" / f"gguf-{quant}-{Path(merged_dir.path).name}"
            out.mkdir(parents=True)
            (out / f"model-{quant}.gguf").write_text("gguf")
            return Dir(path=str(out))

        monkeypatch.setattr(shipping, "merge_adapter", merge_adapter)
        monkeypatch.setattr(shipping, "write_gguf", write_gguf)
        monkeypatch.setattr(shipping, "publish_dir", publish_dir)
        monkeypatch.setattr(StandInHub, "root", tmp / "hub", raising=False)
        monkeypatch.setattr(huggingface_hub, "HfApi", StandInHub)

    def ship(self, config: RunConfig, kept: dict[int, list[EvalAnswer]] | None = None) -> shipping.Shipped:
        best = BestAdapter(iteration=3, adapter=self.adapter, value=0.6, values=[1, 1, 1, 0, 0])
        state = LoopState(iterations_done=4, adapter=self.adapter, history=[], guard=GuardState(metric="eval_accuracy", best=best))
        folders = LocalDirCache(self.tmp / "cache", capacity=2)
        return asyncio.run(shipping.ship(config, state, self.base, QUESTIONS, kept or {}, folders))

    @property
    def repo(self) -> Path:
        return self.tmp / "hub" / "me" / "tiny"


def test_a_merged_model_that_fails_its_check_is_removed_and_nothing_is_pushed(tmp_path, monkeypatch):
    # a merge that lost the LoRA update: 3 of 5 answers differ (60% > 20%), none correct
    lost = _answers(["a", "b", "x", "y", "z"], [False, False, False, False, False])
    stand_in = Shipping(tmp_path, monkeypatch, merged=lost, uploaded=ADAPTER)
    shipped = stand_in.ship(RunConfig(export_merged=True, push_to_hub="me/tiny", eval_size=5, export_adapter="best"))
    assert shipped.merged is None and shipped.url is None
    assert shipped.check is not None and not shipped.check.passed and shipped.check.agreement == pytest.approx(0.4)
    assert not (tmp_path / "adapters" / "merged-v0003").exists()  # no half-kept merged folder
    assert not (tmp_path / "hub").exists()  # nothing pushed
    line = shipping.shipped_line(shipped)
    assert line.startswith("export merged failed its check: held-out accuracy 0.0% is 60.0 pp") and line.endswith(
        "; nothing was kept or pushed"
    )


def test_a_merged_model_that_passes_is_pushed_with_its_export_json_and_figures(tmp_path, monkeypatch):
    # one answer worded differently (20%: the limit), the same correctness
    close = _answers(["a", "b", "c", "d", "E"], [True, True, True, False, False])
    stand_in = Shipping(tmp_path, monkeypatch, merged=close, uploaded=ADAPTER)
    shipped = stand_in.ship(RunConfig(export_merged=True, push_to_hub="me/tiny", eval_size=5, export_adapter="best"))
    assert shipped.check.passed and shipped.merged.path == str(tmp_path / "adapters" / "merged-v0003")
    assert shipped.url == "https://huggingface.co/me/tiny"
    written = json.loads((tmp_path / "adapters" / "merged-v0003" / "export.json").read_text())
    assert (written["form"], written["adapter"], written["adapter_iteration"], written["questions"]) == ("merged", "best", 3, 5)
    assert written["agreement"] == pytest.approx(0.8) and written["difference"] == 0.0
    # the adapter was evaluated once (no answers kept), then the merged model
    assert stand_in.evaluated == [(stand_in.base.path, stand_in.adapter.dir.path), (shipped.merged.path, None)]
    assert {p.name for p in stand_in.repo.iterdir()} == {"model.safetensors", "export.json", "README.md"}
    card = (stand_in.repo / "README.md").read_text()
    assert "## Verified against its adapter (5 held-out questions, greedy)" in card
    assert "the best adapter (iteration 3)" in card
    assert "- **Agreement:** 80.0% of the answers identical (at most 20% may differ)" in card
    assert "- **Accuracy:** 60.0% uploaded, 60.0% adapter" in card
    assert "- **Reward:** 0.600 uploaded, 0.600 adapter" in card
    # d = 0 for every question: mean 0, stdev 0
    assert "- **Paired difference (held-out accuracy, uploaded minus adapter):** +0.0 pp +- 0.0 pp (95%)" in card


def test_the_adapter_push_checks_the_files_as_uploaded_and_reuses_the_runs_answers(tmp_path, monkeypatch):
    stand_in = Shipping(tmp_path, monkeypatch, merged=[], uploaded=ADAPTER)
    shipped = stand_in.ship(RunConfig(push_to_hub="me/tiny", eval_size=5, export_adapter="final"), kept={3: ADAPTER})
    assert shipped.check.passed and shipped.check.form == "adapter" and shipped.check.agreement == 1.0
    assert shipped.check.adapter == "final"
    upload = tmp_path / "exports" / "upload-v0003"
    assert stand_in.evaluated == [(stand_in.base.path, str(upload))]  # the run's answers reused: one evaluation
    assert {p.name for p in stand_in.repo.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "export.json", "README.md"}
    card = (stand_in.repo / "README.md").read_text()
    assert "the adapter's files as uploaded (PEFT PeftModel.from_pretrained on the run's base)" in card
    assert "library_name: peft" in card


def test_an_adapter_upload_that_fails_its_check_pushes_nothing(tmp_path, monkeypatch):
    # the uploaded files answer unlike the adapter (a file the upload left out, say)
    stand_in = Shipping(tmp_path, monkeypatch, merged=[], uploaded=_answers(["v", "w", "x", "y", "z"], [False] * 5))
    shipped = stand_in.ship(RunConfig(push_to_hub="me/tiny", eval_size=5, export_adapter="best"))
    assert not shipped.check.passed and shipped.url is None and shipped.merged is None
    assert not (tmp_path / "hub").exists() and not (tmp_path / "exports" / "upload-v0003").exists()


def test_a_gguf_is_written_from_a_passed_merge_and_read_on_the_transformers_engine(tmp_path, monkeypatch):
    stand_in = Shipping(tmp_path, monkeypatch, merged=ADAPTER, uploaded=ADAPTER)
    config = RunConfig(export_merged=True, export_gguf="q8_0", eval_size=5, export_adapter="best", backend="hf")
    shipped = stand_in.ship(config, kept={3: ADAPTER})
    merged, gguf = tmp_path / "adapters" / "merged-v0003", tmp_path / "exports" / "gguf-q8_0-merged-v0003"
    assert shipped.check.passed and shipped.merged.path == str(merged) and (merged / "export.json").is_file()
    assert stand_in.written == [(str(merged), "q8_0")]
    assert shipped.gguf.path == str(gguf) and sorted(p.name for p in gguf.iterdir()) == ["export.json", "model-q8_0.gguf"]
    written = json.loads((gguf / "export.json").read_text())
    assert (written["form"], written["adapter"], written["agreement"]) == ("gguf", "best", 1.0)
    assert written["loaded_with"].startswith("transformers' GGUF loader")
    # the run's own answers (its engine is transformers) reused: the merged model, then the file
    assert stand_in.evaluated == [(str(merged), None), (str(gguf), None)] and stand_in.backends == ["hf", "hf"]
    assert shipping.shipped_line(shipped) is None


def test_a_gguf_alone_merges_without_keeping_the_merge_and_pairs_answers_on_one_engine(tmp_path, monkeypatch):
    stand_in = Shipping(tmp_path, monkeypatch, merged=[], uploaded=ADAPTER)
    shipped = stand_in.ship(RunConfig(export_gguf="f16", eval_size=5, export_adapter="final"), kept={3: ADAPTER})
    assert shipped.merged is None and shipped.check is None and shipped.gguf_check.passed
    assert not (tmp_path / "adapters" / "merged-v0003").exists()  # the merge it was written from, not asked for, removed
    gguf = tmp_path / "exports" / "gguf-f16-merged-v0003"
    # --backend auto: the adapter evaluated again on transformers, beside the file
    assert stand_in.evaluated == [(stand_in.base.path, stand_in.adapter.dir.path), (str(gguf), None)]
    assert stand_in.backends == ["hf", "hf"]


def test_a_gguf_that_fails_its_check_is_removed_and_the_rest_is_kept(tmp_path, monkeypatch):
    lost = _answers(["a", "b", "x", "y", "z"], [False] * 5)
    stand_in = Shipping(tmp_path, monkeypatch, merged=ADAPTER, uploaded=ADAPTER, gguf=lost)
    config = RunConfig(export_merged=True, export_gguf="q4_0", push_to_hub="me/tiny", eval_size=5, export_adapter="best", backend="hf")
    shipped = stand_in.ship(config, kept={3: ADAPTER})
    assert shipped.gguf is None and not shipped.gguf_check.passed and shipped.gguf_check.agreement == pytest.approx(0.4)
    assert not (tmp_path / "exports" / "gguf-q4_0-merged-v0003").exists()
    # the merged model passed: kept and pushed (the push never takes the GGUF)
    assert shipped.check.passed and shipped.merged is not None and shipped.url == "https://huggingface.co/me/tiny"
    assert "model.safetensors" in {p.name for p in stand_in.repo.iterdir()}
    line = shipping.shipped_line(shipped)
    assert line.startswith("export gguf failed its check: ") and line.endswith("; nothing was kept or pushed") and "\n" not in line


def test_a_merge_that_fails_its_check_writes_no_gguf(tmp_path, monkeypatch):
    lost = _answers(["a", "b", "x", "y", "z"], [False] * 5)
    stand_in = Shipping(tmp_path, monkeypatch, merged=lost, uploaded=ADAPTER)
    shipped = stand_in.ship(RunConfig(export_merged=True, export_gguf="f16", eval_size=5, export_adapter="best"), kept={3: ADAPTER})
    assert stand_in.written == [] and shipped.gguf is None and shipped.gguf_check is None and not shipped.check.passed
    assert not (tmp_path / "adapters" / "merged-v0003").exists()


def test_exports_need_a_held_out_set():
    with pytest.raises(ValueError, match="--export-merged=True with --eval-size=0: an export is checked on the held-out set"):
        RunConfig(export_merged=True, eval_size=0)
    with pytest.raises(ValueError, match="--push-to-hub='me/tiny' with --eval-size=0"):
        RunConfig(push_to_hub="me/tiny", eval_size=0)
    with pytest.raises(ValueError, match="--export-gguf='f16' with --eval-size=0: an export is checked on the held-out set"):
        RunConfig(export_gguf="f16", eval_size=0)


def test_a_local_run_whose_export_failed_keeps_its_adapter_and_exits_1_with_the_line_last(tmp_path, caplog):
    from grpo_flyte.launch.run_files import LocalRunFiles, finish_local_run
    from grpo_flyte.loop.verification import compare
    from grpo_flyte.types import RunResult

    adapter_dir = tmp_path / "flyte" / "adapters" / "v0002"
    adapter_dir.mkdir(parents=True)
    (adapter_dir / "adapter_model.safetensors").write_text("w")
    lost = _answers(["a", "x", "y", "z", "e"], [False] * 5)
    names = {"form": "merged", "path": "p", "loaded_with": "x", "adapter": "final", "adapter_iteration": 2}
    failed = compare(lost, ADAPTER, "eval_accuracy", **names)
    adapter = AdapterRef(version=2, dir=Dir(path=str(adapter_dir)))
    result = RunResult(adapter=adapter, history=[], report=Dir(path=str(tmp_path)), export_check=failed)
    files = LocalRunFiles(tmp_path / "run", adapters_to_keep=2)
    with caplog.at_level("INFO", logger="grpo_flyte"):
        status = finish_local_run(files, RunConfig(export_merged=True, export_adapter="final"), result)
    assert status == 1
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file() and not (tmp_path / "run" / "merged").exists()
    last = caplog.records[-1]
    assert last.levelname == "ERROR" and last.getMessage().startswith("export merged failed its check: ")
    assert last.getMessage().endswith("; nothing was kept or pushed")
    passed = compare(ADAPTER, ADAPTER, "eval_accuracy", **names)
    assert finish_local_run(files, RunConfig(push_to_hub="me/tiny"), result.model_copy(update={"export_check": passed})) == 0

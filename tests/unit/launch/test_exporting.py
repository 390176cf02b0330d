"""The export and eval commands on a finished local run of the tiny model: the eval command gives
the run's own last figure, each exported form is checked and kept with its export.json, and a
damaged export (a wrong chat template, a dropped LoRA scale) fails in one line and leaves nothing."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from pathlib import Path

import pytest

from grpo_flyte.launch import exporting
from grpo_flyte.launch.cli import main as cli_main
from grpo_flyte.learning import merge
from grpo_flyte.loop.answers import EvalAnswer
from grpo_flyte.loop.verification import check_line, compare
from grpo_flyte.models import gguf_writer

RIGHT_MERGE = merge.merge_into_base  # the damaged merges below replace it
RIGHT_GGUF = gguf_writer.write_gguf  # and the damaged GGUF writers
TINY = ["--max-new-tokens", "8", "--prompts-per-iter", "2", "--group-size", "3", "--eval-size", "6", "--min-informative-groups", "0"]


# --------------------------------------------------------------------------- the comparison (pure)


def _answer(completion: str, correct: bool, reward: float | None = None, question: str = "q") -> EvalAnswer:
    reward = float(correct) if reward is None else reward
    return EvalAnswer(question=question, answer="1", completion=completion, reward=reward, correct=correct, format=True, scores={})


def test_the_comparison_pairs_the_answers_and_fails_worse_beyond_the_interval():
    adapter = [_answer("a", True), _answer("b", True), _answer("c", False), _answer("d", True)]
    same = compare(adapter, adapter, "eval_accuracy", form="merged", path="p", loaded_with="x", adapter="best", adapter_iteration=3)
    assert same.passed and same.agreement == 1.0 and same.difference == 0.0 and same.difference_ci95 == 0.0
    # one question lost (d: 1 -> 0), one reworded but as correct: d = [0, 0, 0, -1], mean -0.25,
    # stdev 0.5, half-width 1.96 * 0.5 / 2 = 0.49: within it; agreement 2 of 4
    export = [_answer("a", True), _answer("b2", True), _answer("c", False), _answer("d2", False)]
    within = compare(export, adapter, "eval_accuracy", 0.5, form="merged", path="p", loaded_with="x", adapter="best", adapter_iteration=3)
    assert within.passed and within.agreement == 0.5
    assert within.difference == pytest.approx(-0.25) and within.difference_ci95 == pytest.approx(0.49)
    assert (within.export_accuracy, within.adapter_accuracy) == (0.5, 0.75)
    strict = compare(export, adapter, "eval_accuracy", 0.25, form="merged", path="p", loaded_with="x", adapter="best", adapter_iteration=3)
    assert strict.failure == "50.0% of its answers differ from the adapter's (at most 25%: --max-disagreement)"
    # every right answer lost: d = [-1, -1, 0, -1], mean -0.75, half-width 0.49: worse beyond it
    lost = [_answer(a.completion, False) for a in adapter]
    worse = compare(lost, adapter, "eval_accuracy", 1.0, form="merged", path="p", loaded_with="x", adapter="best", adapter_iteration=3)
    assert worse.failure == "held-out accuracy 0.0% is 75.0 pp +- 49.0 pp below the adapter's 75.0% (paired, 95%)"
    assert check_line(worse) == (
        "export merged failed its check: held-out accuracy 0.0% is 75.0 pp +- 49.0 pp below the adapter's 75.0% (paired, 95%); "
        "100.0% of 4 held-out answers identical to the adapter's; held-out accuracy 0.0% against the adapter's 75.0%, "
        "-75.0 pp +- 49.0 pp (paired, 95%); nothing was written"
    )
    with pytest.raises(ValueError, match="the orders differ"):
        compare([_answer("a", True, question="other")], adapter[:1], "eval_accuracy")


# --------------------------------------------------------------------------- the commands on a real run


def _loud_copy(model: Path, out: Path, factor: float = 20.0) -> Path:
    """The tiny model with its projections `factor` times larger: its random layers then outweigh
    the embeddings, so its greedy answers differ from question to question (the tiny model as it
    is repeats the prompt's last token)."""
    import torch
    from transformers import AutoModelForCausalLM

    loud = AutoModelForCausalLM.from_pretrained(model)
    with torch.no_grad():
        for name, weight in loud.named_parameters():
            if "proj" in name:
                weight.mul_(factor)
    loud.save_pretrained(out)
    for path in model.iterdir():
        if not (out / path.name).exists():
            shutil.copy2(path, out / path.name)
    return out


def _noisy_adapter(run_dir: Path, std: float = 0.5) -> None:
    """The run's final adapter (adapter/) replaced by random LoRA weights of the same shapes: an
    adapter that changes every answer, so that a merge that loses part of it shows."""
    import torch
    from safetensors.torch import load_file, save_file

    path = run_dir / "adapter" / "adapter_model.safetensors"
    generator = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=generator) * std for k, v in load_file(str(path)).items()}, str(path))


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 2-iteration run of the loud tiny model, with a reward that tells its answers
    apart (the number of distinct characters, over 10)."""
    root = tmp_path_factory.mktemp("exporting")
    module = f"distinct_{uuid.uuid4().hex[:8]}"
    (root / f"{module}.py").write_text("def distinct(completions, **kwargs):\n    return [len(set(c)) / 10 for c in completions]\n")
    sys.path.insert(0, str(root))
    model = _loud_copy(tiny_model_dir, root / "loud")
    run_dir = root / "run"
    args = ["--local", "--model", str(model), *TINY, "--iterations", "2", "--rewards", f"{module}:distinct=1", "--run-dir", str(run_dir)]
    assert cli_main(args) == 0
    return run_dir


def _last_eval(run_dir: Path) -> dict:
    return [row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_reward" in row][-1]


def test_eval_gives_the_runs_own_last_figure_for_its_adapter(finished, capsys):
    last = _last_eval(finished)
    recorded = [json.loads(line) for line in (finished / "eval" / f"iter-{last['iteration']:04d}.jsonl").read_text().splitlines()]
    assert len({a["completion"] for a in recorded}) > 1, "the adapter should answer the questions differently"
    assert cli_main(["eval", str(finished / "adapter")]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"held-out accuracy {last['eval_accuracy']:.1%}")
    assert f"reward {last['eval_reward']:.3f} +- {last['eval_reward_ci95']:.3f}" in line and f"(n={len(recorded)})" in line
    assert line.endswith(f"adapter {finished / 'adapter'} on {json.loads((finished / 'config.json').read_text())['base']['model']}, "
                         f"on the held-out set of {finished}")  # fmt: skip
    assert last["eval_reward"] > 0 and last["eval_reward_ci95"] > 0


def test_each_form_is_checked_and_kept_with_its_export_json(finished, tmp_path, capsys):
    run_dir = Path(shutil.copytree(finished, tmp_path / "run"))
    _noisy_adapter(run_dir)
    for form, folder in (("merged", "merged"), ("adapter", "lora")):
        assert cli_main(["export", str(run_dir), "--to", form, "--export-adapter", "final"]) == 0
        line = capsys.readouterr().out.strip()
        assert line.startswith(f"export {form} verified: 100.0% of 6 held-out answers identical to the adapter's")
        check = exporting.read_check(run_dir / folder)
        assert check.passed and check.agreement == 1.0 and check.difference == 0.0
        assert (check.adapter, check.adapter_iteration, check.questions) == ("final", 2, 6)
        assert {"chat_template.jinja", "tokenizer.json", "export.json"} <= {p.name for p in (run_dir / folder).iterdir()}
    assert (run_dir / "merged" / "model.safetensors").is_file() and (run_dir / "lora" / "adapter_model.safetensors").is_file()
    # the merged folder is a plain transformers model: no PEFT files
    assert not (run_dir / "merged" / "adapter_config.json").exists()
    # the eval command on the merged model gives the export's figure
    assert cli_main(["eval", str(run_dir / "merged")]) == 0
    assert capsys.readouterr().out.startswith(f"held-out accuracy {check.export_accuracy:.1%}")


def _merged_without_the_lora_scale(model_path: str, adapter_path: str, out: Path) -> None:
    """The merge as a broken tool does it: B @ A added without LoRA's scale alpha / r."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_path), adapter_path)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.scaling = {name: 1.0 for name in module.scaling}
    model.merge_and_unload().save_pretrained(str(out))
    AutoTokenizer.from_pretrained(model_path).save_pretrained(str(out))


def _with_a_plain_chat_template(model_path: str, adapter_path: str, out: Path) -> None:
    """A right merge saved with another model's chat template (roles as plain words, not the
    trained <|im_start|> markers)."""
    RIGHT_MERGE(model_path, adapter_path, out)
    (out / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


@pytest.mark.parametrize("damage", [_merged_without_the_lora_scale, _with_a_plain_chat_template], ids=["lora-scale", "chat-template"])
def test_a_damaged_export_fails_in_one_line_and_leaves_nothing(finished, tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setattr(merge, "merge_into_base", damage)
    _fails_in_one_line_leaving_nothing(finished, tmp_path, capsys, "merged")


def _fails_in_one_line_leaving_nothing(finished: Path, tmp_path: Path, capsys, form: str) -> None:
    """`export --to form` of a copy of the finished run (a damaging writer patched in) fails with one
    line naming the disagreement and leaves the run folder as it was (no form's folder, no staging)."""
    run_dir = Path(shutil.copytree(finished, tmp_path / "run"))
    _noisy_adapter(run_dir)
    before = sorted(p.name for p in run_dir.iterdir())
    assert cli_main(["export", str(run_dir), "--to", form, "--export-adapter", "final"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("export ")]
    assert len(err) == 1 and err[0].startswith(f"export {form} failed its check: ") and err[0].endswith("; nothing was written")
    assert "of its answers differ from the adapter's (at most 20%: --max-disagreement)" in err[0]
    assert sorted(p.name for p in run_dir.iterdir()) == before


# --------------------------------------------------------------------------- the GGUF form


# The loud tiny model is chaotic: 32 wide, its projections 20 times their size, a greedy answer turns
# on the smallest change (bf16 weights alone change 3 of 8 of its answers; q8_0 all 8, where on the
# plain tiny model q8_0's logits stay within 0.006 of float32's and every argmax agrees). So f16 is
# held to the default 20% and q8_0 only to its accuracy (--max-disagreement 1): its round trip and
# check, not its agreement on a random model. What a real model's q8_0 agrees on is measured by
# the export itself, in its export.json.
@pytest.mark.parametrize("quant, max_disagreement", [("f16", "0.2"), ("q8_0", "1.0")])
def test_the_gguf_form_is_read_back_by_transformers_checked_and_evaluated(finished, tmp_path, capsys, quant, max_disagreement):
    run_dir = Path(shutil.copytree(finished, tmp_path / "run"))
    _noisy_adapter(run_dir)
    args = ["export", str(run_dir), "--to", "gguf", "--quant", quant, "--export-adapter", "final", "--max-disagreement", max_disagreement]
    assert cli_main(args) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("export gguf verified: ") and line.endswith(
        f"written to {run_dir / f'gguf-{quant}'}, the check in its export.json"
    )
    folder = run_dir / f"gguf-{quant}"
    assert sorted(p.name for p in folder.iterdir()) == ["export.json", f"model-{quant}.gguf"]  # the merge it came from removed
    check = exporting.read_check(folder)
    assert check.passed and check.loaded_with.startswith("transformers' GGUF loader") and check.max_disagreement == float(max_disagreement)
    if quant == "f16":  # the merged form answers every question as the adapter does (above): so does its f16 file
        assert check.agreement == 1.0 and check.difference == 0.0
    # the eval command on the file gives the export's own figure (the same loader and questions)
    assert cli_main(["eval", str(folder / f"model-{quant}.gguf")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"held-out accuracy {check.export_accuracy:.1%}") and f"reward {check.export_reward:.3f} " in out
    assert f"GGUF {folder / f'model-{quant}.gguf'}, on the held-out set of {run_dir}" in out
    if quant == "f16":  # and the merged folder's figure: the same answers, scored alike
        assert cli_main(["export", str(run_dir), "--to", "merged", "--export-adapter", "final"]) == 0
        capsys.readouterr()
        assert cli_main(["eval", str(run_dir / "merged")]) == 0
        assert capsys.readouterr().out.split(" (n=")[0] == out.split(" (n=")[0]  # accuracy, reward, format


def _gguf_without_the_qk_permutation(merged: Path, out: Path, quant: str) -> None:
    """q_proj and k_proj written in HF's row order: llama.cpp's rotary layout missed."""
    RIGHT_GGUF(merged, out, quant, permute=False)


def _gguf_with_a_plain_chat_template(merged: Path, out: Path, quant: str) -> None:
    """The file's tokenizer.chat_template another model's (roles as plain words)."""
    (merged / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    RIGHT_GGUF(merged, out, quant)


@pytest.mark.parametrize("damage", [_gguf_without_the_qk_permutation, _gguf_with_a_plain_chat_template], ids=["qk-layout", "chat-template"])
def test_a_damaged_gguf_fails_in_one_line_and_leaves_nothing(finished, tmp_path, monkeypatch, capsys, damage):
    monkeypatch.setattr(gguf_writer, "write_gguf", damage)
    _fails_in_one_line_leaving_nothing(finished, tmp_path, capsys, "gguf")


def test_the_gguf_forms_choices_are_refused_clearly(finished, capsys):
    assert cli_main(["export", str(finished), "--to", "gguf", "--quant", "q4_k_m"]) == 2
    assert "--quant 'q4_k_m' is not a type the GGUF export writes; choose one of f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0" in (
        capsys.readouterr().err
    )
    assert cli_main(["export", str(finished), "--to", "merged", "--quant", "q8_0"]) == 2
    assert "--quant is the GGUF form's (--to gguf), not --to merged's" in capsys.readouterr().err


# --------------------------------------------------------------------------- a run's own --export-gguf


def test_a_run_with_export_gguf_leaves_its_checked_gguf_form_where_the_export_command_would(tmp_path, tiny_model_dir, caplog):
    run_dir = tmp_path / "run"
    args = ["--local", "--model", str(tiny_model_dir), *TINY, "--iterations", "1", "--backend", "hf"]
    with caplog.at_level("INFO", logger="grpo_flyte"):
        assert cli_main([*args, "--export-gguf", "f16", "--export-adapter", "final", "--run-dir", str(run_dir)]) == 0
    folder = run_dir / "gguf-f16"
    assert sorted(p.name for p in folder.iterdir()) == ["export.json", "model-f16.gguf"]
    assert not (run_dir / "merged").exists()  # the merge it was written from was not asked for
    check = exporting.read_check(folder)
    assert (check.form, check.path, check.adapter, check.adapter_iteration, check.questions) == ("gguf", str(folder), "final", 1, 6)
    assert check.passed and check.loaded_with.startswith("transformers' GGUF loader")
    # the tiny model's f16 weights are its own: the file answers every question as the adapter does
    assert check.agreement == 1.0 and check.difference == 0.0
    assert any(r.getMessage() == check_line(check) for r in caplog.records)


def test_a_run_with_export_gguf_refuses_a_model_the_writer_cannot_write_before_it_starts(tmp_path, tiny_model_dir):
    from grpo_flyte.config.run import RunConfig
    from grpo_flyte.errors import ConfigError
    from grpo_flyte.launch.preflight import check_model_fits

    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "mistral"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    check_model_fits(RunConfig(model=str(model)), model, None)  # without --export-gguf: any architecture
    with pytest.raises(ConfigError) as info:
        check_model_fits(RunConfig(model=str(model), export_gguf="q8_0"), model, None)
    assert str(info.value).startswith(
        "--export-gguf='q8_0': the GGUF export writes LlamaForCausalLM, Qwen2ForCausalLM, not MistralForCausalLM"
    )
    check_model_fits(RunConfig(model=str(model), export_gguf="q8_0"), model, None, weights=False)  # a Hub model's files: not checked

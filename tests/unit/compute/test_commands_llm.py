"""`omniflow models` and `omniflow generate` end to end (in process, through `engine.cli.main`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_models_list_and_export(capsys, tmp_path: Path):
    code, out, _ = run_cli(capsys, "models", "list", "--json")
    assert code == 0 and {m["name"] for m in json.loads(out)["models"]} >= {"tiny-llama", "tiny-qwen2"}
    code, out, _ = run_cli(capsys, "models", "export", "tiny-qwen2", str(tmp_path / "q"))
    assert code == 0 and (tmp_path / "q" / "model.safetensors").is_file()
    code, _, err = run_cli(capsys, "models", "export", "nope", str(tmp_path / "x"))
    assert code == 1 and "unknown model 'nope'" in err


def test_models_list_marks_real_and_random_weights_without_building_anything(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(tmp_path / "cache"))
    code, out, _ = run_cli(capsys, "models", "list", "--json")
    rows = {m["name"]: m for m in json.loads(out)["models"]}
    assert code == 0 and (rows["smollm2-135m"]["weights"], rows["smollm2-135m"]["weights_label"]) == (
        "real", "real weights")
    assert (rows["smollm2-135m"]["layers"], rows["smollm2-135m"]["hidden"]) == (30, 576)
    assert "llm" in rows["smollm2-135m"]["role_kinds"]
    random = ("tiny-llama", "tiny-qwen2", "tiny-vit", "tiny-audio-encoder", "tiny-vae", "tiny-audio-decoder")
    assert {(rows[n]["weights"], rows[n]["weights_label"]) for n in random} == {
        ("random", "random weights (for testing)")}
    assert rows["tiny-vit"]["role_kinds"] == ["vision_encoder"] and rows["tiny-vit"]["layers"] is None
    code, out, _ = run_cli(capsys, "models", "list")
    assert code == 0 and "smollm2-135m" in out and "[random weights (for testing)]" in out
    assert "tiny-vae" in out and "vae_decoder" in out
    assert not (tmp_path / "cache").exists()


def test_generate_names_the_fix_for_a_corrupt_cache(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.setenv("OMNIFLOW_CACHE_DIR", str(tmp_path))
    (tmp_path / "models" / "smollm2-135m-0.1.2").mkdir(parents=True)  # no manifest: not a complete build
    code, _, err = run_cli(capsys, "generate", "--model", "smollm2-135m", "--prompt", "hi")
    assert code == 1 and "--model 'smollm2-135m'" in err and "has no readable manifest" in err
    assert f"delete the directory {tmp_path / 'models' / 'smollm2-135m-0.1.2'}" in err


def test_generate_json_batches_prompts_in_order_and_reports_cache_hits(capsys, tmp_path: Path):
    prompt = "The quick brown fox jumps over"
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-llama", "--prompt", prompt, "--input-ids", "72,105",
                           "--prompt", prompt, "--max-new-tokens", "6", "--page-size", "4", "--json")
    assert code == 0
    report = json.loads(out)
    results = report["results"]
    assert [r["index"] for r in results] == [0, 1, 2]
    assert [len(r["output_ids"]) for r in results] == [6, 6, 6]
    assert results[0]["output_ids"] == results[2]["output_ids"]
    assert (results[0]["cached_tokens"], results[2]["cached_tokens"]) == (0, 28)
    assert results[1]["prompt_tokens"] == 2 and set(results[0]["timings"]) == {"queue_s", "ttft_s", "total_s"}
    # A checkpoint directory gives the same tokens as the built-in model it was exported from.
    main(["models", "export", "tiny-llama", str(tmp_path / "ckpt")])
    capsys.readouterr()
    code, out, _ = run_cli(capsys, "generate", "--model-path", str(tmp_path / "ckpt"), "--prompt", prompt,
                           "--max-new-tokens", "6", "--json")
    assert code == 0 and json.loads(out)["results"][0]["output_ids"] == results[0]["output_ids"]


def test_seeded_sampling_from_the_command_line_is_reproducible(capsys):
    argv = ("generate", "--model", "tiny-qwen2", "--prompt", "hello", "--max-new-tokens", "12",
            "--temperature", "1.5", "--top-p", "0.9", "--top-k", "50", "--seed", "7", "--json")
    first = json.loads(run_cli(capsys, *argv)[1])["results"][0]["output_ids"]
    second = json.loads(run_cli(capsys, *argv)[1])["results"][0]["output_ids"]
    assert first == second


def test_generate_in_bfloat16(capsys):
    code, out, _ = run_cli(capsys, "generate", "--model", "tiny-llama", "--prompt", "hello", "--max-new-tokens", "6",
                           "--dtype", "bfloat16", "--json")
    assert code == 0 and len(json.loads(out)["results"][0]["output_ids"]) == 6


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "x"], "exactly one of --model NAME or --model-path DIR"),
        (["--model", "tiny-llama"], "at least one --prompt"),
        (["--model", "nope", "--prompt", "x"], "--model 'nope'"),
        (["--model-path", "/nonexistent", "--prompt", "x"], "--model-path '/nonexistent'"),
        (["--model", "tiny-llama", "--input-ids", "1,x"], "--input-ids '1,x'"),
        (["--model", "tiny-llama", "--input-ids", "1,999"], "--input-ids #1"),
        (["--model", "tiny-llama", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["--model", "tiny-llama", "--prompt", "x", "--top-p", "2"], "--top-p"),
        (["--model", "tiny-llama", "--prompt", "x", "--page-size", "0"], "--page-size"),
    ],
)
def test_bad_input_exits_1_naming_the_flag(capsys, argv, message):
    code, _, err = run_cli(capsys, "generate", *argv)
    assert code == 1 and message in err, err

import json
import subprocess
import sys
from dataclasses import dataclass

import pytest

from llmkit import analyze, get_preset
from llmkit.cli import main
from llmkit.cli.app import run as run_commands


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_json_has_the_documented_keys(capsys):
    code, out, _ = run(capsys, "inspect", "deepseek-v3", "--json", "--seq-len", "4096")
    assert code == 0
    data = json.loads(out)
    for key in ("params_total", "params_active", "kv_cache_bytes_per_token", "flops_per_token"):
        assert key in data
    ref = analyze(get_preset("deepseek-v3"), "deepseek-v3", 4096, "bf16")
    assert data["params_total"] == ref.params_total == 671_026_419_200
    assert data["kv_cache_elements_per_token_per_layer"] == 576
    assert data["kv_cache_bytes"] == 4096 * data["kv_cache_bytes_per_token"]


def test_inspect_text_and_dtype(capsys):
    code, out, _ = run(capsys, "inspect", "llama2-7b", "--dtype", "fp32")
    assert code == 0
    assert "6,738,415,616" in out and "weights (fp32)" in out and "attention" in out


def test_inspect_compare_side_by_side(capsys):
    code, out, _ = run(capsys, "inspect", "--compare", "llama2-7b,llama2-70b,deepseek-v3")
    assert code == 0
    header = out.splitlines()[0]
    assert "llama2-7b" in header and "llama2-70b" in header and "deepseek-v3" in header
    code, out, _ = run(capsys, "inspect", "--compare", "gpt2,mixtral-8x7b", "--json")
    assert [r["name"] for r in json.loads(out)] == ["gpt2", "mixtral-8x7b"]


def test_inspect_reads_a_config_file(capsys, tmp_path):
    path = tmp_path / "mine.json"
    get_preset("gpt2-tiny").to_json(path)
    code, out, _ = run(capsys, "inspect", str(path), "--json")
    assert code == 0 and json.loads(out)["name"] == "mine"


def test_presets_lists_every_preset(capsys):
    code, out, _ = run(capsys, "presets", "--json")
    names = [r["name"] for r in json.loads(out)]
    assert code == 0 and "deepseek-v3.2" in names and "transformer-base-tiny" in names


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["inspect", "llama-9000"], "unknown preset 'llama-9000'"),
        (["inspect"], "give a preset or config file"),
        (["inspect", "gpt2", "--seq-len", "0"], "seq_len=0 must be >= 1"),
        (["inspect", "missing.json"], "config file 'missing.json' does not exist"),
        (["inspect", "--compare", ","], "--compare ',' names no model"),
        (["inspect", "--compare", "gpt2", "--seq-len", "0"], "seq_len=0 must be >= 1"),
    ],
)
def test_errors_are_reported_without_a_traceback(capsys, argv, fragment):
    code, _, err = run(capsys, *argv)
    assert code == 2 and fragment in err and "Traceback" not in err


def test_binary_config_file_is_a_clear_error(capsys, tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    code, _, err = run(capsys, "inspect", str(path))
    assert code == 2 and "is not UTF-8 text" in err


def test_bad_flag_values_are_rejected_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["inspect", "gpt2", "--dtype", "int4"])
    assert "invalid choice" in capsys.readouterr().err


def test_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "llmkit", "inspect", "gpt2", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["params_total"] == 124_439_808


@dataclass(frozen=True)
class Knobs:
    """Two knobs, set together.

    level: how far to turn.
    names: a repeatable name.
    """

    level: int = 1
    names: list[str] | None = None


def toy_cmd(path: str, *, loud: bool = False, knobs: Knobs = Knobs()) -> int:
    """A toy command.

    path: where to look.
    loud: say more.
    """
    print(path, loud, knobs)
    return 0


def test_a_dataclass_parameter_is_a_group_of_flags(capsys):
    assert run_commands([toy_cmd], ["toy-cmd", "here", "--level", "3", "--names", "a", "--names", "b", "--loud"]) == 0
    assert capsys.readouterr().out == f"here True {Knobs(3, ['a', 'b'])}\n"
    run_commands([toy_cmd], ["toy-cmd", "there"])
    assert capsys.readouterr().out == f"there False {Knobs()}\n"
    with pytest.raises(SystemExit):
        run_commands([toy_cmd], ["toy-cmd", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "knobs: Two knobs, set together. --level LEVEL how far to turn." in help_text
    assert "--loud say more." in help_text


def test_help_lists_the_commands_by_concern_and_generate_groups_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "models:\n  presets" in out and "generation:\n  generate" in out and "training:\n  train" in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for group in ("sampling:", "output:", "beam search:", "speculation:"):
        assert f"\n{group}\n" in out
    for flag in ("--temperature", "--top-k", "--min-p", "--stop", "--stream", "--beams", "--draft", "--mtp"):
        assert flag in out


def test_inspect_tp_reports_each_ranks_part(capsys):
    code, out, _ = run(capsys, "inspect", "llama2-70b", "--tp", "8", "--json")
    assert code == 0
    tp = json.loads(out)["tensor_parallel"]
    whole, ranks = tp["weight_bytes_whole"], tp["weight_bytes"]
    assert len(ranks) == 8 and all(whole / 8 <= r <= whole / 8 * 1.01 for r in ranks)  # norms whole on every rank
    assert tp["kv_cache_bytes_per_token"] == [tp["kv_cache_bytes_per_token_whole"] // 8] * 8  # 8 kv heads, 1 each
    assert tp["all_reduces_per_token"] == 2 * 80 + 1  # after attention and feed-forward in 80 blocks, and the embedding
    assert tp["all_reduce_bytes_per_token"] == 161 * 8192 * 2
    code, out, _ = run(capsys, "inspect", "deepseek-v3", "--tp", "8")
    assert code == 0 and "split 8 ways" in out and "KV cache / token / rank" in out
    code, _, err = run(capsys, "inspect", "mixtral-8x22b", "--tp", "3")
    assert code == 2 and "8 key/value heads" in err and err.rstrip().endswith("sizes that would: 1, 2, 4, 8")

"""The one rule for every output path (data/files.py, docs/bad-inputs.md "Nothing overwritten or
mixed up"): an earlier output of the same kind is replaced when named again, nothing else is ever
written over, renamed over or removed. The refusals are catalogue cases (tests/test_bad_inputs.py)."""

import json

import pytest
import torch

import plot
from bench.arguments import BenchArguments, write_json
from bench.gpu import check_report_folder, write_report
from data.files import atomic_open
from data.tokenizer import GPT2Tokenizer
from interop.pretrained import EXPORT_FILES, GENERATION_CONFIG_NAME, export_model
from tests.conftest import run_entry_point, snapshot, tiny_config, tiny_model
from trainer.checkpoint import save_checkpoint
from trainer.loop import Trainer


def test_a_users_tmp_file_is_never_touched_by_a_write_beside_it(tmp_path):
    users = {"notes.txt.tmp": b"mine", ".notes.txt.tmp": b"mine too"}
    for name, content in users.items():
        (tmp_path / name).write_bytes(content)
    with atomic_open(tmp_path / "notes.txt") as f:
        f.write(b"written")
    with pytest.raises(RuntimeError), atomic_open(tmp_path / "other.txt") as f:
        f.write(b"half")
        raise RuntimeError("a write that fails half way")
    assert snapshot(tmp_path) == users | {"notes.txt": b"written"}


def test_export_leaves_the_other_files_of_its_folder_alone(tmp_path):
    folder = tmp_path / "exported"
    folder.mkdir()
    users = {"model.safetensors.tmp": b"a download of mine", "README.md": b"# my notes\n"}
    for name, content in users.items():
        (folder / name).write_bytes(content)
    export_model(tiny_model(vocab_size=GPT2Tokenizer().vocab_size), GPT2Tokenizer(), folder)
    written = snapshot(folder)
    assert {name: written[name] for name in users} == users
    assert set(written) == set(users) | set(EXPORT_FILES) - {GENERATION_CONFIG_NAME}  # a chat model's only


def test_keep_checkpoints_never_removes_a_file_it_did_not_write(tmp_path):
    users = {"ckpt_best.pt": b"my best", "ckpt_notes.pt": b"mine", "ckpt_1.pt": b"mine too"}
    for name, content in users.items():
        (tmp_path / name).write_bytes(content)
    for step in (1, 2, 3):
        save_checkpoint({"step": step}, tmp_path / "ckpt.pt", keep=2)
    files = snapshot(tmp_path)
    assert {name: files[name] for name in users} == users
    assert sorted(set(files) - set(users)) == ["ckpt.pt", "ckpt_00000002.pt", "ckpt_00000003.pt"]
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 3


def test_eval_json_goes_into_a_new_folder_and_replaces_an_earlier_results_file(tmp_path, data_dir, monkeypatch, capsys):
    Trainer(tiny_config(tmp_path / "run", data_dir, train__max_iters=2)).fit()
    (tmp_path / "items.jsonl").write_text('{"ctx": "ROMEO:", "endings": ["Peace!", "Away!"], "label": 0}\n')
    monkeypatch.chdir(tmp_path)
    out = "results/out.json"  # in a folder made for it
    argv = ["--out-dir", "run", "--device", "cpu", "--no-progress", "--tasks", "items.jsonl", "--json", out]
    for _ in range(2):  # the second run replaces the first one's file
        assert run_entry_point("eval.py", argv, monkeypatch) == 0, capsys.readouterr().err
    assert set(json.loads((tmp_path / out).read_text())) == {"tasks", "centred_mean"}


def test_plot_replaces_its_earlier_picture(tmp_path):
    out = tmp_path / "mask.png"
    plot.main(["mask", "--size", "8", "--out", str(out)])
    first = out.read_bytes()
    plot.main(["mask", "--size", "8", "--model.attn_window=2", "--out", str(out)])
    assert out.read_bytes() != first
    assert [p.name for p in tmp_path.iterdir()] == ["mask.png"]


def test_a_bench_json_replaces_its_earlier_figures(tmp_path):
    parser = BenchArguments("a bench script")
    parser.add_json_output("--json", ("rows",))
    out = tmp_path / "figures.json"
    write_json(out, {"rows": [1], "seconds": 2.0})
    assert parser.parse_args(["--json", str(out)]).json == out


def test_a_gpu_report_folder_takes_an_earlier_report_again(tmp_path):
    report = dict(started="now", command="python bench/gpu.py", smoke=True, parts=[])
    write_report(tmp_path, report)
    (tmp_path / "log.txt").write_text("the parts' output\n")
    check_report_folder(tmp_path)

import os

import pytest
import torch

import trainer.checkpoint as checkpoint_module
from errors import ConfigError, UserError
from inference.load import latest_run, model_from_checkpoint
from tests.conftest import tiny_config
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.loop import Trainer


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, data_dir):
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=10)).fit()
    return run_dir


class RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_checkpoint_round_trip_restores_the_model(trained_run, data_dir, tmp_path):
    path = trained_run / "ckpt.pt"
    checkpoint = load_checkpoint(path)
    model, tokenizer = model_from_checkpoint(checkpoint, path)
    trainer = Trainer(tiny_config(trained_run, data_dir, train__init_from="resume"))
    idx = torch.tensor([tokenizer.encode("ROMEO:")])
    torch.testing.assert_close(model(idx)[0], trainer.model.eval()(idx)[0], rtol=0, atol=0)
    assert tokenizer.decode(tokenizer.encode("ROMEO:")) == "ROMEO:"

    copy = tmp_path / "copy.pt"
    save_checkpoint(checkpoint, copy)
    again = load_checkpoint(copy)
    assert again["step"] == checkpoint["step"] == 10
    assert all(torch.equal(again["model"][k], v) for k, v in checkpoint["model"].items())


@pytest.mark.parametrize("norm,qk_norm", [("layernorm", False), ("rmsnorm", True), ("rmsnorm", False)])
def test_format_2_checkpoint_reads_where_its_meaning_is_unchanged(trained_run, tmp_path, norm, qk_norm):
    """Format 2's QK-norm was always RMSNorm: only a LayerNorm model with QK-norm means something
    else now (that one is refused: tests/test_bad_inputs.py)."""
    checkpoint = torch.load(trained_run / "ckpt.pt", weights_only=True)
    checkpoint["config"]["model"].update(norm=norm, qk_norm=qk_norm)
    path = tmp_path / "format2.pt"
    torch.save(checkpoint | {"format_version": 2}, path)
    assert load_checkpoint(path)["config"]["model"]["qk_norm"] == qk_norm


def test_checkpoint_is_plain_data_loadable_with_weights_only(trained_run):
    checkpoint = torch.load(trained_run / "ckpt.pt", weights_only=True)
    assert {"model", "optimizer", "scaler", "rng", "step", "config", "dataset"} <= checkpoint.keys()


def test_checkpoint_with_pickled_code_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "payload": RunsCodeWhenUnpickled()}, path)
    with pytest.raises(UserError, match="refused to load .*could run code"):
        load_checkpoint(path)
    assert "this ran while loading" not in capsys.readouterr().out


def test_truncated_checkpoint_is_a_clear_error(trained_run, tmp_path):
    path = tmp_path / "truncated.pt"
    data = (trained_run / "ckpt.pt").read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="truncated.pt is not a readable checkpoint"):
        load_checkpoint(path)


def test_foreign_file_is_not_taken_for_a_checkpoint(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    with pytest.raises(UserError, match="not a checkpoint written by this trainer"):
        load_checkpoint(path)
    text = tmp_path / "notes.pt"
    text.write_text("hello")
    with pytest.raises(UserError, match="not a readable checkpoint"):
        load_checkpoint(text)


def test_checkpoint_whose_weights_do_not_fit_its_config_is_a_clear_error(trained_run):
    checkpoint = load_checkpoint(trained_run / "ckpt.pt")
    checkpoint["config"]["model"]["n_embd"] = 64
    with pytest.raises(UserError, match=r"transformer.wte.weight has shape \(65, 32\), the model needs \(65, 64\)"):
        model_from_checkpoint(checkpoint, trained_run / "ckpt.pt")
    checkpoint["config"]["model"]["colour"] = "blue"
    with pytest.raises(ConfigError, match="unknown config key model.colour"):
        model_from_checkpoint(checkpoint, trained_run / "ckpt.pt")


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(trained_run, tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    path.write_bytes((trained_run / "ckpt.pt").read_bytes())
    before = path.read_bytes()

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module.torch, "save", crash)
    with pytest.raises(UserError, match=r"the checkpoint of step 99 could not be written .*\(disk full\)"):
        save_checkpoint({"step": 99}, path)
    assert path.read_bytes() == before
    assert load_checkpoint(path)["step"] == 10
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind


def test_a_disk_that_fills_while_keeping_checkpoints_leaves_the_latest_loadable(trained_run, tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    save_checkpoint(load_checkpoint(trained_run / "ckpt.pt"), path, keep=2)
    before = path.read_bytes()

    def disk_full(source, f):
        f.write(source.read(1000))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module.shutil, "copyfileobj", disk_full)  # ckpt.pt's copy of the new step
    with pytest.raises(UserError, match="the checkpoint of step 20 could not be written .*No space left"):
        save_checkpoint(load_checkpoint(path) | {"step": 20}, path, keep=2)
    assert path.read_bytes() == before
    assert load_checkpoint(path)["step"] == 10
    assert not list(tmp_path.glob("*.tmp"))


def test_latest_run_is_the_most_recent_checkpoint(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "ckpt.pt").write_bytes(b"")
    os.utime(tmp_path / "b" / "ckpt.pt", (2e9, 2e9))  # written last
    assert latest_run(tmp_path) == tmp_path / "b"
    with pytest.raises(UserError, match="no run with a checkpoint under"):
        latest_run(tmp_path / "a")

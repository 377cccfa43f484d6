"""plot.py: the pictures are valid PNG files that show the pattern, and the attention weights they
draw come from the explicit path of attention (exact zeros where blocked, rows summing to 1); every
picture the docs show is drawn by the plot.py command written beside it."""

import dataclasses
import re
import shlex
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch

import plot
from errors import UserError
from model import attention, attention_weights
from tests.conftest import PROJECT_ROOT, tiny_config, tiny_model
from tests.test_masks import EOT, PATTERNS
from trainer.loop import Trainer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def draw(tmp_path, name: str, *args: str) -> np.ndarray:
    out = tmp_path / f"{name}.png"
    plot.main(["mask", "--size", "12", "--out", str(out), *args])
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    return matplotlib.image.imread(out)


def test_mask_pictures_are_png_files_that_differ_between_patterns(tmp_path):
    pictures = {
        "causal": draw(tmp_path, "causal"),
        "window": draw(tmp_path, "window", "--model.attn_window=3"),
        "block": draw(tmp_path, "block", "--model.attn_block=4"),
        "documents": draw(tmp_path, "documents", "--model.attn_documents"),
    }
    names = list(pictures)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            a, b = pictures[first], pictures[second]
            assert a.shape != b.shape or not np.array_equal(a, b), (first, second)


def test_every_pattern_drawn_side_by_side(tmp_path):
    single = draw(tmp_path, "single")
    every = draw(tmp_path, "every", "--all")
    assert every.shape[1] > 5 * single.shape[1] // 2  # seven panels are far wider than one


def test_mask_of_the_rule_is_what_is_drawn():
    config = tiny_model(50, 16, attn_window=3).config
    mask = plot.pattern_mask(config, 6, prefix=2, documents_at=[])
    expected = torch.tensor([[j <= i and i - j < 3 for j in range(6)] for i in range(6)])
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("name", PATTERNS)
def test_weights_of_every_layer_are_zero_where_blocked_and_rows_sum_to_one(name):
    model = tiny_model(50, 16, **PATTERNS[name])
    ids = torch.randint(0, 50, (16,), generator=torch.Generator().manual_seed(0))
    ids[[5, 11]] = EOT
    weights = plot.attention_maps(model, ids.tolist())  # (L, H, T, T)
    prefix = torch.tensor([16]) if PATTERNS[name].get("attn_prefix_lm") else None
    slots = torch.arange(16)
    mask = model.attention_mask(ids[None], slots[None], slots, None, None, prefix)
    allowed = torch.ones(16, 16, dtype=torch.bool).tril() if mask is None else mask[0, 0]
    assert torch.all(weights[..., ~allowed] == 0)
    assert torch.all(weights[..., allowed] > 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), rtol=0, atol=1e-6)


def test_weights_path_gives_what_attention_applies():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))
    mask = torch.rand(2, 1, 7, 7) < 0.5
    mask |= torch.eye(7, dtype=torch.bool)  # no empty row
    weights = attention_weights(q, k, mask)
    torch.testing.assert_close(weights @ v, attention(q, k, v, mask), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_attention_of_a_trained_run_is_drawn_per_head_and_averaged(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    Trainer(tiny_config(run_dir, data_dir, model__attn_window=4, train__max_iters=2, train__eval_iters=1)).fit()
    heads, average = tmp_path / "heads.png", tmp_path / "average.png"
    plot.main(["attention", "--out-dir", str(run_dir), "--prompt", "ROMEO: hi", "--out", str(heads)])
    plot.main(["attention", "--out-dir", str(run_dir), "--prompt", "ROMEO: hi", "--out", str(average), "--average"])
    grid, single = matplotlib.image.imread(heads), matplotlib.image.imread(average)
    assert grid.shape[0] > single.shape[0]  # 2 layers x 2 heads: two rows of heatmaps


def test_a_picture_file_must_be_png_in_an_existing_folder(tmp_path):
    with pytest.raises(UserError, match="must name a .png file"):
        plot.main(["mask", "--out", str(tmp_path / "mask.jpg")])
    with pytest.raises(UserError, match="does not exist"):
        plot.main(["mask", "--out", str(tmp_path / "missing" / "mask.png")])


def every_mask(size: int) -> list[torch.Tensor]:
    """The --all panels' masks at size positions, with the default prefix and document starts."""
    plain = dataclasses.replace(tiny_model(50, 16).config, **plot.PLAIN_CAUSAL)
    configs = [dataclasses.replace(plain, **keys) for keys in plot.every_pattern(size).values()]
    return [plot.pattern_mask(config, size, max(1, size // 3), [size // 3, 2 * size // 3]) for config in configs]


def test_every_pattern_is_drawn_only_where_the_pictures_differ(tmp_path):
    """--all at a tiny --size drew seven pictures of which several were one, and with a block_size of 1
    or 2 ended in a ValueError traceback (2 sinks in a context of 1 or 2); ALL_MIN_SIZE is the least
    size at which the seven differ."""
    distinct = [len({tuple(mask.flatten().tolist()) for mask in every_mask(size)}) for size in range(1, 13)]
    assert distinct.index(7) + 1 == plot.ALL_MIN_SIZE == 7 and min(distinct[6:]) == 7
    for size in (1, 2, 6):
        with pytest.raises(UserError, match=rf"^--all --size={size} is too few positions .* use --size 7 or more$"):
            plot.main(["mask", "--all", "--size", str(size), "--out", str(tmp_path / "all.png")])
    with pytest.raises(UserError, match="; model.block_size=2 holds fewer: draw its one pattern without --all$"):
        plot.main(["mask", "--all", "--model.block_size=2", "--size", "2", "--out", str(tmp_path / "all.png")])
    assert not (tmp_path / "all.png").exists()


def test_every_pattern_is_drawn_whatever_the_configs_document_positions(tmp_path):
    """--all resets every pattern key, attn_document_positions with attn_documents (it needs them)."""
    plot.main(["mask", "--all", "--model.attn_documents", "--model.attn_document_positions", "--model.eot_token=0",
               "--out", str(tmp_path / "all.png")])  # fmt: skip
    assert (tmp_path / "all.png").read_bytes().startswith(PNG_SIGNATURE)


PICTURE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")  # a Markdown image: ![alt](path.png)
COMMAND = re.compile(r"`python (plot\.py [^`]+)`")


def pictures_shown() -> list[tuple[str, Path, list[list[str]]]]:
    """(page, picture's path from the project root, the plot.py commands in the 3 lines after its link)
    for every picture README.md and the docs pages show."""
    shown = []
    for page in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").rglob("*.md"))]:
        lines = page.read_text().splitlines()
        for number, line in enumerate(lines):
            for link in PICTURE.findall(line):
                picture = (page.parent / link).resolve().relative_to(PROJECT_ROOT)
                beside = " ".join(lines[number + 1 : number + 4])
                commands = [shlex.split(command)[1:] for command in COMMAND.findall(beside)]
                shown.append((page.name, picture, commands))
    return shown


def test_every_picture_the_docs_show_is_drawn_by_the_command_beside_it(tmp_path):
    shown = pictures_shown()
    assert {picture for _, picture, _ in shown} >= {Path("docs/ablation.png"), Path("docs/patterns/all.png")}
    for page, picture, commands in shown:
        assert (PROJECT_ROOT / picture).is_file(), (page, picture)
        drawing = [argv for argv in commands if "--out" in argv and Path(argv[argv.index("--out") + 1]) == picture]
        assert len(drawing) == 1, f"{page}: not one `python plot.py ... --out {picture}` beside the picture"
        argv = drawing[0]
        out = tmp_path / picture.name
        argv[argv.index("--out") + 1] = str(out)
        if argv[0] == "loss":  # its runs come from the ablation (bench/ablation.py): the command must parse
            plot.parse_args(argv)
        else:
            plot.main(argv)
            assert out.read_bytes().startswith(PNG_SIGNATURE), (page, picture)

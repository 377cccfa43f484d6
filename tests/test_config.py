import dataclasses
import json
import re
from pathlib import Path

import pytest

from errors import ConfigError
from trainer.config import (
    SECTIONS,
    Config,
    config_help,
    config_to_toml,
    default_values,
    field_comments,
    idle_keys,
    load_config,
    unfinished_schedule,
)

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_precedence_is_defaults_then_file_then_command_line(tmp_path):
    path = write(tmp_path, "[model]\nn_layer = 4\nn_head = 4\n[optim]\nlearning_rate = 1e-3\n")
    cfg = load_config(path, ["--model.n_head=2", "--train.max_iters", "7000"])
    assert cfg.model.n_layer == 4  # file over default
    assert cfg.model.n_head == 2  # command line over file
    assert cfg.optim.learning_rate == 1e-3  # file
    assert cfg.train.max_iters == 7000  # command line, space-separated form
    assert cfg.model.n_embd == Config().model.n_embd  # default


def test_no_config_file_gives_the_defaults():
    assert load_config(None, []) == Config()


def test_bare_boolean_flag_means_true():
    cfg = load_config(None, ["--train.compile", "--model.bias=false"])
    assert cfg.train.compile is True
    assert cfg.model.bias is False


def test_int_is_accepted_where_a_float_is_expected(tmp_path):
    cfg = load_config(write(tmp_path, "[optim]\nlearning_rate = 1\n"), [])
    assert cfg.optim.learning_rate == 1.0 and isinstance(cfg.optim.learning_rate, float)


def test_unknown_key_is_rejected_with_the_valid_keys(tmp_path):
    path = write(tmp_path, "[model]\nn_layers = 4\n")
    with pytest.raises(ConfigError, match=r"unknown config key model.n_layers \(did you mean model.n_layer\?.*n_head"):
        load_config(path, [])
    with pytest.raises(ConfigError, match="unknown config key train.max_iter "):
        load_config(None, ["--train.max_iter=3"])


def test_unknown_section_is_rejected_with_the_valid_sections(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config section \[training\].*model, data, optim, train, wandb"):
        load_config(write(tmp_path, "[training]\nmax_iters = 4\n"), [])
    with pytest.raises(ConfigError, match=r"unknown config section \[modle\] in the command line"):
        load_config(None, ["--modle.n_layer=4"])


def test_key_outside_any_section_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match=r"n_layer = 4 .* is outside any section"):
        load_config(write(tmp_path, "n_layer = 4\n"), [])


@pytest.mark.parametrize(
    "text,message",
    [
        ('[model]\nn_layer = "four"\n', r"model.n_layer='four' in .* is not an integer"),
        ("[model]\nn_layer = 4.5\n", r"model.n_layer=4.5 in .* is not an integer"),
        ("[model]\nn_layer = true\n", r"model.n_layer=True in .* is not an integer"),
        ('[optim]\nlearning_rate = "fast"\n', r"optim.learning_rate='fast' in .* is not a number"),
        ("[train]\ncompile = 1\n", r"train.compile=1 in .* is not true or false"),
        ("[train]\ndevice = 0\n", r"train.device=0 in .* is not a string"),
    ],
)
def test_wrong_type_in_file_names_key_value_and_type(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), [])


@pytest.mark.parametrize(
    "override,message",
    [
        ("--model.n_layer=four", r"model.n_layer='four' on the command line is not an integer"),
        ("--optim.learning_rate=fast", r"optim.learning_rate='fast' on the command line is not a number"),
        ("--train.compile=maybe", r"train.compile='maybe' on the command line is not true or false"),
    ],
)
def test_wrong_type_on_command_line_names_key_value_and_type(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize(
    "override,message",
    [
        (["--model.n_embd=100", "--model.n_head=3"], r"model.n_embd=100 is not divisible by n_head=3 \(choose"),
        (["--model.n_layer=0"], "model.n_layer=0 must be a positive integer"),
        (["--model.block_size=-8"], "model.block_size=-8 must be a positive integer"),
        (["--data.batch_size=0"], "data.batch_size=0 must be a positive integer"),
        (["--train.max_iters=0"], "train.max_iters=0 must be a positive integer"),
        (["--train.dtype=fp8"], "train.dtype='fp8' is not one of auto, float32, bfloat16, float16"),
        (["--train.device=gpu"], "train.device='gpu' is not one of auto, cpu, cuda, cuda:N, mps"),
        (["--train.threads=-1"], r"train.threads=-1 must be 0 \(chosen from the free cores\) or positive"),
        (
            ["--train.init_from="],
            "train.init_from='' is not one of scratch, resume or a Hugging Face model folder or hub id",
        ),
        (["--optim.min_lr=1", "--optim.learning_rate=0.1"], "optim.min_lr=1.0 must be between 0 and learning_rate=0.1"),
        (
            ["--optim.warmup_iters=10", "--optim.lr_decay_iters=5"],
            "optim.lr_decay_iters=5 must be at least warmup_iters=10",
        ),
        (["--wandb.mode=cloud"], "wandb.mode='cloud' is not one of online, offline"),
    ],
)
def test_invalid_value_names_key_value_and_what_is_accepted(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, override)


@pytest.mark.parametrize(
    "key,last_accepted,first_refused,also",
    [
        ("train.threads", 1024, 1025, []),
        ("train.max_iters", 10**12, 10**12 + 1, []),
        ("train.eval_interval", 10**12, 10**12 + 1, []),
        ("train.log_interval", 10**12, 10**12 + 1, []),
        ("optim.lr_decay_iters", 10**12, 10**12 + 1, []),
        ("train.gradient_accumulation_steps", 10**6, 10**6 + 1, []),
        ("train.eval_iters", 10**6, 10**6 + 1, []),
        ("optim.learning_rate", 1.0, 1.5, []),
        ("optim.learning_rate", 1e-9, 5e-10, ["--optim.min_lr=0"]),
        ("optim.muon_lr", 1.0, 1.5, []),
        ("optim.muon_lr", 1e-9, 5e-10, []),
        ("model.rope_base", 1e12, 2e12, []),
    ],
)
def test_numbers_are_accepted_to_the_end_of_their_range_and_refused_past_it(key, last_accepted, first_refused, also):
    section, name = key.split(".")
    assert getattr(getattr(load_config(None, [f"--{key}={last_accepted}", *also]), section), name) == last_accepted
    with pytest.raises(ConfigError, match=rf"^{re.escape(f'{key}={first_refused}')} .*accepted range"):
        load_config(None, [f"--{key}={first_refused}", *also])


def test_lr_decay_follows_max_iters_unless_set():
    quickstart = str(PROJECT_ROOT / "configs" / "shakespeare_char.toml")
    assert load_config(quickstart, ["--train.max_iters=300"]).optim.lr_decay_iters == 300
    assert load_config(None, []).optim.lr_decay_iters == Config().train.max_iters
    explicit = load_config(quickstart, ["--train.max_iters=300", "--optim.lr_decay_iters=1000"])
    assert explicit.optim.lr_decay_iters == 1000
    # --help and the README show the key's own default, 0; the built tree holds the resolved number
    assert default_values()["optim"]["lr_decay_iters"] == 0
    assert re.search(r"^  lr_decay_iters +int +0 +step at which", config_help(), re.MULTILINE)


def test_a_saved_config_keeps_the_decay_it_resolved(tmp_path):
    """config.toml holds the number: resuming from it reproduces the schedule, and raising max_iters
    there trains on at min_lr instead of stretching the decay of the steps already taken."""
    cfg = load_config(str(PROJECT_ROOT / "configs" / "shakespeare_char.toml"), ["--train.max_iters=300"])
    saved = write(tmp_path, config_to_toml(cfg))
    assert "lr_decay_iters = 300" in Path(saved).read_text().splitlines()
    assert load_config(saved, []) == cfg
    assert load_config(saved, ["--train.max_iters=600"]).optim.lr_decay_iters == 300


@pytest.mark.parametrize(
    "max_iters,decay_ends,where",
    [
        (40, 50, "inside its warmup of optim.warmup_iters=50 steps"),  # cosine: the decay cannot end before warmup
        (80, 100, "before its decay to min_lr ends at optim.lr_decay_iters=100"),  # wsd: the decay starts at 50
    ],
)
def test_a_run_too_short_for_its_warmup_keeps_its_recipe_and_says_so(max_iters, decay_ends, where):
    """Shortening a run for a quick try takes one override: the warmup is not cut to fit nor the run
    refused; the decay is placed at the shortest length the recipe allows and a note says where the
    schedule stands at the last step."""
    quickstart = str(PROJECT_ROOT / "configs" / "shakespeare_char.toml")  # warmup 50, wsd cooldown 0.5
    schedule = "cosine" if max_iters == 40 else "wsd"
    cfg = load_config(quickstart, [f"--train.max_iters={max_iters}", f"--optim.schedule={schedule}"])
    assert cfg.optim.warmup_iters == 50 and cfg.optim.lr_decay_iters == decay_ends
    assert unfinished_schedule(cfg) == (
        f"the run ends at train.max_iters={max_iters}, {where}; a shorter optim.warmup_iters (0 for none) "
        "fits the whole schedule in the run"
    )
    fits = load_config(quickstart, [f"--train.max_iters={max_iters}", "--optim.warmup_iters=0"])
    assert fits.optim.lr_decay_iters == max_iters and unfinished_schedule(fits) is None


@pytest.mark.parametrize("decay,lr", [("weight_decay", "learning_rate"), ("muon_weight_decay", "muon_lr")])
def test_weight_decay_that_would_erase_the_weights_in_one_step_is_refused(decay, lr):
    load_config(None, [f"--optim.{lr}=0.01", f"--optim.{decay}=99"])  # each step keeps 1% of a weight
    with pytest.raises(ConfigError, match=rf"optim.{decay}=100.0 with {lr}=0.01 would multiply every decayed weight"):
        load_config(None, [f"--optim.{lr}=0.01", f"--optim.{decay}=100"])


def test_logit_cap_below_one_is_refused_and_one_is_accepted():
    assert load_config(None, ["--model.logit_softcap=1"]).model.logit_softcap == 1.0
    with pytest.raises(ConfigError, match=r"model.logit_softcap=0.5 must be 0 \(off\) or at least 1"):
        load_config(None, ["--model.logit_softcap=0.5"])


def test_sizes_and_lengths_of_real_runs_are_accepted():
    gpt2_xl = ["--model.n_layer=48", "--model.n_head=25", "--model.n_embd=1600", "--model.vocab_size=50304"]
    long_run = ["--train.max_iters=1000000", "--optim.lr_decay_iters=1000000", "--train.eval_iters=10000"]
    big_machine = ["--data.batch_size=1024", "--train.gradient_accumulation_steps=4096", "--train.threads=512"]
    modern = ["--model.pos_emb=rope", "--model.rope_base=500000", "--optim.optimizer=muon", "--optim.muon_lr=0.05"]
    cfg = load_config(None, [*gpt2_xl, *long_run, *big_machine, *modern, "--optim.learning_rate=1e-2"])
    assert (cfg.model.n_layer, cfg.train.max_iters, cfg.train.threads, cfg.model.rope_base) == (48, 10**6, 512, 5e5)


def test_every_shipped_config_loads_without_settings_that_do_nothing():
    for path in sorted((PROJECT_ROOT / "configs").glob("*.toml")):
        assert idle_keys(load_config(str(path), [])) is None, path.name


def test_settings_that_do_nothing_are_named_in_one_notice():
    assert idle_keys(Config()) is None
    # the quickstart switched back to the GPT-2 recipe keeps its muon_*, cooldown_frac and rope_base
    switched = ["--optim.optimizer=adamw", "--optim.schedule=cosine", "--model.pos_emb=learned"]
    extra = ["--model.rope_base=500000", "--model.attn_sinks=4", "--model.eot_token=0", "--wandb.project=x"]
    note = idle_keys(load_config(str(PROJECT_ROOT / "configs" / "shakespeare_char.toml"), [*switched, *extra]))
    assert note.startswith("these settings do nothing in this run: ") and "\n" not in note
    for fragment in [
        "optim.muon_lr=0.015, optim.muon_ns_steps=3, optim.muon_ns_smallest=0.001, optim.muon_normuon=true (only with "
        "optim.optimizer='muon')",
        "optim.cooldown_frac=0.5 (only with optim.schedule='wsd')",
        "model.rope_base=500000.0 (only with model.pos_emb='rope')",
        "model.attn_sinks=4 (only with a model.attn_window below block_size",
        "model.eot_token=0 (only with model.attn_documents=true)",
        'wandb.project="x" (only with wandb.enabled=true)',
    ]:
        assert fragment in note
    # a window as long as the context cuts nothing, and sinks beside it keep nothing in view
    whole = idle_keys(load_config(None, ["--model.block_size=64", "--model.attn_window=64", "--model.attn_sinks=2"]))
    assert "model.attn_window=64 (only with a value below model.block_size" in whole
    assert "model.attn_sinks=2 (only with a model.attn_window below block_size" in whole
    assert (
        idle_keys(load_config(None, ["--model.block_size=64", "--model.attn_window=63", "--model.attn_sinks=2"]))
        is None
    )


def test_optimizer_switches_that_do_nothing_are_named():
    adamw = idle_keys(load_config(None, ["--optim.muon_normuon=true"]))
    assert "optim.muon_normuon=true (only with optim.optimizer='muon')" in adamw
    without_normuon = idle_keys(load_config(None, ["--optim.optimizer=muon", "--optim.muon_beta2=0.9"]))
    assert "optim.muon_beta2=0.9 (only with optim.optimizer='muon' and optim.muon_normuon=true)" in without_normuon
    no_decay = idle_keys(load_config(None, ["--optim.weight_decay=0", "--optim.cautious_weight_decay=true"]))
    assert "optim.cautious_weight_decay=true (only with a weight decay" in no_decay
    muon_decays = ["--optim.optimizer=muon", "--optim.weight_decay=0", "--optim.muon_weight_decay=0.1"]
    assert idle_keys(load_config(None, [*muon_decays, "--optim.cautious_weight_decay=true"])) is None


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_rejected(tmp_path, text):
    with pytest.raises(ConfigError, match=rf"optim.weight_decay='{text}' on the command line is not a finite number"):
        load_config(None, [f"--optim.weight_decay={text}"])
    with pytest.raises(ConfigError, match=r"train.grad_clip=.* in .* is not a finite number"):
        load_config(write(tmp_path, f"[train]\ngrad_clip = {text}\n"), [])


def test_negative_number_is_read_as_a_value():
    with pytest.raises(ConfigError, match="optim.weight_decay=-1.0 must be 0 or more"):
        load_config(None, ["--optim.weight_decay", "-1"])


def test_override_without_a_value_is_rejected():
    with pytest.raises(ConfigError, match="--model.n_layer needs a value"):
        load_config(None, ["--model.n_layer"])


def test_stray_argument_is_rejected():
    with pytest.raises(ConfigError, match="unexpected argument 'n_layer=4'"):
        load_config(None, ["n_layer=4"])


def test_unparseable_toml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "[model]\nn_layer = = 4\n")
    with pytest.raises(ConfigError, match=r"run.toml is not valid TOML: .*line 2"):
        load_config(path, [])


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.toml does not exist"):
        load_config(str(tmp_path / "nope.toml"), [])
    with pytest.raises(ConfigError, match=r"config file .* cannot be read \(Is a directory\)"):
        load_config(str(tmp_path), [])


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = load_config(
        None,
        [
            "--model.n_layer=3",
            "--optim.min_lr=1e-05",
            '--train.out_dir=out/with "quotes", a \\ backslash, a\ttab and a=sign',
            "--wandb.run_name=café 🙂 \x7f \U0001d11e",  # accents, characters beyond U+FFFF, DEL
        ],
    )
    assert load_config(write(tmp_path, config_to_toml(cfg)), []) == cfg


def test_every_config_key_has_a_comment():
    for section, cls in SECTIONS.items():
        comments = field_comments(cls)
        for f in dataclasses.fields(cls):
            assert comments.get(f.name), f"{section}.{f.name} has no comment"


def test_help_lists_every_config_key():
    text = config_help()
    for section, cls in SECTIONS.items():
        assert f"[{section}]" in text
        for f in dataclasses.fields(cls):
            assert re.search(rf"^  {f.name} ", text, re.MULTILINE), f.name


def test_config_docs_table_documents_every_config_key_with_its_default():
    page = (PROJECT_ROOT / "docs" / "configs.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+\.\w+)` \| \w+ \| `([^`]*)` \|", page, re.MULTILINE))
    defaults = default_values()
    documented = set()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            assert key in rows, f"docs/configs.md does not document {key}"
            assert json.loads(rows[key]) == defaults[section][f.name], f"docs/configs.md's default for {key} is stale"
            documented.add(key)
    assert set(rows) == documented  # and documents no key that does not exist


@pytest.mark.parametrize("path", sorted((PROJECT_ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    load_config(str(path), [])


def test_a_config_file_without_out_dir_trains_into_a_directory_named_after_it(tmp_path):
    """A config copied under a new name and changed never meets the run of the one it came from."""
    copy = tmp_path / "deep.toml"
    copy.write_text((PROJECT_ROOT / "configs" / "shakespeare_char.toml").read_text() + "\n")
    assert load_config(str(copy), ["--model.n_layer=6"]).train.out_dir == "out/deep"
    assert load_config(str(copy), ["--train.out_dir=out/mine"]).train.out_dir == "out/mine"  # the command line wins
    assert load_config(write(tmp_path, '[train]\nout_dir = "elsewhere"\n'), []).train.out_dir == "elsewhere"


def test_shipped_configs_train_into_out_slash_their_name():
    for path in sorted((PROJECT_ROOT / "configs").glob("*.toml")):
        assert load_config(str(path), []).train.out_dir == f"out/{path.stem}", path.name

"""Agreement with lm-evaluation-harness, offline: on a tiny GPT-2 BPE model exported to a Hugging Face
folder, the harness's own `hf` model and task definitions (HellaSwag's, ARC's, PIQA's, LAMBADA's,
pointed at the shipped task files) give the same per-item scores and choices, acc and acc_norm as
evals/evaluate.py; and the harness runs its tasks on our model through evals/harness.py.
Skipped when lm-eval is not installed (pip install -e .[eval])."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.tokenizer import GPT2Tokenizer
from evals.evaluate import evaluate_task, score_items
from evals.tasks import load_task
from inference.load import model_from_checkpoint
from interop.pretrained import export_model
from tests.conftest import PROJECT_ROOT, tiny_config, tiny_model
from trainer.checkpoint import load_checkpoint
from trainer.loop import Trainer

# found, not imported: importing the harness imports `datasets`, which must wait for conftest's offline setup
HARNESS = importlib.util.find_spec("lm_eval")
pytestmark = pytest.mark.skipif(HARNESS is None, reason="lm-eval is not installed (pip install -e .[eval])")
TASKS = PROJECT_ROOT / "tests" / "tasks"
# our --tasks entry -> (the harness's task definition to include, the shipped file it reads)
AGREEMENT = {
    "next_line": (None, "next_line.jsonl"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag.jsonl"),
    "arc_easy": ("arc/arc_easy.yaml", "arc.jsonl"),
    "piqa": ("piqa/piqa.yaml", "piqa.jsonl"),
    "lambada": ("lambada/lambada_openai.yaml", "lambada.jsonl"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path, object]:
    """A tiny GPT-2 BPE model with a 32-token block (so that long questions lose their start), its
    export (its tokenizer files included), and a folder of task definitions over the shipped files."""
    from evals.harness import local_task_yaml

    root = tmp_path_factory.mktemp("harness")
    model = tiny_model(vocab_size=GPT2Tokenizer().vocab_size, block_size=32)
    export_model(model, GPT2Tokenizer(), root / "model")
    (root / "tasks").mkdir()
    for name, (include, data_file) in AGREEMENT.items():
        (root / "tasks" / f"local_{name}.yaml").write_text(local_task_yaml(f"local_{name}", TASKS / data_file, include))
    return root / "model", root / "tasks", model


LIMIT = 12  # items per task: enough to disagree somewhere if anything differs, few enough for a quick test


def harness_run(model: str, model_args: str, tasks_dir: Path, names: list[str]) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[f"local_{name}" for name in names],
        # include_defaults=False: no index of the harness's hundreds of tasks (ours include theirs by path)
        task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
        device="cpu",
        batch_size=16,
        log_samples=True,
        limit=LIMIT,
    )


def our_spec(name: str) -> str:
    _, data_file = AGREEMENT[name]
    return str(TASKS / data_file) if name == "next_line" else f"{name}={TASKS / data_file}"


def our_result(name: str, model):
    return evaluate_task(model, GPT2Tokenizer(), load_task(our_spec(name), LIMIT), batch_size=16)


def test_scores_choices_and_accuracies_equal_the_harness_hf_model(exported):
    folder, tasks_dir, model = exported
    harness = harness_run("hf", f"pretrained={folder},dtype=float32", tasks_dir, list(AGREEMENT))
    for name in AGREEMENT:
        ours = our_result(name, model)
        figures = harness["results"][f"local_{name}"]
        samples = sorted(harness["samples"][f"local_{name}"], key=lambda sample: sample["doc_id"])
        assert len(samples) == ours.metrics["n"]
        log_likelihoods = [[score for score, _ in sample["filtered_resps"]] for sample in samples]
        our_scores = score_items(model, GPT2Tokenizer(), load_task(our_spec(name), LIMIT).items, batch_size=16)
        for item_scores, harness_scores in zip(our_scores, log_likelihoods, strict=True):
            assert [score for score, _ in item_scores] == pytest.approx(harness_scores, rel=1e-5, abs=1e-4), name
        if ours.kind == "choice":
            picked = [int(np.argmax(scores)) for scores in log_likelihoods]
            assert ours.predictions == picked, name
            assert ours.metrics["acc"] == figures["acc,none"], name
            assert ours.metrics["acc_norm"] == figures["acc_norm,none"], name
            assert [sample["acc_norm"] for sample in samples] == [
                float(p == s["target"]) for p, s in zip(ours.predictions_norm, samples, strict=True)
            ], name
        else:
            greedy = [int(sample["filtered_resps"][0][1]) for sample in samples]
            assert ours.predictions == greedy, name
            assert ours.metrics["acc"] == figures["acc,none"], name
            assert ours.metrics["ppl"] == pytest.approx(figures["perplexity,none"], rel=1e-4), name


def test_the_harness_runs_its_tasks_on_our_model(exported):
    import evals.harness  # noqa: F401  registers gpt-trainer

    folder, tasks_dir, model = exported
    harness = harness_run("gpt-trainer", f"init_from={folder}", tasks_dir, ["next_line"])
    ours = our_result("next_line", model)
    samples = sorted(harness["samples"]["local_next_line"], key=lambda sample: sample["doc_id"])
    assert [int(np.argmax([score for score, _ in sample["filtered_resps"]])) for sample in samples] == ours.predictions
    assert harness["results"]["local_next_line"]["acc,none"] == ours.metrics["acc"]
    assert harness["results"]["local_next_line"]["acc_norm,none"] == ours.metrics["acc_norm"]


def test_rolling_log_likelihood_of_a_text_equals_eval_py_perplexity(exported, tmp_path):
    from lm_eval.api.instance import Instance

    from evals.harness import HarnessModel

    folder, _, model = exported
    text = (TASKS / "passage.txt").read_text()[:400]
    (tmp_path / "passage.txt").write_text(text)
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    (log_likelihood,) = HarnessModel(init_from=str(folder), device="cpu").loglikelihood_rolling([request])
    result = evaluate_task(model, GPT2Tokenizer(), load_task(str(tmp_path / "passage.txt")), batch_size=4)
    assert -log_likelihood == pytest.approx(math.log(result.metrics["ppl"]) * result.metrics["n"], rel=1e-5)


def test_generation_is_greedy_and_stops_before_the_stop_string(exported):
    from lm_eval.api.instance import Instance

    from evals.harness import HarnessModel

    folder, _, model = exported
    tokenizer = GPT2Tokenizer()
    prompt_ids = tokenizer.encode("ROMEO:")
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(8):
            logits, _ = model(torch.tensor(ids)[None])
            ids.append(int(logits[0, -1].argmax()))
    greedy = tokenizer.decode(ids[len(prompt_ids) :])
    stop = greedy[len(greedy) // 2 :][:3]
    request = Instance("generate_until", {}, ("ROMEO:", {"until": [stop], "max_gen_toks": 8}), 0)
    (text,) = HarnessModel(init_from=str(folder), device="cpu").generate_until([request])
    assert text == greedy.split(stop)[0]


@pytest.fixture(scope="module")
def char_run(tmp_path_factory, data_dir) -> Path:
    """A character-level run: its tokenizer has no end-of-text token."""
    run_dir = tmp_path_factory.mktemp("char") / "run"
    Trainer(tiny_config(run_dir, data_dir, train__max_iters=2, train__eval_interval=2)).fit()
    return run_dir


def test_rolling_log_likelihood_without_an_end_of_text_token_equals_eval_py_perplexity(char_run, tmp_path):
    """No end-of-text token to predict the first token after: it is left out, as eval.py leaves it out
    of a text's figures (it was `Could not infer dtype of NoneType`)."""
    from lm_eval.api.instance import Instance

    from evals.harness import HarnessModel

    text = (TASKS / "passage.txt").read_text()[:300]  # windows of 32 characters: ten of them
    (tmp_path / "passage.txt").write_text(text)
    request = Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)
    harness_model = HarnessModel(out_dir=str(char_run), device="cpu")
    assert harness_model.eot_token_id is None
    (log_likelihood,) = harness_model.loglikelihood_rolling([request])
    model, tokenizer = model_from_checkpoint(load_checkpoint(char_run / "ckpt.pt"), char_run)
    result = evaluate_task(model, tokenizer, load_task(str(tmp_path / "passage.txt")), batch_size=4)
    assert result.metrics["n"] == len(text) - 1
    assert -log_likelihood == pytest.approx(math.log(result.metrics["ppl"]) * result.metrics["n"], rel=1e-5)


def test_a_device_in_model_args_wins_over_the_harness_device_option(char_run):
    """The harness passes its own --device (default cuda:0) beside model_args: device=cpu there was
    `got multiple values for keyword argument 'device'`."""
    from evals.harness import HarnessModel

    model = HarnessModel.create_from_arg_string(
        f"out_dir={char_run},device=cpu,batch_size=3", {"batch_size": 16, "max_batch_size": None, "device": "cuda:0"}
    )
    assert model.device.type == "cpu" and model.batch_size == 3


def test_a_mistake_in_model_args_is_one_error_line(exported, tmp_path):
    _, tasks_dir, _ = exported
    args = ["--model", "gpt-trainer", "--model_args", f"out_dir={tmp_path / 'nowhere'}"]
    args += ["--include_path", str(tasks_dir), "--tasks", "local_next_line"]
    process = subprocess.run(
        [sys.executable, "-m", "evals.harness", *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    errors = [line for line in process.stderr.splitlines() if line.startswith("error:")]
    assert errors == [process.stderr.strip().splitlines()[-1]] and "nowhere" in errors[0], process.stderr

"""lm-evaluation-harness on this project's models: any of its tasks, scored by our model code.

    pip install lm-eval            # or: pip install -e .[eval]
    python -m evals.harness --model gpt-trainer --model_args out_dir=out/shakespeare_gpt2 --tasks hellaswag
    python -m evals.harness --model gpt-trainer --model_args init_from=models/gpt2,dtype=float32 \\
        --tasks arc_easy --batch_size 32

The harness finds models by name only among those its own package registers, so this module
registers ours as `gpt-trainer` and then runs the harness's command line (every lm_eval option
works). model_args: out_dir (a run), checkpoint (a ckpt.pt) or init_from (a Hugging Face folder),
device (default: the harness's --device, else a GPU if there is one; in model_args it wins over
--device), dtype (default float32). Log-likelihoods go through evals/evaluate.py, which shares a
question's context among its endings; generation is greedy unless the task asks otherwise. A
mistake (a run that is not there, a device this machine lacks) is one `error:` line, exit status 2.

Perplexity tasks (loglikelihood_rolling) predict every token after an end-of-text token, as the
harness's own models do. A tokenizer without one (a character-level run) gives the first token no
context to be predicted from: it is left out, and the text's log-likelihood is that of the tokens
after it, as eval.py's text figures count it.

Imported only here: lm-eval is an optional extra, not a dependency of the rest of the project.
"""

import sys
from pathlib import Path

import lm_eval.models  # noqa: F401  the harness's own models first: it loads them only into an empty registry
import torch
from lm_eval.__main__ import cli_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from tqdm import tqdm

from errors import run_cli
from evals.evaluate import group_pairs, score_groups
from inference.load import load_model
from model import generate, left_pad
from trainer.runtime import resolve_device, resolve_dtype

MODEL_NAME = "gpt-trainer"


@register_model(MODEL_NAME)
class HarnessModel(TemplateLM):
    def __init__(
        self,
        out_dir: str | None = None,
        checkpoint: str | None = None,
        init_from: str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int | str | None = 32,
        **unused,
    ):
        super().__init__()
        self.model, self.tokenizer, _ = load_model(out_dir, checkpoint, init_from)
        if (device or "").startswith("cuda") and not torch.cuda.is_available():
            # the harness's command line passes cuda:0 unless told otherwise, and its own models fall back too
            print(f"device={device!r} but this machine has no CUDA GPU: scoring on the CPU", file=sys.stderr)
            device = "cpu"
        self._device = resolve_device(device or "auto", key="device")  # the harness reads it as .device
        self.model.to(device=self._device, dtype=resolve_dtype(dtype, self._device, key="dtype"))
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 32  # "auto" is not measured here

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "HarnessModel":
        # the harness adds its own --device (default cuda:0) and --batch_size to model_args; its base
        # class passes both as keywords, so device=cpu in model_args was a TypeError. model_args win.
        given = {key: value for key, value in (additional_config or {}).items() if value is not None}
        return cls(**(given | arg_dict))

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "HarnessModel":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def eot_token_id(self) -> int | None:
        return self.tokenizer.eot_token

    @property
    def max_length(self) -> int:
        return self.model.config.block_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        groups = group_pairs(pairs, list(range(len(pairs))), self.max_length)
        with tqdm(total=len(pairs), disable=disable_tqdm, unit="request", desc="scoring") as bar:
            scores = score_groups(self.model, groups, self.batch_size, bar)
        return [scores[index] for index in range(len(pairs))]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood over disjoint windows of the block, as the harness's own models
        compute it (every token predicted once, the first after the end-of-text token; without one,
        every token after the first, which then stands where the end-of-text token would)."""
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="rolling"):
            (text,) = request.args
            tokens = self.tok_encode(text)
            prefix = self.prefix_token_id
            if prefix is None and tokens:
                prefix, tokens = tokens[0], tokens[1:]
            windows = get_rolling_token_windows(
                token_list=tokens,
                prefix_token=prefix,
                max_seq_len=self.max_length,
                context_len=1,
            )
            pairs = [make_disjoint_window(window) for window in windows]
            scores = self._loglikelihood_tokens([(None, *pair) for pair in pairs], disable_tqdm=True)
            results.append(sum(score for score, _ in scores))
        return results

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampled when the task sets a temperature), each cut before its
        first stop string; the prompt keeps its last tokens when it is longer than the block."""
        results = []
        for request in tqdm(requests, disable=disable_tqdm, desc="generating"):
            context, options = request.args
            eot = [] if self.eot_token_id is None else [self.tokenizer.decode([self.eot_token_id])]
            until = options.get("until") or eot
            until = [until] if isinstance(until, str) else until
            max_new_tokens = options.get("max_gen_toks", 256)
            prompt_ids = self.tok_encode(context)[-self.max_length :]
            prompt, pad = left_pad([prompt_ids], self._device)
            temperature = options.get("temperature", 0.0) if options.get("do_sample", False) else 0.0
            text = ""
            for step, tokens in enumerate(
                generate(
                    self.model, prompt, max_new_tokens, temperature=temperature, stop_token=self.eot_token_id, pad=pad
                )
            ):
                token = int(tokens[0])
                if token == self.eot_token_id:
                    break
                text += self.tok_decode([token])
                if any(stop in text for stop in until) or step + 1 >= max_new_tokens:
                    break
            for stop in until:
                text = text.split(stop)[0]
            results.append(text)
        return results


# eval.py's local multiple-choice format ({"ctx", "endings", "label"}) in the harness's task language
LOCAL_CHOICE_TASK = """output_type: multiple_choice
doc_to_text: "{{ctx}}"
doc_to_choice: "{{endings}}"
doc_to_target: "{{label}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def local_task_yaml(task: str, data_file: Path, definition: str | None = None) -> str:
    """A harness task definition named task that reads the JSON-lines data_file as its test split:
    one of the harness's own definitions (definition: its path under lm_eval/tasks, e.g.
    "hellaswag/hellaswag.yaml") pointed at the file, or eval.py's local multiple-choice format."""
    head = (
        f"include: {Path(lm_eval.models.__file__).parent.parent / 'tasks' / definition}\n"
        if definition
        else LOCAL_CHOICE_TASK
    )
    return head + (
        f"task: {task}\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data_file}\n"
        "test_split: test\nvalidation_split: null\ntraining_split: null\n"
    )


if __name__ == "__main__":
    sys.argv[0] = "lm_eval"
    run_cli(cli_evaluate)

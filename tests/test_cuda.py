"""Checks of the CUDA path; skipped on machines without a CUDA GPU (bench/gpu.py runs them first)."""

import copy
import json
import math

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from rl.policy_gradient import answer_log_probs
from tests import test_rl
from tests.conftest import run_script, tf32_off, tiny_config, tiny_model
from tests.test_masks import PATTERNS, VOCAB
from tests.test_rl import rl_config
from trainer.loop import Trainer
from trainer.metrics import flops_per_token, gpu_peak_flops, peak_flops, read_metrics

pytestmark = pytest.mark.gpu


def test_cached_decoding_reproduces_full_forward_logits_on_cuda(exact_float32_products):
    model = tiny_model(50, 32).cuda()
    idx = torch.randint(0, 50, (2, 32), device="cuda")
    full, _ = model(idx)
    cache = model.new_cache(2)
    pieces = [model(idx[:, :7], cache=cache)[0]] + [model(idx[:, t : t + 1], cache=cache)[0] for t in range(7, 32)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_training_lowers_the_loss_on_cuda(tmp_path, data_dir, dtype):
    trainer = Trainer(
        tiny_config(
            tmp_path / "run",
            data_dir,
            train__device="cuda",
            train__dtype=dtype,
            train__max_iters=30,
            optim__learning_rate=3e-3,
        )  # fmt: skip
    )
    assert trainer.model.lm_head.weight.is_cuda
    (adamw,) = trainer.optimizer.optimizers
    assert adamw.defaults["fused"] is True
    assert trainer.scaler.is_enabled() == (dtype == "float16")
    x, y = trainer.batches.next_batch()
    assert x.is_cuda and y.is_cuda
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert trainer.evaluate()["val"] < before - 0.5


def test_compiled_run_logs_mfu_resumes_in_another_precision_and_samples(tmp_path, data_dir):
    run_dir = tmp_path / "run"
    common = dict(train__device="cuda", train__compile=True, train__eval_interval=10)
    Trainer(tiny_config(run_dir, data_dir, train__dtype="bfloat16", train__max_iters=10, **common)).fit()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if gpu_peak_flops(torch.device("cuda")) is not None:
        assert all(0 < r["mfu"] < 1 for r in steps if "loss" in r)
    resumed = Trainer(
        tiny_config(run_dir, data_dir, train__dtype="float16", train__max_iters=20, train__init_from="resume", **common)
    )
    assert resumed.step == 10 and resumed.scaler.is_enabled()
    resumed.fit()
    sample = run_script(
        "sample.py", "--out-dir", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "50", "--device", "cuda"
    )
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout) == len("ROMEO:") + 50 + 1


RESIDUAL_SWITCHES = {"value_embeds": 1, "unet_skips": True, "backout": True}


@pytest.mark.parametrize(
    "pattern",
    [{}, {"attn_window": 8}, {"attn_window": 8, **RESIDUAL_SWITCHES}],
    ids=["causal", "window", "window-with-residual-switches"],
)
def test_compiled_cuda_graph_step_gives_the_eager_tokens_on_cuda(exact_float32_products, pattern):
    from model import generate, left_pad

    torch._dynamo.reset()
    model = tiny_model(50, 16, **pattern).cuda()  # a window of 8: a rolling cache
    prompts, pad = left_pad([[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [42]], "cuda")

    def tokens(compile: bool) -> list[list[int]]:
        steps = generate(model, prompts, 40, temperature=0, pad=pad, compile=compile)
        return torch.stack(list(steps), dim=1).tolist()

    assert tokens(compile=True) == tokens(compile=False)


def test_trainer_on_cuda_lets_float32_matrix_products_use_tf32(tmp_path, data_dir, exact_float32_products):
    Trainer(tiny_config(tmp_path / "run", data_dir, train__device="cuda"))
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    generator = torch.Generator("cuda").manual_seed(0)
    a, b = torch.randn(2, 1024, 1024, device="cuda", generator=generator).unbind(0)
    exact = a.double() @ b.double()
    # float32 products are off by about 1e-7 of the largest value, TF32's (10-bit mantissa inputs) by about 1e-4
    assert ((a @ b).double() - exact).abs().max() > 1e-5 * exact.abs().max()


def test_logged_mfu_on_cuda_divides_model_flops_by_the_gpus_datasheet_peak(tmp_path, data_dir):
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    assert peak is not None, f"{name!r} has no entry in trainer/metrics.py PEAK_FLOPS: its runs log no MFU"
    run_dir = tmp_path / "run"
    trainer = Trainer(tiny_config(run_dir, data_dir, train__device="cuda", train__max_iters=5))
    trainer.fit()
    model_flops = flops_per_token(trainer.cfg.model, trainer.model.num_params())
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 5
    for record in steps:
        assert record["mfu"] == pytest.approx(model_flops * record["tokens_per_sec"] / peak)


@pytest.mark.parametrize("name", PATTERNS)
def test_model_with_each_pattern_trains_on_cuda_as_on_a_cpu(name, exact_float32_products):
    """On CUDA a pattern reaches attention as FlexAttention's block mask, on a CPU as SDPA's dense
    mask: the same weights must give the same logits and gradients both ways."""
    torch._dynamo.reset()  # no FlexAttention kernel compiled while TF32 was allowed
    T = 300  # three blocks of FlexAttention's 128 positions, the last one partial
    cpu_model = tiny_model(VOCAB, block_size=T, **PATTERNS[name]).train()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 10, (2, T), generator=generator)  # tokens 0 .. 9 hold test_masks' separator, 7
    targets = torch.randint(0, VOCAB, (2, T), generator=generator)
    prefix = torch.tensor([37, 250]) if PATTERNS[name].get("attn_prefix_lm") else None
    results = []
    for model, device in ((cpu_model, "cpu"), (cuda_model, "cuda")):
        on_device = None if prefix is None else prefix.to(device)
        logits, loss = model(idx.to(device), targets.to(device), prefix=on_device)
        loss.backward()
        results.append([logits, *(param.grad for param in model.parameters())])
    if name != "causal":  # causal attention needs no mask at all
        slots = torch.arange(T, device="cuda")
        mask = cuda_model.attention_mask(
            idx.cuda(), slots[None], slots, None, None, None if prefix is None else prefix.cuda()
        )
        assert isinstance(mask, BlockMask)
    for on_cpu, on_cuda in zip(*results, strict=True):
        torch.testing.assert_close(on_cuda.cpu(), on_cpu, rtol=1e-3, atol=1e-5)


def test_lora_on_a_bfloat16_base_trains_its_float32_adapters_and_samples_on_cuda(tmp_path, data_dir):
    """LoRA's GPU setting: the frozen base held in bfloat16, the adapters in float32 (the only
    trained tensors), compiled; the run then samples on the GPU with the adapters merged."""
    base, run_dir = tmp_path / "base", tmp_path / "lora"
    Trainer(tiny_config(base, data_dir, train__device="cuda", train__max_iters=10, train__eval_interval=10)).fit()
    lora = dict(lora__rank=4, lora__base_dtype="bfloat16", train__dtype="bfloat16", train__compile=True)
    trainer = Trainer(tiny_config(run_dir, data_dir, train__device="cuda", train__init_from=str(base),
                                  train__max_iters=10, train__eval_interval=10, **lora))  # fmt: skip
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trained and all(p.is_cuda and p.dtype == torch.float32 for p in trained)
    trainer.fit()
    assert math.isfinite(trainer.evaluate()["val"])
    assert any(p.abs().sum() > 0 for name, p in trainer.model.named_parameters() if "lora_B" in name)
    sample = run_script("sample.py", "--out-dir", str(run_dir), "--max-new-tokens", "20", "--device", "cuda")
    assert sample.returncode == 0, sample.stderr


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_chat_fine_tuning_with_documents_trains_replies_on_cuda(tmp_path, data_dir, compile):
    """Chat on the GPU: conversations packed with attn_documents (FlexAttention's document mask on
    CUDA), the loss over the replies only, in bfloat16; the loss falls and every step trained tokens."""
    from data.chat_dataset import prepare_chat
    from data.conversations import read_conversations
    from tests.test_chat_training import write_chats

    base = tmp_path / "base"
    Trainer(tiny_config(base, data_dir, model__block_size=64, train__device="cuda", train__max_iters=10,
                        train__eval_interval=10)).fit()  # fmt: skip
    chats = write_chats(tmp_path / "chats.jsonl")
    prepare_chat(read_conversations(str(chats)), str(base), tmp_path / "data" / "chat", source="chats.jsonl",
                 block_size=64, val_fraction=0.25, too_long="truncate")  # fmt: skip
    run_dir = tmp_path / "chat"
    trainer = Trainer(tiny_config(run_dir, tmp_path / "data", data__dataset="chat", model__block_size=64,
                                  model__attn_documents=True, train__device="cuda", train__dtype="bfloat16",
                                  train__compile=compile, train__init_from=str(base), train__max_iters=30,
                                  train__eval_interval=30, optim__learning_rate=3e-3))  # fmt: skip
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert trainer.evaluate()["val"] < before
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert records and all(r["trained_tokens"] > 0 for r in records)


def test_sequence_length_and_batch_size_schedules_train_compiled_in_bfloat16_on_cuda(tmp_path, data_dir):
    """Each stage's shape recompiles the model (then torch's dynamic shapes serve the rest); the run
    trains at every shape and counts each step's tokens."""
    schedules = dict(train__block_size_schedule="16:0.3", train__batch_size_schedule="2:0.6")
    cuda = dict(train__device="cuda", train__dtype="bfloat16", train__compile=True, optim__learning_rate=3e-3)
    run_dir = tmp_path / "run"
    trainer = Trainer(tiny_config(run_dir, data_dir, train__max_iters=20, **schedules, **cuda))
    before = trainer.evaluate()["val"]
    trainer.fit()
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert all(math.isfinite(r["loss"]) for r in steps) and trainer.evaluate()["val"] < before - 0.3
    assert steps[-1]["tokens"] == 6 * 2 * 16 + 6 * 2 * 32 + 8 * 4 * 32


def test_residual_switches_train_compiled_in_bfloat16_and_sample_on_cuda(tmp_path, data_dir):
    """Value embeddings, U-net skips, backout and zero-initialised projections in the GPU setting:
    bfloat16, compiled, Muon for the block matrices; the loss falls and the run samples on the GPU."""
    run_dir = tmp_path / "run"
    switches = {f"model__{key}": value for key, value in RESIDUAL_SWITCHES.items()}
    trainer = Trainer(tiny_config(run_dir, data_dir, model__n_layer=4, model__zero_init_proj=True, **switches,
                                  optim__optimizer="muon", optim__learning_rate=3e-3, train__device="cuda",
                                  train__dtype="bfloat16", train__compile=True, train__max_iters=30,
                                  train__eval_interval=30))  # fmt: skip
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert trainer.evaluate()["val"] < before - 0.3
    sample = run_script("sample.py", "--out-dir", str(run_dir), "--max-new-tokens", "20", "--device", "cuda")
    assert sample.returncode == 0, sample.stderr


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_neighbouring_token_switches_train_in_bfloat16_and_decode_on_cuda(tmp_path, data_dir, compile):
    """The smear gate, an exact bigram table (65^2 + 1 rows) and multi-token prediction together on the
    GPU in bfloat16, eager and compiled (the multi-token weights change from step to step inside the
    compiled graph): the loss falls; the trained model decodes through a static cache as its full pass
    computes, and samples with compiled decoding."""
    run_dir = tmp_path / "run"
    switches = dict(model__smear_gate=True, model__bigram_embed=65**2 + 1, model__mtp_tokens=2)
    trainer = Trainer(tiny_config(run_dir, data_dir, train__device="cuda", train__dtype="bfloat16",
                                  train__compile=compile, train__max_iters=30, train__eval_interval=30,
                                  optim__learning_rate=3e-3, **switches))  # fmt: skip
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert trainer.evaluate()["val"] < before - 0.3
    assert trainer.model.loss.weights.tolist() == [1, 0, 0]  # past optim.lr_decay_iters: the next token alone
    model = trainer.model.eval()
    idx = torch.randint(0, 65, (2, 32), device="cuda")
    with torch.no_grad(), tf32_off():  # exact float32 products (the trainer turned TF32 on)
        full, _ = model(idx)
        cache = model.new_cache(2, static=True)
        pieces = [model(idx[:, :7], cache=cache)[0]] + [model(idx[:, t : t + 1], cache=cache)[0] for t in range(7, 32)]
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-4
    sample = run_script(
        "sample.py", "--out-dir", str(run_dir), "--max-new-tokens", "20", "--device", "cuda", "--compile"
    )
    assert sample.returncode == 0, sample.stderr


def test_normuon_and_cautious_weight_decay_train_on_cuda_in_bfloat16_compiled(tmp_path, data_dir):
    """Muon's CUDA setting (orthogonalised in bfloat16, the model compiled) with NorMuon and cautious
    decay of both optimizers' weights: the loss falls, the running mean squares stay finite float32
    on the GPU, one per neuron, and AdamW keeps its fused step."""
    from optim.optimizer import CautiousAdamW

    switches = dict(optim__optimizer="muon", optim__muon_normuon=True, optim__cautious_weight_decay=True,
                    optim__muon_weight_decay=0.1, optim__learning_rate=3e-3)  # fmt: skip
    trainer = Trainer(tiny_config(tmp_path / "run", data_dir, train__device="cuda", train__dtype="bfloat16",
                                  train__compile=True, train__max_iters=30, **switches))  # fmt: skip
    muon, adamw = trainer.optimizer.optimizers
    assert muon.ns_dtype == torch.bfloat16 and type(adamw) is CautiousAdamW and adamw.defaults["fused"]
    before = trainer.evaluate()["val"]
    trainer.fit()
    assert trainer.evaluate()["val"] < before - 0.5
    for param in muon.param_groups[0]["params"]:
        moment = muon.state[param]["neuron_second_moment"]
        assert moment.is_cuda and moment.dtype == torch.float32 and torch.isfinite(moment).all()
        assert moment.numel() == max(param.shape)


chat_root = test_rl.chat_root  # tests/test_rl.py's tiny chat model: a fixture, asked for by its name


def rl_on(device: str, run_dir, chat_root, dtype: str) -> tuple[Trainer, list[dict]]:
    """An [rl] run of tests/test_rl.py's tiny chat model on device in dtype: its trainer and its records."""
    config = rl_config(run_dir, chat_root, train__device=device, train__dtype=dtype, train__max_iters=2,
                       train__eval_interval=2, train__log_interval=1)  # fmt: skip
    trainer = Trainer(config)
    trainer.fit()
    return trainer, read_metrics(run_dir / "metrics.jsonl")


def test_rl_samples_with_the_log_probs_a_forward_pass_gives_and_trains_on_cuda(tmp_path, chat_root):
    """[rl] on the GPU: the log-probabilities recorded while sampling with the KV cache are the full
    forward pass's (float32, TF32 off), and a bfloat16 run samples, rewards and updates."""
    with tf32_off():
        trainer, _ = rl_on("cuda", tmp_path / "float32", chat_root, "float32")
        sampled = trainer.objective._sample(0, None)
        model = trainer.model.eval()
        with torch.no_grad():
            for batch in trainer.objective._micro_batches(sampled, 2):  # as the loss reads them, left padded
                logits, _ = model(batch.inputs, pad=batch.pad, logits_to_keep=batch.targets.size(1))
                recomputed = answer_log_probs(logits, batch.targets, 0.7, 5)
                torch.testing.assert_close(recomputed, batch.sampled_log_probs, rtol=0, atol=1e-4)
    _, records = rl_on("cuda", tmp_path / "bfloat16", chat_root, "bfloat16")
    steps = [r for r in records if "rl/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["rl/sampled_tokens_per_sec"] > 0 for r in steps)

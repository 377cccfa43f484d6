"""Decoding on a CPU: a model prepared once (its products, in a precision) and a one-token step that
runs the model's arithmetic in fewer operations.

A decoding step multiplies each block's four weight matrices and the output layer by one row per
sequence; the rest of the model's forward pass (the mask and position machinery, switches that are
off, module calls, a GELU and two residual adds per block) costs little each but adds up: for GPT-2
124M at batch 1 it was about 3.5 ms of a 46 ms step at one thread, and far more with two threads on a
busy machine, where every operator waits for both (docs/benchmarks.md, "Decoding"). `DecodeStep`
computes what the model computes for one new token per row, with the model's own modules and
functions (its norms, its heads' projections, rotation and norms, `attention`, the KV cache's
update), but calls the packed products directly, with GELU and the residual adds fused into them
where oneDNN allows, and builds no mask but the padding's.

`prepare_decoding` is the one place every command that samples (sample.py, its chat, eval.py's
generation tasks) makes a loaded model ready: it packs the linear layers in the chosen precision
(inference/packed_linear.py), builds the step where it applies, and says in one line how decoding
runs. The prompt, and each re-encoding after the context slides, stay on the model's forward pass
(over the same packed products).
"""

from dataclasses import dataclass

import torch

from errors import UserError
from inference.packed_linear import PRECISIONS, precision_unavailable, prepare_products
from model import GPT, attention
from model.kv_cache import KVCache

NOT_PACKED = "nn.Linear layers (it calls packed products)"  # step_unsupported's answer for unpacked layers
PRECISION_CHOICES = ("auto", *PRECISIONS)  # --precision's values; auto: the products in the model's dtype


def step_unsupported(model: GPT) -> str | None:
    """What of the model a DecodeStep does not compute (a model key, by name, as `--export` refuses
    switches), or None. A one-token step after a prefix-LM prompt is causal, so that pattern needs
    nothing of it; the others keep state in the cache (window, documents) or in modules the step does
    not call."""
    keys = ("attn_window", "attn_block", "attn_documents", "value_embeds", "unet_skips", "backout", "smear_gate")
    for key in (*keys, "bigram_embed"):
        if getattr(model.config, key):
            return f"model.{key}"
    if any(isinstance(module, torch.nn.Linear) for module in model.modules()):
        return NOT_PACKED
    return None


class DecodeStep:
    """One new token per row over a KV cache, as the model computes it, called as the model is called
    for it: step(idx (B, 1), cache=, pad=, prefix=) -> (logits (B, 1, vocab_size), None). The model's
    linear layers must be packed (inference/packed_linear.py), and step_unsupported(model) None."""

    def __init__(self, model: GPT):
        reason = step_unsupported(model)
        if reason is not None:
            raise ValueError(f"the decoding step does not compute {reason}")
        self.model = model
        self.mlp = model.config.mlp
        self.hidden = model.config.mlp_hidden

    @torch.no_grad()
    def __call__(
        self,
        idx: torch.Tensor,
        cache: KVCache,
        pad: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """idx: (B, 1) the newest token of each row; pad: (B,) each row's left padding (see GPT.forward);
        prefix: a prefix-LM's prefix lengths, which a token after them does not need (it sees every
        earlier key)."""
        model, B = self.model, idx.size(0)
        assert idx.size(1) == 1 and not cache.static, "one token per row over a dynamic cache"
        cache.claim(1)
        slots = cache.slots(1)  # (1,)
        positions = slots[None] if pad is None else slots[None] - pad[:, None]  # (1 or B, 1)
        # padding (slots before each row's first token) is hidden; every other written key is earlier
        keys = torch.arange(cache.pos, device=idx.device)
        mask = None if pad is None else (keys[None] >= pad[:, None])[:, None, None, :]  # (B, 1, 1, kv_len)
        positions = model.positions(idx, positions, cache)  # what the position embedding or rotation sees
        x = model.transformer.wte(idx) + model.transformer.wpe(positions.clamp(min=0))  # (B, 1, C)
        x = x.view(B, -1)  # (B, C): the residual stream, one row per sequence
        rotate = model.rotary(positions)
        for block in model.transformer.h:
            attn = block.attn
            q, k, v = attn.heads(block.ln_1(x).view(B, 1, -1), rotate)  # (B, H, 1, D), (B, Hkv, 1, D) twice
            k, v = cache.update(attn.layer_idx, k, v)  # (B, Hkv, kv_len, D)
            y = attention(q, k, v, mask).reshape(B, attn.q_dim)  # (B, H * D): one query per row
            x = attn.c_proj.product_add(y, x)
            x = self.mlp_add(block.mlp, block.ln_2(x), x)
        cache.advance(1)
        logits = model.softcap(model.lm_head.product(model.transformer.ln_f(x)))  # (B, vocab_size)
        return logits.view(B, 1, -1), None

    def mlp_add(self, mlp: torch.nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + the block's MLP of h, (B, C)."""
        if self.mlp == "gelu":
            hidden = mlp.c_fc.product_gelu(h)
        elif self.mlp == "swiglu":
            gate, value = mlp.c_fc.product(h).split(self.hidden, dim=-1)  # (B, hidden) each
            hidden = torch.nn.functional.silu(gate) * value
        else:
            hidden = mlp.act(mlp.c_fc.product(h))
        return mlp.c_proj.product_add(hidden, x)


@dataclass(frozen=True)
class Decoding:
    """A model made ready to decode: the one-token step to hand to generate (None: the model's own
    forward), and how decoding runs, for the start-up line."""

    step: DecodeStep | None
    description: str


def check_precision(precision: str, device: torch.device, dtype: torch.dtype, compile: bool) -> None:
    """Refuse, with the reason, a --precision (PRECISION_CHOICES) that cannot apply to a model on this
    device in this dtype: checked before the model, perhaps a large download, is loaded."""
    if precision == "auto":
        return
    reason = "torch.compile cannot trace its packed layers" if compile else None
    reason = reason or precision_unavailable(device, dtype, precision)
    if reason is not None:
        raise UserError(
            f"--precision={precision} does not apply here: {reason} (leave --precision out, or decode a float32 "
            f"model on an x86-64 CPU without --compile)"
        )


def prepare_decoding(
    model: GPT,
    device: torch.device,
    precision: str = "auto",
    batch_size: int | None = None,
    compile: bool = False,
    use_cache: bool = True,
) -> Decoding:
    """Make model, loaded and moved to device, ready to decode: on an x86-64 CPU its linear layers
    packed for products in `precision` (PRECISION_CHOICES; auto: in the model's dtype) with their
    weights laid out for batch_size rows, and the DecodeStep where it computes the model. The model is
    changed in place and frozen. compile: torch.compile makes the step, and cannot trace packed layers,
    so they stay nn.Linear; use_cache False: there are no one-token steps. A precision that does not
    apply is a UserError (check_precision)."""
    dtype = model.transformer.wte.weight.dtype
    check_precision(precision, device, dtype, compile)
    products = prepare_products(model, device, dtype, compile, None if precision == "auto" else precision, batch_size)
    unsupported = step_unsupported(model)
    if not use_cache or unsupported == NOT_PACKED:
        return Decoding(None, products)
    if unsupported is not None:
        return Decoding(
            None, f"{products}, the model's own one-token steps (the decoding step does not compute {unsupported})"
        )
    return Decoding(DecodeStep(model), f"{products}, one-token steps by inference/decode_step.py")

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

With --compile on a CPU the step is compiled instead: its linear layers hold their weights in the
chosen precision, float32 as they are (StreamedLinear; int8 in Int8Linear's form), one row's product
is written as a multiplication and a sum, and attention over the cache as products of one query row
(`one_query_attention`); Inductor compiles both into loops that read each weight and each cached key
once, widening a weight stored in fewer bytes to float32 as it reads it. At batch 1 that is faster
than the packed products (docs/benchmarks.md), after a compilation of some seconds.
"""

import math
import types
from dataclasses import dataclass

import torch

from errors import UserError
from inference.packed_linear import PRECISIONS, precision_unavailable, prepare_products, stream_linears
from model import GPT, attention
from model.kv_cache import KVCache

NOT_PACKED = "nn.Linear layers (it calls packed products)"  # step_unsupported's answer for unpacked layers
PRECISION_CHOICES = ("auto", *PRECISIONS)  # --precision's values; auto: the products in the model's dtype
# how the compiled step decodes, by the weights' precision, for the start-up line
_COMPILED = "streamed by compiled one-token steps (inference/decode_step.py; compiled at the first)"
STREAMED = {
    "float32": f"float32 weights {_COMPILED}",
    "bfloat16": f"bfloat16 weights and KV cache (float32 sums) {_COMPILED}",
    "float16": f"float16 weights, bfloat16 KV cache (float32 sums) {_COMPILED}",
    "int8": f"int8 weights with a scale per output row, bfloat16 KV cache (float32 sums) {_COMPILED}",
}
# the keys and values of a compiled step in a reduced precision: half float32's bytes for attention to
# read at every token, widened to float32 as read; bfloat16 keeps float32's range, where float16 would
# overflow past 65,504
REDUCED_CACHE = torch.bfloat16
# Inductor's options for the compiled step: a layer norm's output is computed once, not again inside
# each of the weight rows' sums that read it (docs/benchmarks.md: 17.9 against 14.9 ms a step); and no
# check of each input's sizes and strides at every call (some 220 for GPT-2 124M, 0.1 ms a token). The
# tokens, cache and padding stay checked by the guards; most of the checks dropped were the model's
# tensors', which the guards skip (DecodeStep): a model tensor replaced after the first call is read
# with the first call's sizes, unchecked
COMPILE_OPTIONS = {"realize_opcount_threshold": 1, "size_asserts": False}


def step_unsupported(model: GPT) -> str | None:
    """What of the model a DecodeStep does not compute (a model key, by name, as `--export` refuses
    switches), or None. A one-token step after a prefix-LM prompt is causal, so that pattern needs
    nothing of it; the others keep state in the cache (window, documents) or in modules the step does
    not call."""
    reason = key_unsupported(model)
    if reason is None and any(isinstance(module, torch.nn.Linear) for module in model.modules()):
        return NOT_PACKED
    return reason


def key_unsupported(model: GPT) -> str | None:
    """The model key (by name) whose switch a DecodeStep does not compute, or None."""
    keys = ("attn_window", "attn_block", "attn_documents", "value_embeds", "unet_skips", "backout", "smear_gate")
    for key in (*keys, "bigram_embed"):
        if getattr(model.config, key):
            return f"model.{key}"
    return None


def one_query_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`attention` for one query per row, (B, H, 1, D) over (B, Hkv, L, D) keys and values, written for
    a compiled step to fuse into its own loops (SDPA's kernel is called, and allocates, once per
    layer). Unlike model.attention's `spelled_out`, which copies the key/value heads for each group,
    nothing here leaves the compiled loops or copies the cache. mask: None (every key is seen) or
    (B, 1, 1, L), True where a key is seen; every row sees at least one key (a new token sees itself).

    Both products are matrix products of one query row per head: Inductor computes those on a CPU as
    a multiplication and a sum in one loop, which reads each cached key and value once, the heads
    spread over the threads. Written here as a multiplication and a sum, they were stored whole before
    their sums (with COMPILE_OPTIONS' threshold, a product over heads and keys is kept): 0.1 to 0.3 ms
    a token more for GPT-2 124M (docs/benchmarks.md).

    The softmax is spelled out, in the order that leaves Inductor the fewest loops: the query scaled
    before the products (exact where the head size's square root is a power of two, as GPT-2's 64),
    and the weighted values divided by the weights' sum once, at the end (D divisions a head, not L).
    `scores.softmax()` after a division compiles to a rewrite with a check for infinite scores and a
    second maximum: five loops a layer more (docs/benchmarks.md)."""
    B, H, _, D = q.shape
    Hkv = k.size(1)
    q = q.view(B, Hkv, H // Hkv, 1, D) * (1 / math.sqrt(D))  # each key/value head's group of query heads
    scores = (q @ k[:, :, None].transpose(-1, -2)).squeeze(-2)  # (B, Hkv, H / Hkv, L)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(B, 1, 1, -1), float("-inf"))
    weights = (scores - scores.amax(dim=-1, keepdim=True)).exp()  # unnormalised: the largest is 1
    y = (weights[..., None, :] @ v[:, :, None]).squeeze(-2)  # (B, Hkv, H / Hkv, D)
    return (y / weights.sum(dim=-1)[..., None]).reshape(B, H, 1, D)


class DecodeStep:
    """One new token per row over a KV cache, as the model computes it, called as the model is called
    for it: step(idx (B, 1), cache=, pad=, prefix=) -> (logits (B, 1, vocab_size), None). The model's
    linear layers must be packed (inference/packed_linear.py), and step_unsupported(model) None.
    attend: the attention of the new tokens' queries over the cache (`attention`'s arguments).
    compile: torch.compile the step's arithmetic (everything after the cache's bookkeeping on the
    host), with COMPILE_OPTIONS, for every cache length and batch size at once (dynamic shapes). A
    compiled step's guards do not check its model: it computes the model as it was at the first call
    (a model prepared for decoding is frozen), and changes made to it later go unseen: a tensor of it
    replaced by one of another shape is read as the first, unchecked (COMPILE_OPTIONS)."""

    def __init__(self, model: GPT, attend=attention, compile: bool = False):
        reason = step_unsupported(model)
        if reason is not None:
            raise ValueError(f"the decoding step does not compute {reason}")
        self.model = model
        self.attend = attend
        self.mlp = model.config.mlp
        self.hidden = model.config.mlp_hidden
        if compile:
            # torch.compile keeps a function's graphs, and the guards that choose one at each call, with
            # its code object: with one of its own, this step's graphs serve its model alone, so the
            # guards need not check that model (frozen for inference) again at every token: for GPT-2
            # 124M some 1,700 checks, 0.3 ms of a 6 ms token in bfloat16 (docs/benchmarks.md)
            own = types.FunctionType(DecodeStep.one_token.__code__.replace(), globals(), "one_token")
            options = {**COMPILE_OPTIONS, "guard_filter_fn": _outside_the_model}
            self.one_token = torch.compile(types.MethodType(own, self), dynamic=True, options=options)

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
        assert idx.size(1) == 1 and not cache.static, "one token per row over a dynamic cache"
        cache.claim(1)
        return self.one_token(idx, cache, pad)

    def one_token(self, idx: torch.Tensor, cache: KVCache, pad: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        """The step once its slot is claimed."""
        model, B = self.model, idx.size(0)
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
            y = self.attend(q, k, v, mask).reshape(B, attn.q_dim)  # (B, H * D): one query per row
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


def _outside_the_model(guards: list) -> list[bool]:
    """torch.compile's guard filter for a DecodeStep of its own code: keep the guards on the step's
    inputs (the tokens, the cache, the padding) and drop those on its model."""
    model = ("self.model.", "self.model[")
    return [guard.name != "self.model" and not guard.name.startswith(model) for guard in guards]


@dataclass(frozen=True)
class Decoding:
    """A model made ready to decode: the one-token step to hand to generate (None: the model's own
    forward), and how decoding runs, for the start-up line."""

    step: DecodeStep | None
    description: str


def check_precision(precision: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with the reason, a --precision (PRECISION_CHOICES) that cannot apply to a model on this
    device in this dtype: checked before the model, perhaps a large download, is loaded."""
    if precision == "auto":
        return
    reason = precision_unavailable(device, dtype, precision)
    if reason is not None:
        raise UserError(
            f"--precision={precision} does not apply here: {reason} (leave --precision out, or decode a float32 "
            f"model on an x86-64 CPU)"
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
    changed in place and frozen. compile: torch.compile makes the step: on an x86-64 CPU, for a float32
    model the DecodeStep computes and one row (batch_size 1 or None), the step over layers streaming
    their weights in `precision` (stream_linears; module docstring) and, in a precision other than
    float32, the model's KV caches in REDUCED_CACHE (for more rows the eager step over packed layers,
    faster there, says so); elsewhere the model's own, which generate compiles, on
    nn.Linear layers (torch.compile cannot trace packed ones), where a precision is refused.
    use_cache False: there are no one-token steps. A precision that does not apply is a UserError
    (check_precision)."""
    dtype = model.transformer.wte.weight.dtype
    check_precision(precision, device, dtype)
    weights = "float32" if precision == "auto" else precision
    unstreamed = precision_unavailable(device, dtype, weights) or key_unsupported(model)
    note = ""
    if compile and use_cache and unstreamed is None:
        if (batch_size or 1) == 1:
            step = DecodeStep(stream_linears(model, weights), one_query_attention, compile=True)
            model.cache_dtype = None if weights == "float32" else REDUCED_CACHE
            return Decoding(step, STREAMED[weights])
        # the streamed products are for one row: at 8 rows the compiled step took 2.5x the eager step's time
        note = f" (--compile is for one row at a time: {batch_size} rows decode with the eager step)"
    elif compile and weights != "float32":  # torch.compile would trace nn.Linear layers, in float32
        why = f"the decoding step does not compute {unstreamed}"
        if not use_cache:
            why = "without the KV cache (--no-cache) there are no one-token steps"
        raise UserError(f"--precision={precision} with --compile: {why} (leave out --precision or --compile)")
    products_precision = None if precision == "auto" else precision
    products = prepare_products(model, device, dtype, compile and not note, products_precision, batch_size)
    unsupported = step_unsupported(model)
    if not use_cache or unsupported == NOT_PACKED:
        return Decoding(None, products)
    if unsupported is not None:
        return Decoding(
            None, f"{products}, the model's own one-token steps (the decoding step does not compute {unsupported})"
        )
    return Decoding(DecodeStep(model), f"{products}, one-token steps by inference/decode_step.py{note}")

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
than the packed products (docs/benchmarks.md), after a compilation of some seconds. The step is
compiled ahead of time (torch.export, then AOTInductor: `CompiledSteps`), so that a token costs one call
into compiled C++ and little else: through torch.compile each token also paid its guards, its
wrappers and 180 buffers allocated from Python: 0.47 to 0.59 ms more a token for GPT-2 124M, whose
tokens take 4.4 to 17 ms (docs/benchmarks.md).
"""

import copy
import hashlib
import math
import os
import platform
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from errors import UserError
from inference.packed_linear import PRECISIONS, precision_unavailable, prepare_products, stream_linears
from model import GPT, attention
from model.kv_cache import KVCache

NOT_PACKED = "nn.Linear layers (it calls packed products)"  # step_unsupported's answer for unpacked layers
PRECISION_CHOICES = ("auto", *PRECISIONS)  # --precision's values; auto: the products in the model's dtype
# how the compiled step decodes, by the weights' precision, for the start-up line
_COMPILED = "streamed by one-token steps compiled ahead of time (inference/decode_step.py; at the first call)"
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
# each of the weight rows' sums that read it (docs/benchmarks.md: 17.9 against 14.9 ms a step); the
# model's tensors are not written into the compiled library: it reads the model's own, in their huge
# pages (CompiledSteps), and compiles without copying them
COMPILE_OPTIONS = {"realize_opcount_threshold": 1, "aot_inductor.package_constants_in_so": False}


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
    compile: compile the step's arithmetic (everything after the cache's bookkeeping on the host)
    ahead of time, with COMPILE_OPTIONS (CompiledSteps): once for each batch size, one program for
    every cache length. A compiled step computes the model as it was when compiled (a model prepared
    for decoding is frozen): it reads the model's tensors where they lay then, so a tensor changed in
    place is read as changed, and one replaced later goes unseen."""

    def __init__(self, model: GPT, attend=attention, compile: bool = False):
        reason = step_unsupported(model)
        if reason is not None:
            raise ValueError(f"the decoding step does not compute {reason}")
        self.model = model
        self.attend = attend
        self.mlp = model.config.mlp
        self.hidden = model.config.mlp_hidden
        self.compiled = CompiledSteps(self) if compile else None

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
        if self.compiled is not None:
            return self.compiled(idx, cache, pad), None
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


class CompiledSteps:
    """A DecodeStep's arithmetic compiled ahead of time: at the first call for a batch size (and dtypes
    of the tokens, padding and cache, and a thread count) `DecodeStep.one_token` is exported
    (torch.export, the cache's length and its slots left free) and compiled by AOTInductor with
    COMPILE_OPTIONS into a library whose one call runs the step: no guards, no Python between the
    graph's operations, its buffers allocated in C++, its loops on the threads it was compiled for.
    The library checks none of its inputs: the key it is kept under, and the sizes checked at each
    call, are what chooses it. It reads the model's tensors where they lie (user-managed constants: no
    copy), and writes each new key and value into the cache it is given. Called as step.one_token once
    the slot is claimed: (idx (B, 1), cache, pad) -> logits (B, 1, vocab_size). A step over an empty
    cache (a length of 1, which generate never asks for) is computed eagerly."""

    def __init__(self, step: DecodeStep):
        self.step = step
        # (rows, the dtypes of the tokens, padding and cache, threads) -> (the library, the model's tensors it reads)
        self.programs = {}

    def __call__(self, idx: torch.Tensor, cache: KVCache, pad: torch.Tensor | None) -> torch.Tensor:
        if not 2 <= cache.pos <= cache.k[0].size(2) <= self.step.model.config.block_size:
            return self.step.one_token(idx, cache, pad)[0]  # sizes the libraries are not compiled for
        key = (idx.size(0), idx.dtype, None if pad is None else pad.dtype, cache.k[0].dtype, torch.get_num_threads())
        if key not in self.programs:
            self.programs[key] = self.compile(idx, cache, pad)
        library, _ = self.programs[key]
        # the cache's length is passed as the length of a tensor: the programs' one free size besides the slots
        return library(idx, torch.empty(cache.pos, dtype=torch.uint8), pad, cache.k, cache.v)

    def compile(self, idx: torch.Tensor, cache: KVCache, pad: torch.Tensor | None) -> tuple:
        """The library of the step for calls like this one's, loaded from Inductor's cache folder or compiled,
        and the model's tensors it reads. Those are kept here as long as the library: AOTInductor reads
        user-managed tensors without owning them (torch 2.13 keeps a reference all the same, so a model
        whose step was compiled is not freed before the process ends). Detached, they are the model's
        memory but not its parameter objects: data swapped into a parameter later goes unseen."""
        model = self.step.model
        module = _OneToken(self.step, cache)
        most = model.config.block_size  # the longest cache a model's generate makes
        length, slots = torch.export.Dim("kv_len", min=2, max=most), torch.export.Dim("slots", min=2, max=most)
        per_layer = [{2: slots}] * len(cache.k)
        inputs = (idx, torch.empty(cache.pos, dtype=torch.uint8), pad, cache.k, cache.v)
        with torch.no_grad(), _plain_tensors_as_buffers(model):
            program = torch.export.export(
                module, inputs, dynamic_shapes=(None, {0: length}, None, per_layer, per_layer), strict=False
            )
            tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        library = torch._inductor.aoti_load_package(str(compiled_package(program)))
        constants = {name: tensors[name].detach() for name in library.get_constant_fqns()}
        library.load_constants(constants, check_full_update=True, user_managed=True)
        return library, constants


@contextmanager
def _plain_tensors_as_buffers(model: torch.nn.Module):
    """The model's tensors held as plain attributes (the rotation's frequencies: no checkpoint holds them,
    and casting the model leaves them be) made buffers of their modules while it lasts: an export reads
    them as the model's tensors, which the compiled step is then given by name, where as plain attributes
    they would be constants of the program's own, which AOTInductor names anew."""
    plain = [
        (module, name)
        for module in model.modules()
        for name, value in vars(module).items()
        if isinstance(value, torch.Tensor)
    ]
    for module, name in plain:
        module.register_buffer(name, module.__dict__.pop(name), persistent=False)
    try:
        yield
    finally:
        for module, name in plain:
            setattr(module, name, module._buffers.pop(name))
            module._non_persistent_buffers_set.discard(name)


def compiled_package(program: torch.export.ExportedProgram) -> Path:
    """The file of `program` compiled by AOTInductor (COMPILE_OPTIONS), kept in package_folder() under a
    name made of what the compiled library depends on: the program as it prints (its operations,
    shapes, dtypes and the ranges of its free sizes), the options, torch's version, the C++ compiler,
    the threads its loops are compiled for and the CPU (its model and flags: the library is compiled
    for the CPU it is built on). A later run that exports the same program loads it from there instead
    of compiling it again (GPT-2 124M: about 5 s in all against 30). The file holds no weights
    (COMPILE_OPTIONS): a few MB."""
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    made_of = [str(program), repr(sorted(COMPILE_OPTIONS.items())), torch.__version__]
    made_of += [get_compiler_version_info(get_cpp_compiler()), f"{torch.get_num_threads()} threads"]
    made_of += [platform.machine(), str(pick_vec_isa()), *_cpu_description()]
    folder = package_folder()
    name = hashlib.sha256("\n".join(made_of).encode()).hexdigest()[:40]
    path = folder / f"{name}.pt2"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch, warnings.catch_warnings():
            # torch 2.13 warns of its own deprecated call as it copies the graph: nothing a user can act on
            warnings.filterwarnings("ignore", r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
            made = torch._inductor.aoti_compile_and_package(
                program, package_path=str(Path(scratch) / "step.pt2"), inductor_configs=dict(COMPILE_OPTIONS)
            )
            os.replace(made, path)  # written whole, then moved into place
    return path


def package_folder() -> Path:
    """Where compiled steps are kept: a folder of Inductor's cache (/tmp/torchinductor_$USER unless
    TORCHINDUCTOR_CACHE_DIR says otherwise)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "decode_steps"


def _cpu_description() -> list[str]:
    """The CPU's model name and flags as Linux describes its first core, or what Python knows of it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return [platform.processor()]
    return [next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags")]


class _OneToken(torch.nn.Module):
    """DecodeStep.one_token as a module of tensors alone, for torch.export: the cache's keys and values
    as lists, its length as the length of a tensor."""

    def __init__(self, step: DecodeStep, cache: KVCache):
        super().__init__()
        self.model = step.model
        self.step = step
        self.cache = copy.copy(cache)  # its bookkeeping: the keys and values come as inputs
        self.cache.k, self.cache.v = [], []

    def forward(self, idx, length, pad, keys, values):
        cache = copy.copy(self.cache)
        cache.k, cache.v, cache.pos = list(keys), list(values), length.size(0)
        return self.step.one_token(idx, cache, pad)[0]


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
    changed in place and frozen. compile: a compiled step: on an x86-64 CPU, for a float32
    model the DecodeStep computes and one row (batch_size 1 or None), the step compiled ahead of time
    (CompiledSteps) over layers streaming
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

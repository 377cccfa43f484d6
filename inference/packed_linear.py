"""Linear layers prepared once for inference on a CPU: faster products, in a precision of their own.

Decoding one token multiplies one row per sequence by every weight matrix, so a step's time is set by
how fast the products stream the weights from memory, not by arithmetic. On a CPU, nn.Linear hands
the product to the BLAS library PyTorch was built with, which for so few rows can fall far short of
the memory bandwidth. oneDNN, given each weight reordered once into its own blocked layout, comes
much closer (docs/benchmarks.md measures both on one machine). Inductor prepacks weights in the same
spirit when it freezes a model for CPU inference; this module does it without compiling.

Fewer bytes per weight read faster still. `pack_linears(model, precision)` swaps every nn.Linear of a
model for one of these, each holding its weight in the form its product reads:

    float32   PackedLinear: the weight reordered for oneDNN, in the model's dtype (what the model computes)
    bfloat16  PackedLinear: the weight reordered for oneDNN in bfloat16; the input is rounded to bfloat16
              for the product, and the output (rounded to bfloat16 by oneDNN) goes back as float32
    float16   Float16Linear: the weight in float16, packed by fbgemm, whose product takes and gives float32
              (made for few rows)
    int8      Int8Linear: each output row of the weight as int8 times one scale (symmetric, to nearest);
              PyTorch's weight-only int8 product reads bfloat16 inputs and gives bfloat16 outputs (from
              INT8_WIDEN_ROWS rows, oneDNN's bfloat16 product on the weight widened to bfloat16)

Everything outside the products (norms, attention, the KV cache, the residual stream) keeps the
model's dtype. The model's code and forward pass stay as they are. The result is for inference only:
its parameters are frozen, and a prepared weight is an opaque tensor, so a prepared layer refuses to
be moved, cast or saved (pack a model last, after moving and casting it, and save it before).

Each layer also offers its product on (rows, features) inputs, with GELU after it or a residual
added (`product`, `product_gelu`, `product_add`): inference/decode_step.py's one-token step calls
them, fused in one oneDNN call where the kind allows.

`stream_linears(model, precision)` prepares the layers of a step that is compiled instead (torch.export and
AOTInductor, inference/decode_step.py):
StreamedLinear holds the weight unpacked, in float32, bfloat16 or float16, and Int8Linear its int8
rows and scales; inside a compiled graph, one row's product is the weight, widened to float32, times
the row, summed along each weight row, a loop that streams the weight once (int8's four rows at a time,
each with a sum of its own: grouped_row_sums).
"""

import mmap
import platform

import torch
import torch.nn as nn
import torch.nn.functional as F

PRECISIONS = ("float32", "float16", "bfloat16", "int8")  # the kinds of products pack_linears makes
PRODUCTS = {  # how each precision's products run, for a start-up line
    None: "linear layers packed for oneDNN",
    "float32": "linear layers packed for oneDNN",
    "bfloat16": "linear layers packed for oneDNN in bfloat16 (float32 activations)",
    "float16": "float16 linear weights, fbgemm products (float32 activations)",
    "int8": "int8 linear weights with a scale per output row (bfloat16 activations in the products)",
}
INT8_WIDTH_MULTIPLE = 16  # PyTorch 2.13's weight-only int8 CPU product reads inputs of 16k features only
# the compiled one-row int8 product sums this many of the weight's rows in each pass of its loop, one from each
# block of rows (grouped_row_sums): widening int8 weights leaves that loop bound by its arithmetic, and each row's
# sum is a chain of additions; four chains side by side, sharing the row's loads, took GPT-2 124M's int8 token
# from 9.08 to 7.85 ms at one thread, 5.43 to 5.17 at two (docs/benchmarks.md); bfloat16 and float32 weights,
# read at the memory's pace, gained nothing
INT8_ROW_GROUPS = 4
# from this many rows up (a prompt, a batch), an int8 product outside a compiled graph widens the int8 weight to
# bfloat16 and takes oneDNN's bfloat16 product, where the CPU has bfloat16 instructions (bfloat16_instructions):
# PyTorch's int8 product widens each weight to float32 again for every few rows and is bound by that arithmetic.
# GPT-2 124M's 16-token prompt, two threads: 26.7 against 32.6 ms; 128 tokens 87.8 against 175.9. One 768 x 3072
# layer, in the cache: 8 rows 0.37 against 0.28 ms, 16 rows 0.49 against 0.51; all 48 block layers at 8 rows once
# ahead and once behind: 16, where every measurement agreed (docs/benchmarks.md)
INT8_WIDEN_ROWS = 16
# the weights widened at a time, in blocks of whole rows (8 MB of bfloat16): GPT-2's output layer at 16 rows took
# 7.6 ms against the int8 product's 16.0, and 32.0 widened whole (77 MB written to fresh memory at each call);
# blocks of 2M or 8M weights 8.3 and 8.8
INT8_WIDEN_BLOCK = 2**22


def packing_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the linear layers of a model on this device, in this dtype, are not packed; None when
    they can be."""
    if device.type != "cpu":
        return f"packing is for CPUs, the model is on {device.type}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        # measured on x86-64 only; elsewhere PyTorch's own CPU products may well be as fast
        return f"packing is for x86-64 CPUs, this one is {platform.machine()}"
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this PyTorch build has no oneDNN linear products"
    supported = {
        torch.float32: True,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }
    if not supported.get(dtype, False):
        return f"oneDNN has no {str(dtype).removeprefix('torch.')} products on this CPU"
    return None


def precision_unavailable(device: torch.device, dtype: torch.dtype, precision: str | None) -> str | None:
    """Why products in `precision` (one of PRECISIONS; None: the model's dtype) do not apply to a model
    on this device, in this dtype; None when they do. A precision is for a float32 model on a CPU where
    packing applies (x86-64, where they were measured)."""
    if precision is None:
        return packing_unavailable(device, dtype)
    if dtype != torch.float32:
        return f"{precision} products are for a float32 model, and this one is {_name(dtype)}"
    reason = packing_unavailable(device, torch.float32)
    if reason is not None or precision == "float32":
        return reason
    if precision == "bfloat16":
        return packing_unavailable(device, torch.bfloat16)
    if precision == "float16" and "fbgemm" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no fbgemm float16 products"
    if precision == "int8" and not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
        return "this PyTorch build has no weight-only int8 product"
    return None


class InferenceLinear(nn.Module):
    """What every prepared layer shares: y = x @ W.T + b on inputs (..., in_features), computed by
    `product` on (rows, in_features); frozen, and never moved, cast or saved."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_state_dict_pre_hook(_refuse_to_save)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            # these products have no backward: gradients would silently stop here
            raise RuntimeError("PackedLinear is for inference only: call it under torch.no_grad()")
        y = self.product(x.reshape(-1, self.in_features))  # (rows, out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """(rows, in_features) -> (rows, out_features), in x's dtype."""
        raise NotImplementedError

    def product_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """GELU (tanh-approximated, GPT-2's) of the product."""
        return F.gelu(self.product(x), approximate="tanh")

    def product_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the product, residual (rows, out_features)."""
        return residual + self.product(x)

    def _apply(self, fn, recurse=True):
        # .to(), .float(), .cuda() and the like all come here
        raise RuntimeError("a packed linear layer cannot be moved or cast: pack the model after moving and casting it")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedLinear(InferenceLinear):
    """The product of oneDNN on the weight reordered once for it, in `dtype` (default: the linear's).
    batch_size: the rows the products will mostly see (the sequences decoded together), for which
    oneDNN may choose its blocking; None: no preference. A weight in another dtype than the inputs
    (bfloat16 weights in a float32 model) reads inputs rounded to its dtype and gives its outputs back
    in the inputs' dtype."""

    def __init__(self, linear: nn.Linear, batch_size: int | None = None, dtype: torch.dtype | None = None):
        super().__init__(linear)
        weight = linear.weight.detach().to(dtype or linear.weight.dtype)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_size))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(weight.dtype))
        # GELU and the residual add are oneDNN post-ops when inputs and weight share a dtype
        self.fused = weight.dtype == linear.weight.dtype

    def product(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._linear_pointwise(
            x.to(self.packed_weight.dtype), self.packed_weight, self.bias, "none", [], ""
        )
        return y.to(x.dtype)

    def product_gelu(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().product_gelu(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "gelu", [], "tanh")

    def product_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if not self.fused:
            return super().product_add(x, residual)
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed_weight, self.bias, "add")


class StreamedLinear(InferenceLinear):
    """Products for a one-token step compiled on a CPU (traced by torch.export): the product of one row is
    written as the weight times the row, summed along each of the weight's rows, which Inductor
    turns into one loop that reads the weight once, its rows split between the threads. At one row
    that loop streams the weights faster than oneDNN's or MKL's product (docs/benchmarks.md,
    "Decoding on a CPU against llama.cpp"). The weight is kept in `dtype` (default: the linear's): a
    bfloat16 or float16 weight is widened to the row's dtype inside the loop, so the sums are the
    row's. More rows, and every call outside a compiled graph (the prompt), take a product library's:
    a bfloat16 weight's on inputs rounded to bfloat16 (oneDNN's product, where bfloat16 decoding
    applies: a third of widening the weight's time at 16 rows, under half at 512); a float16
    weight's on one row rounded to float16 (PyTorch's float16 matrix-vector product, float32 sums:
    the prompt's output layer in 3.3 ms against 52 ms widened, GPT-2 124M; half_row); otherwise
    oneDNN's on the weight as it lies (in a compiled graph F.linear's: Inductor's oneDNN lowering
    wants a constant weight), a float16 one widened to the inputs' dtype (a float16 product
    on a CPU without float16 arithmetic took 1.7x float32's time at 16 rows, 4x at 512). The weight
    lives in memory the system may back with huge pages (in_huge_pages)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype | None = None):
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach().to(dtype or linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if _one_row_compiled(x):
            y = (self.weight.to(x.dtype) * x).sum(dim=-1)[None]  # (1, out_features), summed in one compiled loop
        elif self.weight.dtype == torch.bfloat16:  # oneDNN's bfloat16 product, on inputs rounded to bfloat16
            y = F.linear(x.to(torch.bfloat16), self.weight).to(x.dtype)
        else:
            y = self.half_row(x) if self.weight.dtype == torch.float16 and x.size(0) == 1 else None  # x: (rows, in)
            if y is None and torch.compiler.is_compiling():  # several rows in a compiled graph
                return F.linear(x, self.weight.to(x.dtype), self.bias)
            if y is None:  # oneDNN's product on the weight as it lies: at 16 rows 0.66x F.linear's (MKL's) time
                return torch.ops.mkldnn._linear_pointwise(x, self.weight.to(x.dtype), self.bias, "none", [], "")
        return y if self.bias is None else y + self.bias

    def half_row(self, x: torch.Tensor) -> torch.Tensor | None:
        """One row's product by PyTorch's float16 matrix-vector product (float32 sums), in x's dtype;
        None past float16's range (65504), where the weight is widened instead."""
        y = F.linear(x.to(torch.float16), self.weight)
        return y.to(x.dtype) if torch.isfinite(y).all() else None


def _one_row_compiled(x: torch.Tensor) -> bool:
    """Whether a product of x is one row's inside a graph being compiled or exported: the one a streamed
    layer writes as a multiplication and a sum."""
    return x.size(0) == 1 and torch.compiler.is_compiling()


def in_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of tensors in one anonymous memory map advised for transparent huge pages (Linux's
    madvise): a stream through 2 MiB pages leaves the CPU's prefetchers and its TLB far less to
    restart than one through 4 KiB pages. Where the system has no such advice, the tensors as they are.
    The map lives as long as any of the copies."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not tensors:
        return tensors
    page, huge = mmap.PAGESIZE, 1 << 21
    sizes = [-(-t.numel() * t.element_size() // page) * page for t in tensors]  # each copy starts on a page
    memory = mmap.mmap(-1, sum(sizes) + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        memory.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # transparent huge pages compiled out or refused: ordinary pages, still one map
        pass
    data = torch.frombuffer(memory, dtype=torch.uint8)
    offset = -data.data_ptr() % huge  # the first copy starts on a huge page's boundary
    copies = []
    for tensor, size in zip(tensors, sizes, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        copy = data[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        copies.append(copy.copy_(tensor))
        offset += size
    return copies


class Float16Linear(InferenceLinear):
    """float16 weights packed by fbgemm (torch.ops.quantized.linear_dynamic_fp16): float32 inputs
    and outputs, the weights read at half float32's bytes and the sums kept in float32. Its packed
    weight is an fbgemm object, not a tensor (nothing to save or move in any case)."""

    def __init__(self, linear: nn.Linear, batch_size: int | None = None):
        super().__init__(linear)
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.bias = bias
        self.packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)


class Int8Linear(InferenceLinear):
    """Weight-only int8: output row n of the weight is q[n] * scale[n], q int8 in -127..127 and the
    scale max|w[n]| / 127 in bfloat16, so the largest weight of each row is exact up to the scale's
    rounding. The product is PyTorch's own (_weight_int8pack_mm) on inputs rounded to bfloat16 (on
    float32 inputs it has no fast path); from INT8_WIDEN_ROWS rows up, where the CPU has bfloat16
    instructions, oneDNN's bfloat16 product of the same rounded inputs and the weight widened to
    bfloat16 (exactly: every int8 value is a bfloat16 number) a block at a time, each output then
    scaled: faster for more rows, within the same bound (the int8 product rounds each scaled sum to
    bfloat16, this one the sum before its scale, so outputs differ in their last bits from 16 rows
    on). The bias is added in the inputs' dtype. Its inputs must be a multiple of
    INT8_WIDTH_MULTIPLE wide: a narrower layer's weight gets zero columns, and its inputs zeros, to
    that width (the same sums). Inside a compiled graph one row's product is streamed as
    StreamedLinear's is, the int8 weight widened to the row's dtype and the scale applied to each sum,
    `row_groups` rows of the weight summed side by side (grouped_row_sums)."""

    def __init__(self, linear: nn.Linear, batch_size: int | None = None):
        super().__init__(linear)
        weight = linear.weight.detach().float()
        self.padding = -self.in_features % INT8_WIDTH_MULTIPLE
        scale = (weight.abs().amax(dim=1) / 127).to(torch.bfloat16)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # a row of zeros: any scale
        q = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("weight_int8", F.pad(q, (0, self.padding)))  # (out_features, padded in_features)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.row_groups = INT8_ROW_GROUPS
        self.widens = bfloat16_instructions()  # INT8_WIDEN_ROWS rows and more

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if _one_row_compiled(x):  # streamed, as StreamedLinear's one row
            row = F.pad(x, (0, self.padding)) if self.padding else x
            y = grouped_row_sums(self.weight_int8, row, self.row_groups)[None] * self.scale.to(x.dtype)
            return y if self.bias is None else y + self.bias
        x16 = F.pad(x.to(torch.bfloat16), (0, self.padding)) if self.padding else x.to(torch.bfloat16)
        if self.widens and x.size(0) >= INT8_WIDEN_ROWS:
            y = self.widened_product(x16, x.dtype).mul_(self.scale.to(x.dtype))
        else:
            y = torch.ops.aten._weight_int8pack_mm(x16, self.weight_int8, self.scale).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)

    def widened_product(self, x16: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """oneDNN's bfloat16 product of x16 (rows, padded in_features) and the int8 weight widened to bfloat16
        (exactly), INT8_WIDEN_BLOCK weights at a time; (rows, out_features) in dtype, unscaled."""
        block = max(1, INT8_WIDEN_BLOCK // self.weight_int8.size(1))  # rows of the weight
        y = torch.empty(x16.size(0), self.out_features, dtype=dtype)
        for start in range(0, self.out_features, block):
            y[:, start : start + block] = F.linear(x16, self.weight_int8[start : start + block].to(torch.bfloat16))
        return y


def bfloat16_instructions() -> bool:
    """Whether this CPU multiplies bfloat16 numbers in its own instructions (AVX-512 BF16 or AMX), where oneDNN's
    bfloat16 products run at speed; elsewhere oneDNN emulates them."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def grouped_row_sums(weight: torch.Tensor, row: torch.Tensor, groups: int) -> torch.Tensor:
    """(weight widened to row's dtype * row).sum(dim=-1), (out_features,), for a graph Inductor compiles:
    one sum over each of `groups` blocks of the weight's rows, of equal size (the last block ends at the
    last row, overlapping the one before where the rows do not divide evenly). The blocks' sums read the
    row at the same places, so Inductor computes them in one loop, a row of each block in each pass, with
    an accumulator each: `groups` chains of additions side by side where one row's sum is one chain. Each
    row is summed over its columns in the same order as in one sum over all the rows (where Inductor
    splits both loops by rows between the threads, as for every layer of GPT-2's sizes): the same result."""
    rows = weight.size(0)
    size = -(-rows // groups)
    if groups == 1 or rows < groups:
        return (weight.to(row.dtype) * row).sum(dim=-1)
    starts = [min(i * size, rows - size) for i in range(groups)]
    sums = [(weight[start : start + size].to(row.dtype) * row).sum(dim=-1) for start in starts]
    # block i gives rows i * size onwards (from further in where it was moved back to end at the last row)
    parts = [block[i * size - start :] for i, (start, block) in enumerate(zip(starts, sums, strict=True))]
    return torch.cat([part for i, part in enumerate(parts) if i * size < rows])


def _refuse_to_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    raise RuntimeError(f"{prefix or 'the model'}: a packed model has no state_dict (save the model before packing it)")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pack_linears(model: nn.Module, precision: str | None = None, batch_size: int | None = None) -> nn.Module:
    """Swap every nn.Linear in model, in place, for a layer computing its products in `precision`
    (one of PRECISIONS, for a float32 model; None: PackedLinear in the model's dtype, as it computes),
    and freeze the model for inference (eval mode, no parameter needs gradients). batch_size: the rows
    the products will mostly see (PackedLinear). Returns the model.

    A weight shared by two modules (GPT-2's output layer and token embedding) is packed as a copy
    for the linear layer while the embedding keeps the original: for GPT-2 124M in float32 that is
    154 MB more memory (39 MB in int8)."""
    weight = next(model.parameters())
    reason = precision_unavailable(weight.device, weight.dtype, precision)
    if reason is not None:
        raise ValueError(f"cannot pack the linear layers: {reason}")
    layer = {
        None: PackedLinear,
        "float32": PackedLinear,
        "bfloat16": lambda linear, batch_size: PackedLinear(linear, batch_size, torch.bfloat16),
        "float16": Float16Linear,
        "int8": Int8Linear,
    }[precision]
    return _swap_linears(model, lambda linear: layer(linear, batch_size))


def stream_linears(model: nn.Module, precision: str = "float32") -> nn.Module:
    """Swap every nn.Linear of a float32 model on an x86-64 CPU, in place, for a layer whose one-row
    product a compiled one-token step streams (inference/decode_step.py), its weight in `precision`
    (PRECISIONS: StreamedLinear in float32, bfloat16 or float16; Int8Linear in int8) and copied
    in_huge_pages, and freeze the model. Returns the model. The copies are made while the originals
    live, and a weight shared with the token embedding (GPT-2's output layer) keeps its copy: for GPT-2
    124M, 154 MB more than the model in float32 (77 MB in bfloat16 or float16, 39 MB in int8)."""
    weight = next(model.parameters())
    reason = precision_unavailable(weight.device, weight.dtype, precision)
    if reason is not None:
        raise ValueError(f"cannot stream the linear layers: {reason}")
    if precision == "int8":
        _swap_linears(model, Int8Linear)
        name = "weight_int8"
    else:
        dtype = getattr(torch, precision)
        _swap_linears(model, lambda linear: StreamedLinear(linear, dtype))
        name = "weight"
    layers = [module for module in model.modules() if isinstance(module, (StreamedLinear, Int8Linear))]
    for layer, weight in zip(layers, in_huge_pages([getattr(layer, name) for layer in layers]), strict=True):
        setattr(layer, name, weight)
    return model


def _swap_linears(model: nn.Module, layer) -> nn.Module:
    """Replace every nn.Linear of model by layer(linear), frozen for inference (eval mode, no
    parameter needs gradients)."""
    model.eval().requires_grad_(False)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name, linear in linears:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, layer(linear))
    return model


def prepare_products(
    model: nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    compile: bool,
    precision: str | None = None,
    batch_size: int | None = None,
) -> str:
    """On an x86-64 CPU, pack the linear layers (pack_linears: in `precision`, None for the model's
    dtype, laid out for batch_size rows), which makes decoding 2 to 3 times faster in float32, unless
    the model is to be compiled. Returns how the matrix products run, for the start-up line of
    sample.py, eval.py and serve.py."""
    reason = "torch.compile cannot trace packed layers" if compile else precision_unavailable(device, dtype, precision)
    if reason is not None:
        return f"nn.Linear products ({reason})"
    pack_linears(model, precision, batch_size)
    return PRODUCTS[precision]

"""Attention patterns, each written once as a rule: may the query at position q of row b see the
key at position k?

A rule takes three integer tensors that broadcast against each other (rows b, query positions q,
key positions k; positions count from the row's first real token) and returns a boolean tensor of
their common shape, True where the query may attend. Every consumer derives its form from the same
rule: `dense_mask` evaluates it on a grid for `scaled_dot_product_attention` (CPU, and the CUDA
fallback), the KV cache evaluates it at the cached keys' positions, `attention.flex_block_mask`
hands it to FlexAttention as a mask_mod, and plot.py draws it.

The patterns (config keys of GPTConfig):
- causal: k <= q. Every other rule below includes it, except block-causal, which relaxes it.
- sliding window of W (attn_window): also q - W < k, so memory and work are bounded by W.
- sink tokens (attn_sinks): the first S positions stay visible to every later query however the
  window moves. A sink sees only its own past (k <= q holds for sinks too): a "global" token that
  saw the whole row would carry later tokens into every query that reads it, and the model could
  read its targets through it.
- prefix-LM (attn_prefix_lm): the first P positions of row b (P = prefix[b]) see each other in both
  directions; later ones are causal over everything before them.
- block-causal (attn_block): positions are cut into blocks of K; full attention inside a block,
  causal between blocks.
- documents (attn_documents): a query sees only earlier keys of its own document.

Documents also give positions (attn_document_positions): `document_positions` counts each token's
position from the start of its document instead of the row's. That changes what the position
embedding or rotation sees, never the mask: the rules above always read row positions.
"""

from collections.abc import Callable

import torch

Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
UNWRITTEN = -(2**40)  # the position of a cache slot holding no key yet: below any real or padding position


def causal(b: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return k <= q


def sliding_window(size: int) -> Rule:
    def rule(b, q, k):
        return (k <= q) & (k > q - size)

    return rule


def sinks(count: int) -> Rule:
    def rule(b, q, k):
        return (k < count) & (k <= q)

    return rule


def prefix_lm(prefix: torch.Tensor) -> Rule:
    """prefix: (B,) the bidirectional prefix length of each row."""

    def rule(b, q, k):
        return (k <= q) | (k < prefix[b])

    return rule


def block_causal(size: int) -> Rule:
    def rule(b, q, k):
        return k // size <= q // size

    return rule


def same_document(doc_ids: torch.Tensor) -> Rule:
    """doc_ids: (B, L) the document of each position of each row (see `document_ids`)."""

    def rule(b, q, k):
        return (k <= q) & (doc_ids[b, q] == doc_ids[b, k])

    return rule


def all_of(*rules: Rule) -> Rule:
    def rule(b, q, k):
        allowed = rules[0](b, q, k)
        for other in rules[1:]:
            allowed = allowed & other(b, q, k)
        return allowed

    return rule


def any_of(*rules: Rule) -> Rule:
    def rule(b, q, k):
        allowed = rules[0](b, q, k)
        for other in rules[1:]:
            allowed = allowed | other(b, q, k)
        return allowed

    return rule


def pattern_rule(config, prefix: torch.Tensor | None = None, doc_ids: torch.Tensor | None = None) -> Rule:
    """The rule of a GPTConfig's pattern. prefix: (B,) prefix lengths, for attn_prefix_lm (None:
    no prefix, plain causal). doc_ids: (B, L) document of each position, for attn_documents."""
    if config.attn_block:
        base = block_causal(config.attn_block)
    elif config.attn_prefix_lm and prefix is not None:
        base = prefix_lm(prefix)
    else:
        base = causal
    rules = [base]
    if config.attn_window:
        rules.append(sliding_window(config.attn_window))
    if config.attn_documents:
        rules.append(same_document(doc_ids))
    rule = all_of(*rules) if len(rules) > 1 else base
    if config.attn_sinks:
        rule = any_of(rule, sinks(config.attn_sinks))
    return rule


def is_plain_causal(config) -> bool:
    """Whether the pattern is plain causal attention, which needs no mask (sinks change nothing
    without a window: a causal query already sees the first positions)."""
    return not (config.attn_window or config.attn_prefix_lm or config.attn_block or config.attn_documents)


def dense_mask(rule: Rule, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """The rule on a grid: (B, 1, Tq, Tk) boolean, True where a query may attend to a key.

    q_pos: (B, Tq) and k_pos: (B, Tk) positions of the queries and keys. A negative position is
    left padding (or, for a key, a cache slot not written yet): no real query sees it, and a
    padding query sees only itself, so no row of the softmax is empty (its output is never used).
    """
    B = q_pos.size(0)
    b = torch.arange(B, device=q_pos.device)[:, None, None]  # (B, 1, 1)
    q = q_pos[:, :, None]  # (B, Tq, 1)
    k = k_pos[:, None, :]  # (B, 1, Tk)
    real = (q >= 0) & (k >= 0)
    allowed = rule(b, q.clamp(min=0), k.clamp(min=0)) & real  # (B, Tq, Tk)
    return (allowed | ((q == k) & (q < 0)))[:, None]  # (B, 1, Tq, Tk)


def document_ids(
    idx: torch.Tensor,
    eot_token: int,
    positions: torch.Tensor,
    table: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The document of each position: the count of end-of-text tokens at or before it. The
    end-of-text token between two documents opens the second one, where it acts as its
    beginning-of-sequence token; the last token of the first predicts it.

    idx: (B, T) tokens; positions: (B, T) their positions (negative: left padding, skipped). The
    ids are written by position into table (B, L + 1), whose last column takes the padding's (a new
    (B, T + 1) table without one), counting on from seen (B, 1) end-of-text tokens before idx.
    Returns the table (doc of row b's position p: table[b, p]) and the count at the end of idx.
    """
    B, T = idx.shape
    is_eot = (idx == eot_token) & (positions >= 0)
    ids = is_eot.long().cumsum(dim=1)  # (B, T)
    if seen is not None:
        ids = ids + seen
    if table is None:
        table = torch.zeros(B, T + 1, dtype=torch.long, device=idx.device)
    scratch = table.size(1) - 1
    table.scatter_(1, torch.where(positions >= 0, positions, scratch), ids)
    return table, ids[:, -1:]


def document_positions(
    idx: torch.Tensor, eot_token: int, positions: torch.Tensor, start: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's position in its own document: its row position minus that of its document's
    first token, which is the row's first token or an end-of-text token (it opens the document
    after it, as in `document_ids`, so it takes position 0 there).

    idx: (B, T) tokens; positions: (B, T) their row positions (negative: left padding, which stays
    negative). start: (B, 1) the row position where the document open before idx began (None: 0).
    Returns the positions (B, T) and the start of the document open at the end of idx (B, 1).
    """
    is_eot = (idx == eot_token) & (positions >= 0)
    starts = torch.where(is_eot, positions, 0 if start is None else start)  # (B, T)
    starts = starts.cummax(dim=1).values  # row positions grow along the row: the latest start so far
    return positions - starts, starts[:, -1:]

"""Tree-packed sequences: the turns of a micro-batch as one prefix tree, each distinct prefix computed once
(docs/models.md, Tree packing).

The turns of an iteration share long prefixes: the system text and rules of every prompt, the state a task group
starts in, the turns a step group shares. `pack` lays the prompt + response tokens of several turns out as the nodes
of their prefix tree (a trie: one node per distinct prefix), in one row. Each node attends to its ancestors and
itself only (a 4-D mask: booleans, or 0 / -inf for eager attention) and sits at the position of its depth, so its
hidden states, and every log-prob read from them, are those of the same tokens in their own unpacked sequence, up
to floating-point summation order.

`response_logprobs` returns the same right-padded [turns, width - 1] layout as `pad_batch` + `token_logprobs`,
packed or not, so that the update, the warm start and the fits change only the call. Gradients flow through the
shared nodes once, as the sum of what each turn would have sent: the same gradient.

Attention, two ways (`ATTENTION`):

- `paths` (where the model's attention is Hugging Face's SDPA or eager one without logit soft-capping): each
  token's query attends along its own root-to-node path only. In the order the tree is built, the nodes a sequence
  adds are a suffix of it; those queries attend to the sequence's path, gathered once (causal: a query sees the
  keys at its depth or above). Sequences of similar shape share one SDPA call, padded to at most `PAD_SLACK` times
  their own cells (`_batches`): a micro-batch of 16 turns makes a few calls per layer instead of 16 (`segments`:
  one call per sequence, kept for `bench.packing` to time). Scores cost about the sum over sequences of (new nodes)
  x (path length) instead of T x T, the gathered keys and values are those of the sequences' paths (no wider, and
  grouped-query heads are not repeated), and no T x T mask is built: `_PathLayout`, `_path_attention`.
- `mask`: one T x T boolean mask (a token sees its ancestors; 4 MiB at T = 2,048, 16 MiB where SDPA widens it to
  fp32) over the whole row, which SDPA's CPU kernel computes densely, masked or not. Any model that takes a 4-D
  mask.

Memory: activations scale with T instead of the turns' total length; `micro_batches` sizes micro-batches by packed
tokens (`update.micro_batch_tokens`).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pipeline.model.policy import _accepts_logits_to_keep, _lm_class, pad_batch, token_logprobs
from pipeline.model.precision import autocast

__all__ = ["ATTENTION", "Packed", "attention_mask", "grouped_micro_batches", "micro_batches", "pack", "packed_tokens",
           "passes", "response_logprobs", "tree_forward"]

# mode: "paths", "segments" or "mask" (module docstring), bench.packing times each; cpu_kernel: SDPA's kernel for
# the path attention on a CPU, "math" (matrix products; its backward is the faster there) or "flash"
ATTENTION = {"mode": "paths", "cpu_kernel": "math"}
_IMPL = "creditrl_tree_paths"   # the name of the path attention in transformers' AttentionInterface


@dataclass(frozen=True)
class Packed:
    """One prefix tree of `n` sequences: `ids`, `positions` ([T]), `paths[i]` the node of each token of sequence i
    (its length is the sequence's)."""
    ids: torch.Tensor
    positions: torch.Tensor
    paths: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @cached_property
    def mask(self) -> torch.Tensor:
        """[T, T], row attends to column: each node sees its ancestors and itself. Built on first use only (the
        path attention needs none)."""
        mask = torch.zeros((self.tokens, self.tokens), dtype=torch.bool)
        for path in self.paths:     # along a path, token t sees tokens 0..t of the same path: its ancestors
            length = len(path)
            tril = torch.ones((length, length), dtype=torch.bool).tril()
            mask[path.unsqueeze(1), path.unsqueeze(0)] |= tril
        return mask


class _Trie:
    """The distinct prefixes of the sequences added so far: one node each, numbered in order of first appearance (a
    parent before its children), with its token and depth."""

    def __init__(self):
        self.nodes: dict[tuple[int, int], int] = {}     # (parent node, token) -> node; the root is -1
        self.tokens: list[int] = []
        self.depth: list[int] = []

    def new_nodes(self, seq) -> int:
        """How many nodes `seq` would add."""
        node = -1
        for t, tok in enumerate(seq):
            nxt = self.nodes.get((node, int(tok)))
            if nxt is None:
                return len(seq) - t
            node = nxt
        return 0

    def add(self, seq) -> list[int]:
        """Add `seq`; the node of each of its tokens."""
        node, path = -1, []
        for t, tok in enumerate(seq):
            key = (node, int(tok))
            nxt = self.nodes.get(key)
            if nxt is None:
                nxt = self.nodes[key] = len(self.tokens)
                self.tokens.append(int(tok))
                self.depth.append(t)
            node = nxt
            path.append(node)
        return path

    def __len__(self) -> int:
        return len(self.nodes)


def pack(sequences: list[list[int]]) -> Packed:
    """The prefix tree of `sequences`: nodes in order of first appearance (a parent before its children), depth as
    position, each node seeing its ancestors and itself."""
    trie = _Trie()
    paths = [torch.tensor(trie.add(seq), dtype=torch.long) for seq in sequences]
    return Packed(torch.tensor(trie.tokens, dtype=torch.long), torch.tensor(trie.depth, dtype=torch.long), paths)


def packed_tokens(sequences) -> int:
    """The number of distinct prefixes of `sequences`: the tokens their prefix tree holds."""
    trie = _Trie()
    for seq in sequences:
        trie.add(seq)
    return len(trie)


def padded_tokens(sequences) -> int:
    """The tokens a padded batch of `sequences` computes: its rows times the longest."""
    return len(sequences) * max(map(len, sequences))


def micro_batches(sequences, order: list[int], max_tokens: int) -> list[list[int]]:
    """`order` (indices into `sequences`, one minibatch) cut into micro-batches whose prefix trees hold at most
    `max_tokens` tokens each (a single longer sequence makes a micro-batch of its own), the turns sorted by their
    tokens first so that shared prefixes fall into the same micro-batch. Which micro-batch a turn lands in does not
    change the minibatch's gradient (the loss is a sum over the minibatch's tokens)."""
    return grouped_micro_batches({i: (sequences[i],) for i in order}, order, max_tokens)


def passes(prompts, responses, order: list[int], size: int, packing: str, max_tokens: int | None) -> list[list[int]]:
    """The turns `order` (indices into `prompts` and `responses`, repeats allowed) in forward passes: `size` at a
    time in that order, or with `packing` tree and `max_tokens`, prefix trees of at most that many tokens (the turns
    sorted so that shared prefixes fall together, `micro_batches`)."""
    if packing == "tree" and max_tokens:
        seqs = {i: list(prompts[i]) + list(responses[i]) for i in order}
        return micro_batches(seqs, order, max_tokens)
    return [order[b: b + size] for b in range(0, len(order), size)]


def grouped_micro_batches(items, order: list[int], max_tokens: int) -> list[list[int]]:
    """`micro_batches` for items of several sequences that go through the model together (a preference pair's
    chosen and rejected turns): `order` (indices into `items`) cut into micro-batches whose prefix trees hold at
    most `max_tokens` tokens (a larger item alone), the items sorted by their first sequence's tokens."""
    out: list[list[int]] = []
    part: list[int] = []
    trie = _Trie()
    for i in sorted(order, key=lambda j: list(items[j][0])):
        if part and len(trie) + _new_nodes(trie, items[i]) > max_tokens:
            out.append(part)
            part, trie = [], _Trie()
        part.append(i)
        for seq in items[i]:
            trie.add(seq)
    if part:
        out.append(part)
    return out


def _new_nodes(trie: _Trie, seqs) -> int:
    """The nodes `seqs` would add to `trie` together: each sequence's tokens beyond the longest prefix it shares with
    the tree or with a sequence before it (the tree and those sequences' prefixes are all the tree then holds)."""
    new = 0
    for k, seq in enumerate(seqs):
        known = max([len(seq) - trie.new_nodes(seq)] + [_common_prefix(seq, o) for o in seqs[:k]])
        new += len(seq) - known
    return new


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if int(x) != int(y):
            break
        n += 1
    return n


@dataclass(frozen=True)
class _Segment:
    """One sequence's share of the path attention: the nodes `start`..`stop` - 1 it adds to the tree (a suffix of
    its path: `_Trie` numbers a sequence's new nodes consecutively), `keys` [L] its whole path, `mask` [Lq, L] (the
    query at depth L - Lq + i sees the keys at depth <= its own) or None where the sequence adds its whole path
    (plain causal attention)."""
    start: int
    stop: int
    keys: torch.Tensor
    mask: torch.Tensor | None

    def to(self, device) -> _Segment:
        return _Segment(self.start, self.stop, self.keys.to(device),
                        None if self.mask is None else self.mask.to(device))


@dataclass(frozen=True)
class _Batch:
    """Segments that go through one SDPA call, padded: `queries` [B, Q] and `keys` [B, K] the node of each query and
    key (padding reads node 0), `mask` [B, 1, Q, K] (a real query sees its path's keys at its depth or above; a
    padding query sees key 0, so that no row is empty) or None (every segment a whole path of one length: plain
    causal), `valid` [B * Q] the real queries' cells, row by row."""
    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor | None
    valid: torch.Tensor

    def to(self, device) -> _Batch:
        return _Batch(self.queries.to(device), self.keys.to(device),
                      None if self.mask is None else self.mask.to(device), self.valid.to(device))


@dataclass(frozen=True)
class _PathLayout:
    """Where each sequence's new nodes read (`segments`, in the order the tree was built: their node ranges tile
    0..T - 1 in order, so the segments' outputs concatenated are the row's); the same segments in `batches` of
    similar shapes (`_batches`); and, for one gather a layer instead of one a batch, `queries` and `keys`, every
    batch's query and key nodes flattened, batch after batch, and `take`, the rows of the batches' padded outputs
    (flattened, concatenated) that are the row's, in node order."""
    segments: list[_Segment]
    batches: list[_Batch]
    queries: torch.Tensor
    keys: torch.Tensor
    take: torch.Tensor

    @classmethod
    def of(cls, segments: list[_Segment], batches: list[_Batch], inverse: torch.Tensor) -> _PathLayout:
        """The layout of `_batches`' batches and `inverse` (each node's place among the real outputs)."""
        def flat(xs):
            return torch.cat(xs) if xs else torch.zeros(0, dtype=torch.long)
        offsets, at = [], 0
        for b in batches:
            offsets.append(at + b.valid.nonzero().squeeze(1))
            at += b.valid.numel()
        return cls(segments, batches, flat([b.queries.reshape(-1) for b in batches]),
                   flat([b.keys.reshape(-1) for b in batches]), flat(offsets)[inverse])

    def to(self, device) -> _PathLayout:
        return _PathLayout([g.to(device) for g in self.segments], [b.to(device) for b in self.batches],
                           self.queries.to(device), self.keys.to(device), self.take.to(device))


PAD_SLACK = 1.25    # a batch computes at most this many times its segments' own query x key cells


def _batches(segments: list[_Segment]) -> tuple[list[_Batch], torch.Tensor]:
    """The segments in batches for one SDPA call each: sorted by their queries, longest first, each batch as many
    as keep its padded cells (B x Q x K) within `PAD_SLACK` times its segments' own (each Lq x L); and the
    permutation that puts the batches' outputs back in node order."""
    order = sorted(range(len(segments)), key=lambda i: (-(segments[i].stop - segments[i].start),
                                                        -len(segments[i].keys)))
    groups: list[list[int]] = []
    for i in order:
        g = segments[i]
        cells = (g.stop - g.start) * len(g.keys)
        if groups:
            last = groups[-1]
            q = segments[last[0]].stop - segments[last[0]].start       # the longest queries come first
            k = max(len(g.keys), *(len(segments[j].keys) for j in last))
            own = cells + sum((segments[j].stop - segments[j].start) * len(segments[j].keys) for j in last)
            if (len(last) + 1) * q * k <= PAD_SLACK * own:
                last.append(i)
                continue
        groups.append([i])
    batches, nodes = [], []
    for group in groups:
        segs = [segments[i] for i in group]
        q = max(g.stop - g.start for g in segs)
        k = max(len(g.keys) for g in segs)
        queries = torch.zeros((len(segs), q), dtype=torch.long)
        keys = torch.zeros((len(segs), k), dtype=torch.long)
        valid = torch.zeros((len(segs), q), dtype=torch.bool)
        causal = all(g.mask is None and len(g.keys) == k for g in segs)
        mask = None if causal else torch.zeros((len(segs), 1, q, k), dtype=torch.bool)
        for b, g in enumerate(segs):
            lq, length = g.stop - g.start, len(g.keys)
            queries[b, :lq] = torch.arange(g.start, g.stop)
            keys[b, :length] = g.keys
            valid[b, :lq] = True
            if mask is not None:
                depth = torch.arange(length - lq, length)           # the depths of the segment's queries
                mask[b, 0, :lq, :length] = torch.arange(length).unsqueeze(0) <= depth.unsqueeze(1)
                mask[b, 0, lq:, 0] = True
            nodes.append(queries[b, :lq])
        batches.append(_Batch(queries, keys, mask, valid.reshape(-1)))
    placed = torch.cat(nodes) if nodes else torch.zeros(0, dtype=torch.long)
    inverse = torch.empty_like(placed)
    inverse[placed] = torch.arange(len(placed))
    return batches, inverse


def _path_layout(tree: Packed) -> _PathLayout:
    """The segments of `tree`: for each sequence, in the order the tree was built, the nodes it added (a suffix of
    its path: what it shares with earlier sequences is a prefix) against its path's nodes; and their batches."""
    segments = []
    seen = 0                        # nodes numbered so far: a sequence's new nodes are seen, seen + 1, ...
    for path in tree.paths:
        new = (path >= seen).nonzero()
        if len(new) == 0:
            continue
        first, length = int(new[0]), len(path)
        mask = None
        if first > 0:
            mask = torch.arange(length).unsqueeze(0) <= torch.arange(first, length).unsqueeze(1)
        segments.append(_Segment(seen, seen + length - first, path, mask))
        seen += length - first
    return _PathLayout.of(segments, *_batches(segments))


_ACTIVE: list[_PathLayout] = []     # the layout of the forward in progress (`tree_forward`)


def _path_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function interface ([1, heads, T, d] in, [1, T, heads, d] out) over `_ACTIVE[-1]`:
    per batch of segments (`_batches`), their new nodes' queries against their paths' keys (gathered: no copy wider
    than the paths, and grouped-query heads are not repeated), one SDPA call; the batches' outputs, put back in node
    order, are the row's. `ATTENTION` `segments`: one SDPA call per segment instead (the same numbers, for
    `bench.packing` to time)."""
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    layout = _ACTIVE[-1]
    with _cpu_kernel(query.device):
        return _paths(query, key, value, layout, dropout, scaling, gqa)


def _cpu_kernel(device):
    """On a CPU, SDPA's kernel `ATTENTION["cpu_kernel"]`: the math one computes the scores with matrix products,
    as accurate as the flash kernel in bf16, and on short paths of narrow heads (SmolLM2's: 64 wide) the faster of
    the two in bf16 (docs/results/README.md, bf16 on a CPU; `bench.precision`); elsewhere SDPA picks."""
    if device.type != "cpu" or ATTENTION["cpu_kernel"] != "math":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _paths(query, key, value, layout, dropout, scaling, gqa):
    if ATTENTION["mode"] == "segments":
        outs = [F.scaled_dot_product_attention(query[:, :, g.start:g.stop], key[:, :, g.keys], value[:, :, g.keys],
                                               attn_mask=g.mask, dropout_p=dropout, is_causal=g.mask is None,
                                               scale=scaling, enable_gqa=gqa)
                for g in layout.segments]
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None
    # One gather of queries, keys and values for all batches, split into views, and one take of the outputs: in
    # the backward pass each gather scatters its gradient into a zeroed tensor of the row's size, so one a layer
    # instead of one per batch and tensor (three times as many zero-fills and accumulations, or more).
    heads, d = query.shape[1], query.shape[3]
    sizes_q = [b.queries.numel() for b in layout.batches]
    sizes_k = [b.keys.numel() for b in layout.batches]
    qs = query[0][:, layout.queries].split(sizes_q, dim=1)
    ks, vs = key[0][:, layout.keys].split(sizes_k, dim=1), value[0][:, layout.keys].split(sizes_k, dim=1)
    outs = []
    for b, q, k, v in zip(layout.batches, qs, ks, vs, strict=True):
        shape_q, shape_k = b.queries.shape, b.keys.shape
        q = q.unflatten(1, shape_q).transpose(0, 1)                # [B, heads, Q, d]
        k, v = k.unflatten(1, shape_k).transpose(0, 1), v.unflatten(1, shape_k).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=b.mask, dropout_p=dropout, is_causal=b.mask is None,
                                           scale=scaling, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(-1, heads, d))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[layout.take].unsqueeze(0), None


def _paths_apply(model) -> bool:
    """Whether the path attention can stand in for `model`'s: a transformers model whose attention is SDPA or
    eager (the same maths) without logit soft-capping (a sliding window is checked by `_check_window`), and without
    gradient checkpointing, whose backward pass recomputes the layers after `tree_forward` has given the model its
    own attention back."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if getattr(model, "is_gradient_checkpointing", False):
        return False
    return not getattr(config, "attn_logit_softcapping", None)


def _check_window(model, tree: Packed) -> None:
    """A model with sliding-window attention is refused once a sequence is longer than its window (neither the
    mask nor the paths reproduce the window)."""
    window = getattr(getattr(model, "config", None), "sliding_window", None)
    longest = int(tree.positions.max()) + 1 if tree.tokens else 0
    if isinstance(window, int) and longest > window:
        raise ValueError(f"packing tree: a sequence of {longest} tokens is longer than the model's sliding attention "
                         f"window ({window}), which the tree's mask does not reproduce; set the packing key to none "
                         "for this model")


def _register_paths() -> None:
    from transformers import AttentionInterface  # start-up cost: transformers

    if _IMPL not in AttentionInterface._global_mapping:
        AttentionInterface.register(_IMPL, _path_attention)


@contextmanager
def tree_forward(model, tree: Packed, device):
    """The keyword arguments of a forward of `model` over `tree` (input ids, positions, and the mask or the path
    attention, `ATTENTION`), valid inside the block: the path attention swaps the model's attention implementation
    for the block's forward."""
    kwargs = {"input_ids": tree.ids.unsqueeze(0).to(device), "position_ids": tree.positions.unsqueeze(0).to(device)}
    if ATTENTION["mode"] == "mask" or not _paths_apply(model):
        yield {**kwargs, "attention_mask": attention_mask(model, tree).to(device)}    # checks the window
        return
    _check_window(model, tree)
    _register_paths()
    config = model.config
    before = config._attn_implementation
    _ACTIVE.append(_path_layout(tree).to(device))
    config._attn_implementation = _IMPL
    try:
        yield kwargs
    finally:
        config._attn_implementation = before
        _ACTIVE.pop()


def attention_mask(model, tree: Packed) -> torch.Tensor:
    """The tree's mask as the model's attention takes a ready 4-D mask: booleans for SDPA and the kernels, an
    additive float mask (0 or the float minimum) for eager attention, which adds whatever it is given."""
    _check_window(model, tree)
    config = getattr(model, "config", None)
    mask = tree.mask[None, None]
    if getattr(config, "_attn_implementation", "sdpa") == "eager":
        return torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)
    return mask


def response_logprobs(model, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      packing: str = "none", with_entropy: bool = False, temperature: float = 1.0):
    """(log-probs [B, W-1], entropies or None, response mask [B, W-1]) of each turn's response tokens under `model`
    at `temperature`, in `pad_batch`'s right-padded layout (only the cells of the response mask are meaningful),
    computed on the padded batch (`packing: none`) or on its prefix tree (`tree`)."""
    ids, _, resp = pad_batch(prompts, responses, pad_id)
    if packing == "none":
        logp, entropy = token_logprobs(model, ids, resp, with_entropy=with_entropy, temperature=temperature)
        return logp, entropy, resp
    if packing != "tree":
        raise ValueError(f"packing: {packing!r}; expected 'none' or 'tree'")
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    tree = pack(seqs)
    device = next(model.parameters()).device
    # the rows whose next-token distribution some response token is read from
    reads = [(i, t) for i, (p, s) in enumerate(zip(prompts, seqs)) for t in range(len(p) - 1, len(s) - 1)]
    rows = torch.stack([tree.paths[i][t] for i, t in reads]) if reads else torch.zeros(0, dtype=torch.long)
    keep, where = torch.unique(rows, return_inverse=True)
    with autocast(model), tree_forward(model, tree, device) as kwargs:
        if _accepts_logits_to_keep(_lm_class(model)):
            logits = model(**kwargs, logits_to_keep=keep.to(device)).logits[0].float()
        else:
            logits = model(**kwargs).logits[0][keep.to(device)].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    nxt = torch.tensor([seqs[i][t + 1] for i, t in reads], dtype=torch.long, device=device)
    where = where.to(device)
    picked = logp_all[where].gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
    width = ids.shape[1] - 1
    flat = resp.reshape(-1).nonzero().squeeze(1).to(device)    # pad_batch's response cells, row by row, in order
    logp = picked.new_zeros(len(seqs) * width).index_put((flat,), picked).view(len(seqs), width)
    entropy = None
    if with_entropy:
        ent_rows = -(logp_all.exp() * logp_all).sum(-1)
        entropy = ent_rows.new_zeros(len(seqs) * width).index_put((flat,), ent_rows[where]).view(len(seqs), width)
    return logp, entropy, resp

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

Memory: the mask is T x T booleans for T packed tokens (4 MiB at T = 2,048; SDPA may widen it to the compute dtype,
16 MiB in fp32), beside activations that scale with T instead of the turns' total length; `micro_batches` sizes
micro-batches by packed tokens (`update.micro_batch_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.model.policy import _accepts_logits_to_keep, _lm_class, pad_batch, token_logprobs
from pipeline.model.precision import autocast

__all__ = ["Packed", "attention_mask", "grouped_micro_batches", "micro_batches", "pack", "packed_tokens", "passes",
           "response_logprobs"]


@dataclass(frozen=True)
class Packed:
    """One prefix tree of `n` sequences: `ids`, `positions` ([T]), `mask` ([T, T], row attends to column),
    `paths[i]` the node of each token of sequence i (its length is the sequence's)."""
    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    paths: list[torch.Tensor]

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])


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
    n = len(trie)
    mask = torch.zeros((n, n), dtype=torch.bool)
    for path in paths:              # along a path, token t sees tokens 0..t of the same path: its ancestors
        length = len(path)
        tril = torch.ones((length, length), dtype=torch.bool).tril()
        mask[path.unsqueeze(1), path.unsqueeze(0)] |= tril
    return Packed(torch.tensor(trie.tokens, dtype=torch.long), torch.tensor(trie.depth, dtype=torch.long), mask, paths)


def packed_tokens(sequences) -> int:
    """The number of distinct prefixes of `sequences`: the tokens their prefix tree holds."""
    trie = _Trie()
    for seq in sequences:
        trie.add(seq)
    return len(trie)


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


def attention_mask(model, tree: Packed) -> torch.Tensor:
    """The tree's mask as the model's attention takes a ready 4-D mask: booleans for SDPA and the kernels, an
    additive float mask (0 or the float minimum) for eager attention, which adds whatever it is given. A model with
    sliding-window attention is refused once a sequence is longer than its window (the mask does not reproduce it)."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    longest = int(tree.positions.max()) + 1 if tree.tokens else 0
    if isinstance(window, int) and longest > window:
        raise ValueError(f"packing tree: a sequence of {longest} tokens is longer than the model's sliding attention "
                         f"window ({window}), which the tree's mask does not reproduce; set the packing key to none "
                         "for this model")
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
    kwargs = {"input_ids": tree.ids.unsqueeze(0).to(device), "position_ids": tree.positions.unsqueeze(0).to(device),
              "attention_mask": attention_mask(model, tree).to(device)}
    with autocast(model):
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

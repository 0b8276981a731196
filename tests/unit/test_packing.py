"""Tree packing (`update.packing: tree`, pipeline/model/packing.py): a micro-batch's turns as one prefix tree give
every response token the log-prob it has in its own sequence, and the update the same weights."""

import pytest
import torch

from pipeline.config.params import TinyModelConfig, UpdateConfig
from pipeline.data.section import LoraSettings
from pipeline.model.packing import micro_batches, pack, packed_tokens, response_logprobs
from pipeline.model.policy import build_tiny_model, with_lora
from tests.conftest import PAD, counting_packs, sgd_update, tiny_llama


def test_three_turns_sharing_a_prefix_pack_into_their_tree_by_hand():
    # a: 1 2 3 4 | b: 1 2 5 | c: 1 2 3 6 7 -> nodes 1 2 3 4 5 6 7 (12 tokens in 7)
    tree = pack([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]])
    assert tree.ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and tree.tokens == 7
    assert tree.positions.tolist() == [0, 1, 2, 3, 2, 3, 4]
    assert [p.tolist() for p in tree.paths] == [[0, 1, 2, 3], [0, 1, 4], [0, 1, 2, 5, 6]]
    assert tree.mask.int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],     # 4 sees 1 2 3, not 5 6 7
        [1, 1, 0, 0, 1, 0, 0],     # 5 (b's) sees 1 2 only
        [1, 1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 1]]
    assert packed_tokens([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]]) == 7
    assert packed_tokens([[1, 2], [1, 2]]) == 2 and packed_tokens([[1, 2], [2, 1]]) == 4


def test_the_path_attention_reads_each_new_node_once_along_its_own_path_by_hand():
    from pipeline.model.packing import _path_layout

    # a: nodes 0 1 2 3 | b: 0 1 4 (adds 4 at depth 2) | c: 0 1 2 5 6 (adds 5 6 at depths 3 4)
    layout = _path_layout(pack([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 6, 7]]))
    a, b, c = layout.segments
    assert (a.start, a.stop, a.keys.tolist(), a.mask) == (0, 4, [0, 1, 2, 3], None)      # plain causal
    assert (b.start, b.stop, b.keys.tolist()) == (4, 5, [0, 1, 4])                       # adds node 4
    assert b.mask.int().tolist() == [[1, 1, 1]]                        # node 4 sees 0 1 and itself
    assert (c.start, c.stop, c.keys.tolist()) == (5, 7, [0, 1, 2, 5, 6])                 # adds nodes 5 6
    assert c.mask.int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # a sequence the tree already holds (a repeat, or a prefix of another) adds no queries
    again = _path_layout(pack([[1, 2, 3], [1, 2], [1, 2, 3]]))
    assert [(g.start, g.stop) for g in again.segments] == [(0, 3)]


def test_segments_of_one_shape_share_an_sdpa_call_by_hand():
    from pipeline.model.packing import _batches, _path_layout

    # two unrelated 3-token sequences: whole paths of one length, one causal call without a mask
    (b,) = _path_layout(pack([[1, 2, 3], [4, 5, 6]])).batches
    assert b.queries.tolist() == [[0, 1, 2], [3, 4, 5]] and b.keys.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert b.mask is None and b.valid.all()
    # a: nodes 0-3 | b adds node 4 at depth 3 | c adds node 5 at depth 3: b and c share a call, a (4 queries)
    # would pad them to 2 x 4 x 4 = 32 cells for their 20, over PAD_SLACK
    layout = _path_layout(pack([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 6]]))
    whole, pair = layout.batches
    assert whole.queries.tolist() == [[0, 1, 2, 3]] and whole.mask is None
    assert pair.queries.tolist() == [[4], [5]] and pair.keys.tolist() == [[0, 1, 2, 4], [0, 1, 2, 5]]
    assert pair.mask.int().tolist() == [[[[1, 1, 1, 1]]], [[[1, 1, 1, 1]]]]
    assert _batches(layout.segments)[1].tolist() == [0, 1, 2, 3, 4, 5]      # each node's output, in order
    # padding: a 1-token sequence after a 4-token one, and a branch added last; the outputs come back in node order
    layout = _path_layout(pack([[1, 2, 3, 4], [7], [1, 2, 3, 5]]))
    assert [b.queries.tolist() for b in layout.batches] == [[[0, 1, 2, 3]], [[5]], [[4]]]
    assert _batches(layout.segments)[1].tolist() == [0, 1, 2, 3, 5, 4]
    # padded queries and keys: two 2-query segments of paths 3 and 4 long share a call (2 x 2 x 4 = 16 cells for 14)
    layout = _path_layout(pack([[1, 2, 3, 4], [1, 2, 8, 9], [1, 5, 6]]))
    merged = [b for b in layout.batches if len(b.queries) > 1]
    assert len(merged) == 1
    (m,) = merged
    assert m.queries.tolist() == [[4, 5], [6, 7]] and m.keys.tolist() == [[0, 1, 4, 5], [0, 6, 7, 0]]
    assert m.valid.tolist() == [True, True, True, True]
    assert m.mask.int().tolist() == [[[[1, 1, 1, 0], [1, 1, 1, 1]]], [[[1, 1, 0, 0], [1, 1, 1, 0]]]]


def test_all_batches_gather_at_once_and_their_outputs_come_back_in_node_order_by_hand():
    """One gather a layer for every batch's queries (and one for keys, one for values) and one take of the outputs:
    the batches' node lists flattened in batch order, and each node's row among the padded outputs concatenated."""
    from pipeline.model.packing import _batches, _path_layout

    # a: nodes 0-5 | c adds 6 7 (depths 4 5) | b adds 8 9 10 (depths 3-5) | d adds 11 (depth 6). b and c share a
    # call (3 x 2 queries, c's third padded with node 0); a and d go alone
    layout = _path_layout(pack([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 10, 11], [1, 2, 3, 7, 8, 9],
                                [1, 2, 3, 4, 5, 6, 12]]))
    assert [b.queries.tolist() for b in layout.batches] == [[[0, 1, 2, 3, 4, 5]], [[8, 9, 10], [6, 7, 0]], [[11]]]
    assert layout.queries.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 6, 7, 0, 11]
    assert layout.keys.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 8, 9, 10, 0, 1, 2, 3, 6, 7, 0, 1, 2, 3, 4, 5, 11]
    # padded outputs: a in rows 0-5, b in 6-8, c in 9-10 and its padding in 11, d in 12
    assert layout.take.tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 6, 7, 8, 12]
    assert _batches(layout.segments)[1].tolist() == [0, 1, 2, 3, 4, 5, 9, 10, 6, 7, 8, 11]   # real outputs only


def test_the_path_attention_gathers_once_a_layer_however_many_batches(monkeypatch):
    """Each gather's backward scatters into a zeroed tensor of the whole row: the path attention makes four a layer
    (queries, keys, values, the outputs' take), not four per batch."""
    from pipeline.model import packing

    monkeypatch.setitem(packing.ATTENTION, "mode", "paths")
    prompts, responses, _ = shared_turns()
    seqs = [p + r for p, r in zip(prompts, responses)]
    assert len(packing._path_layout(pack(seqs)).batches) > 2
    m = tiny_llama(seed=2)
    calls = []
    real = torch.Tensor.__getitem__

    def counting(self, index):
        parts = index if isinstance(index, tuple) else (index,)
        calls.extend(1 for i in parts if isinstance(i, torch.Tensor) and i.dtype == torch.long)
        return real(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", counting)
    with packing.tree_forward(m, pack(seqs), "cpu") as kwargs:
        before = len(calls)
        m(**kwargs)
    assert len(calls) - before == 4 * m.config.num_hidden_layers


def test_the_shared_turns_batch_their_segments(tokenizer):
    """The turns the equivalence tests below run through: some batch holds several segments with a mask, so the
    batched path attention is what they compare."""
    from pipeline.model.packing import _path_layout

    prompts, responses, _ = shared_turns()
    layout = _path_layout(pack([p + r for p, r in zip(prompts, responses)]))
    assert len(layout.batches) < len(layout.segments)
    assert any(len(b.queries) > 1 and b.mask is not None for b in layout.batches)


def test_micro_batches_hold_at_most_the_token_budget_and_put_shared_prefixes_together():
    seqs = [[1, 2, 3], [9, 8], [1, 2, 4], [9, 7], [5, 5, 5, 5, 5]]
    # sorted: [1 2 3], [1 2 4], [5 5 5 5 5], [9 7], [9 8]; trees of at most 4 tokens; the 5-token turn goes alone
    assert micro_batches(seqs, [0, 1, 2, 3, 4], 4) == [[0, 2], [4], [3, 1]]
    assert micro_batches(seqs, [1, 3], 2) == [[3], [1]]          # 9 7 and 9 8 share only the 9: 3 tokens
    assert micro_batches(seqs, [1, 3], 3) == [[3, 1]]


def test_pairs_go_into_micro_batches_whole_and_their_shared_prompt_counts_once():
    from pipeline.model.packing import grouped_micro_batches

    pairs = [([1, 2, 3, 4], [1, 2, 3, 5, 6]),      # 6 tokens as a tree: 1 2 3 {4, 5 6}
             ([7, 8, 9], [7, 8, 1]),               # 4: 7 8 {9, 1}
             ([1, 2, 3, 7], [1, 2, 9])]            # 5 alone; sorted after the first, beside it 2 new: 7 and 9
    assert grouped_micro_batches(pairs, [0, 1, 2], 8) == [[0, 2], [1]]
    assert grouped_micro_batches(pairs, [0, 1, 2], 7) == [[0], [2], [1]]
    assert grouped_micro_batches(pairs, [2, 1], 9) == [[2, 1]]       # 5 + 4: 7 8 counted once for both turns
    assert grouped_micro_batches(pairs, [2, 1], 8) == [[2], [1]]
    assert grouped_micro_batches(pairs, [0, 1, 2], 100) == [[0, 2, 1]]


def shared_turns(n=12, seed=1):
    """Turns as an iteration has them: one system prefix, task groups that start in the same state, and episodes of
    a group that repeat each other's turns."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(1, 40, (6,), generator=g).tolist()
    states = [torch.randint(1, 40, (3 + k,), generator=g).tolist() for k in range(3)]
    prompts, responses = [], []
    for k in range(n):
        prompts.append(system + states[k % 3] + ([] if k < 6 else torch.randint(1, 40, (2,), generator=g).tolist()))
        responses.append(torch.randint(1, 40, (1 + k % 3,), generator=g).tolist() if k % 4 else [7, 7])
    return prompts, responses, [1.5, -1.0, 0.5, -2.0, 1.0, 0.25] * (n // 6)


@pytest.mark.parametrize("attention", ["paths", "segments", "mask"])
@pytest.mark.parametrize("model", ["tiny llama", "tiny llama + lora", "project's tiny model", "eager attention",
                                   "grouped queries"])
def test_packed_log_probs_and_entropies_equal_the_padded_batchs(model, attention, tokenizer, monkeypatch):
    import pipeline.model.packing as packing

    monkeypatch.setitem(packing.ATTENTION, "mode", attention)
    if attention != "mask":             # the path attention builds no T x T mask: prove it is the one that ran
        monkeypatch.setattr(packing, "attention_mask", lambda *a: pytest.fail("the mask was built"))
    if model == "project's tiny model":
        m = build_tiny_model(tokenizer, TinyModelConfig(), seed=0)
    elif model == "grouped queries":    # 4 query heads share 2 key/value heads, as SmolLM2's 9 share 3
        m = tiny_llama(seed=2, heads=4, kv_heads=2)
    else:
        m = tiny_llama(seed=2)
        if model == "eager attention":     # adds its mask to the scores: it needs 0 / -inf, not booleans
            m.set_attn_implementation("eager")
            assert m.config._attn_implementation == "eager"
        if "lora" in model:
            m = with_lora(m, LoraSettings(r=4, alpha=8), seed=0)
            for name, w in m.named_parameters():     # B = 0 would hide the adapter: give it weights
                if "lora_B" in name:
                    torch.nn.init.normal_(w, std=0.5)
    prompts, responses, _ = shared_turns()
    seqs = [p + r for p, r in zip(prompts, responses)]
    assert packed_tokens(seqs) < 0.6 * sum(map(len, seqs))
    for temperature in (1.0, 0.7):
        plain, plain_h, mask = response_logprobs(m, prompts, responses, PAD, "none", True, temperature)
        tree, tree_h, tree_mask = response_logprobs(m, prompts, responses, PAD, "tree", True, temperature)
        assert torch.equal(mask, tree_mask) and int(mask.sum()) == sum(map(len, responses))
        assert (plain[mask] - tree[mask]).abs().max() < 1e-5
        assert (plain_h[mask] - tree_h[mask]).abs().max() < 1e-5
        assert plain[mask].abs().min() > 0.1           # real log-probs were compared, not zeros
    assert m.config._attn_implementation in ("sdpa", "eager")      # the model's own attention is back


def train(model, **update):
    # one SGD step (12 turns, one minibatch) large enough that the change stands far above fp32's rounding of the
    # weights
    return sgd_update(model, *shared_turns(), lr=50.0, epochs=1, minibatch_size=12, **update)


@pytest.mark.parametrize("attention", ["paths", "segments", "mask"])
@pytest.mark.parametrize("lora", [False, True])
def test_one_update_step_changes_the_weights_alike_packed_or_not(lora, attention, monkeypatch):
    import pipeline.model.packing as packing

    monkeypatch.setitem(packing.ATTENTION, "mode", attention)
    def fresh():
        m = tiny_llama(seed=3)
        return with_lora(m, LoraSettings(r=4, alpha=8), seed=0) if lora else m

    init = dict(fresh().named_parameters())
    ref, ref_stats = train(fresh(), micro_batch_size=4)
    # regrouped: prefix trees of at most 40 tokens, so the 12 turns fall into other micro-batches than 4 at a time
    packed, stats = train(fresh(), packing="tree", micro_batch_tokens=40)
    moved = 0
    for name, w in ref.items():
        change, packed_change = w - init[name], packed[name] - init[name]
        scale = float(change.abs().max().detach())
        if scale > 0:
            moved += 1
            assert float((packed_change - change).abs().max().detach()) <= 1e-5 * scale, name
        else:
            assert float(packed_change.abs().max().detach()) == 0.0, name
    assert moved > (2 if lora else 5)
    for k in ("loss", "pg_loss", "clipfrac", "approx_kl"):
        assert stats[k] == pytest.approx(ref_stats[k], abs=1e-6), k


def test_with_gradient_checkpointing_the_trees_take_the_mask_and_train_alike(monkeypatch):
    """Checkpointing recomputes each layer in the backward pass, after the packed forward has returned: the path
    attention would not be there to recompute it, so such a model takes the mask, and the step is still the padded
    one's."""
    import pipeline.model.packing as packing

    masks = []
    real = packing.attention_mask
    monkeypatch.setattr(packing, "attention_mask", lambda *a: masks.append(1) or real(*a))

    def fresh():
        m = tiny_llama(seed=3)
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return m.train()

    init = dict(fresh().named_parameters())
    ref, _ = train(fresh(), micro_batch_size=4)
    packed, _ = train(fresh(), packing="tree", micro_batch_tokens=40)
    assert masks, "a checkpointed model must take the mask"
    for name, w in ref.items():
        change, packed_change = w - init[name], packed[name] - init[name]
        assert float((packed_change - change).abs().max().detach()) <= 1e-5 * float(change.abs().max().detach()), name


def test_the_tree_micro_batches_of_the_update_regroup_turns():
    from pipeline.model.ppo import Turns, _micro

    prompts, responses, adv = shared_turns()
    turns = Turns(prompts, responses, adv, [])
    cfg = UpdateConfig(minibatch_size=12, packing="tree", micro_batch_tokens=40)
    parts = _micro(turns, list(range(12)), cfg)
    assert sorted(i for p in parts for i in p) == list(range(12)) and len(parts) > 1
    assert all(packed_tokens([prompts[i] + responses[i] for i in p]) <= 40 for p in parts)
    assert parts != [list(range(k, min(k + len(parts[0]), 12))) for k in range(0, 12, len(parts[0]))]


def test_the_warm_start_trains_alike_packed_or_not(tokenizer, monkeypatch):
    import copy

    from pipeline.config.params import Params
    from pipeline.rollout.warmstart import demonstrations, supervised_warmstart
    from tests.conftest import CHAT

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT                  # every prompt starts with the same template and rules: shared prefixes
    model = build_tiny_model(tok, TinyModelConfig(), seed=3)
    demos = demonstrations(Params(prompt={"history_turns": 0}), 4, 0.0, seed=1)
    # the losses of 4 steps: the first on the same weights, the next three after AdamW steps taken on the packed or
    # padded gradients (AdamW turns float noise in near-zero gradient entries into full steps, so the weights are
    # compared through what they compute)
    packs = counting_packs(monkeypatch)
    plain = supervised_warmstart(copy.deepcopy(model), tok, demos, steps=4, batch_size=8, lr=1e-2, seed=0)
    assert packs == []
    tree = supervised_warmstart(copy.deepcopy(model), tok, demos, steps=4, batch_size=8, lr=1e-2, seed=0,
                                packing="tree")
    assert packs == [8] * 4                                        # each step's batch, one tree
    assert tree == pytest.approx(plain, rel=1e-5)
    assert plain[0] > 1.0 and plain[-1] < 0.9 * plain[0]           # the steps moved the loss
    # micro-batches with accumulated gradients: the same steps, in 3 passes of at most 3 turns (padded) or in
    # prefix trees of at most 150 tokens
    packs.clear()
    small = supervised_warmstart(copy.deepcopy(model), tok, demos, steps=4, batch_size=8, lr=1e-2, seed=0,
                                 micro_batch_size=3)
    assert packs == [] and small == pytest.approx(plain, rel=1e-5)
    trees = supervised_warmstart(copy.deepcopy(model), tok, demos, steps=4, batch_size=8, lr=1e-2, seed=0,
                                 packing="tree", micro_batch_tokens=150)
    assert sum(packs) == 32 and len(packs) > 4 and trees == pytest.approx(plain, rel=1e-5)


class _Chars:
    """A tokenizer of one id per character, without a chat template; EOS is 0."""
    chat_template, eos_token_id = None, 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_the_warm_starts_tokens_a_step_are_the_trees_nodes_or_the_padded_rows():
    from types import SimpleNamespace

    from bench.warmstart import step_tokens

    def w(**kw):
        return SimpleNamespace(**{"batch_size": 3, "clean_steps": 2, "micro_batch_size": None, "packing": "none",
                                  "micro_batch_tokens": None, **kw})

    one = [("abcd", "x", "x")]             # 3 copies of one turn a step: prompt 4 + response 1 + EOS = 6 tokens
    assert step_tokens(_Chars(), one, w(), 0, 2) == (18, 18)                        # one padded pass of 3 rows
    assert step_tokens(_Chars(), one, w(packing="tree", micro_batch_tokens=100), 0, 2) == (6, 18)   # one tree
    assert step_tokens(_Chars(), one, w(packing="tree", micro_batch_tokens=5), 0, 2) == (18, 18)    # a turn a tree
    assert step_tokens(_Chars(), one, w(micro_batch_size=2), 0, 2) == (18, 18)      # passes of 2 and 1 rows
    # two turns sharing "abc", both among 8 drawn: the tree holds abc, then d x EOS and e y EOS
    two = [("abcd", "x", "x"), ("abce", "y", "y")]
    assert step_tokens(_Chars(), two, w(batch_size=8, packing="tree", micro_batch_tokens=100), 0, 1) == (9, 48)
    # the unlabelled turn is drawn only after the clean steps; the executed response is trained then
    mixed = [("ab", "x", None), ("ab", "x", "x")]
    assert step_tokens(_Chars(), mixed, w(batch_size=2, clean_steps=0, packing="tree", micro_batch_tokens=100),
                       0, 1) == (4, 8)


def test_a_sliding_window_shorter_than_a_sequence_is_refused():
    m = tiny_llama()
    m.config.sliding_window = 4            # as Gemma 3's and Mistral's configs state theirs
    with pytest.raises(ValueError, match=r"a sequence of 7 tokens is longer than the model's sliding attention "
                                         r"window \(4\)"):
        response_logprobs(m, [[1, 2, 3, 4, 5]], [[6, 7]], PAD, "tree")
    m.config.sliding_window = 8
    assert response_logprobs(m, [[1, 2, 3, 4, 5]], [[6, 7]], PAD, "tree")[0].shape == (1, 6)


def test_the_update_stage_recomputes_log_pi_old_as_prefix_trees(monkeypatch):
    """`update.packing: tree` reaches the update stage's own passes (log pi_old here; the KL reference's goes the
    same way), not only the loss: the same log-probs, in trees of at most `micro_batch_tokens`."""
    import stages.update as update
    from pipeline.config.params import Params
    from pipeline.model.distributed import Processes
    from pipeline.workflow.cli import StageContext

    prompts, responses, adv = shared_turns()
    turns = update.Turns(prompts, responses, adv, [[0.0] * len(r) for r in responses])
    model = tiny_llama(seed=4)
    procs = Processes(0, 1, "cpu")
    plain = update.old_logprobs(StageContext(Params(), "p.yaml", 1, "update", 0.0), model, PAD, turns, procs)
    packs = counting_packs(monkeypatch)
    p = Params.model_validate({"update": {"packing": "tree", "micro_batch_tokens": 40}})
    tree = update.old_logprobs(StageContext(p, "p.yaml", 1, "update", 0.0), model, PAD, turns, procs)
    assert len(packs) > 1 and sum(packs) == len(prompts)
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(plain, tree, strict=True))

"""Task seeds of training, warm-start, tokenizer and held-out tasks never meet (pipeline.data.seeds)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config.params import Params
from pipeline.data.seeds import MAX_INDEX, STREAMS, fields, task_seed
from pipeline.rollout.warmstart import demonstration_tasks
from stages.evaluate import eval_specs
from stages.rollout import training_specs

seeds = st.integers(0, 2**31 - 1)
iterations = st.integers(0, 1000)
indices = st.integers(0, MAX_INDEX)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(STREAMS)), seeds, iterations, indices)
def test_a_task_seed_names_its_stream_run_iteration_and_index(stream, seed, it, index):
    """`fields` inverts `task_seed`: two different (stream, seed, iteration, index) never share a task seed."""
    t = task_seed(stream, seed, it, index)
    assert fields(t) == (stream, seed, it, index) and 0 <= t < 2**63


@settings(max_examples=200, deadline=None)
@given(st.tuples(st.sampled_from(list(STREAMS)), seeds, iterations, indices),
       st.tuples(st.sampled_from(list(STREAMS)), seeds, iterations, indices))
def test_different_tasks_have_different_seeds(a, b):
    assert (task_seed(*a) == task_seed(*b)) is (a == b)


@settings(max_examples=40, deadline=None)
@given(seeds, st.integers(1, 30), st.integers(1, 64), st.integers(1, 300))
def test_the_stages_never_play_a_held_out_room(seed, n_iterations, tasks, eval_tasks):
    p = Params.model_validate({"seed": seed, "loop": {"iterations": n_iterations},
                               "rollout": {"tasks_per_iteration": tasks}, "evaluate": {"tasks": eval_tasks}})
    train = {s.task_id for it in range(1, n_iterations + 1) for s in training_specs(p, it)}
    held_out = {s.task_id for s in eval_specs(p)}
    warm = set(demonstration_tasks(seed, p.warmstart.episodes))
    corpus = set(demonstration_tasks(seed, p.policy.tiny.tokenizer_corpus_episodes, "tokenizer"))
    assert len(train) == n_iterations * tasks and len(held_out) == eval_tasks
    assert not (train & held_out) and not (warm & held_out) and not (corpus & held_out)
    assert not (train & warm) and not (train & corpus) and not (warm & corpus)


@pytest.mark.parametrize("seed, n_iterations", [(1000, 6), (89, 10), (2**31 - 1, 1000)])
def test_the_seeds_that_used_to_collide(seed, n_iterations):
    """With the old fixed offsets, seed 1000 played its warm start on the held-out rooms and seed 89 trained on
    them at iteration 10."""
    p = Params.model_validate({"seed": seed, "loop": {"iterations": n_iterations}})
    held_out = {s.task_id for s in eval_specs(p)}
    assert not {s.task_id for s in training_specs(p, n_iterations)} & held_out
    assert not set(demonstration_tasks(seed, p.warmstart.episodes)) & held_out


def test_held_out_rooms_are_the_same_for_every_run_seed():
    a, b = (eval_specs(Params.model_validate({"seed": s})) for s in (0, 7))
    assert [s.task_id for s in a] == [s.task_id for s in b]


def test_out_of_range_fields_are_refused():
    with pytest.raises(ValueError, match="task index 1048576 is outside 0..1048575"):
        task_seed("train", 0, 1, MAX_INDEX + 1)
    with pytest.raises(ValueError, match="unknown task stream 'test'"):
        task_seed("test", 0, 0, 0)

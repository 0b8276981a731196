"""Held-out success by solution length (the report's and bench.compare's): hand-counted tables."""

import polars as pl

from pipeline.data.difficulty import difficulty_buckets, plot_difficulty, success_by_difficulty


def _episodes(rows):
    return pl.DataFrame(rows, schema=["iteration", "task_id", "optimal_moves", "success"], orient="row")


def test_success_by_difficulty_counts_tasks_gained_and_lost_against_the_first_iteration():
    # tasks 1, 2 take 2 moves, task 3 takes 3; two episodes a task
    eps = _episodes([
        (0, 1, 2, True), (0, 1, 2, True), (0, 2, 2, True), (0, 2, 2, False), (0, 3, 3, False), (0, 3, 3, False),
        (1, 1, 2, True), (1, 1, 2, False), (1, 2, 2, True), (1, 2, 2, False), (1, 3, 3, True), (1, 3, 3, True),
    ])
    t = success_by_difficulty(eps)
    assert t.columns == ["iteration", "difficulty", "tasks", "episodes", "successes", "success_rate", "tasks_up",
                         "tasks_down"]
    assert t.rows() == [
        (0, "2", 2, 4, 3, 0.75, 0, 0),
        (0, "3", 1, 2, 0, 0.0, 0, 0),
        (1, "2", 2, 4, 2, 0.5, 0, 1),     # task 1 fell from 2/2 to 1/2, task 2 held 1/2
        (1, "3", 1, 2, 2, 1.0, 1, 0),     # task 3 rose from 0/2 to 2/2
    ]


def test_without_an_oracle_every_task_is_one_bucket():
    eps = _episodes([(0, 1, None, False), (0, 2, None, True), (2, 1, None, True), (2, 2, None, True)])
    assert success_by_difficulty(eps).rows() == [(0, "all", 2, 2, 1, 0.5, 0, 0), (2, "all", 2, 2, 2, 1.0, 1, 0)]


def test_many_solution_lengths_are_binned_into_ranges():
    labels = difficulty_buckets([None, *range(1, 25)])
    assert labels[None] == "all"
    assert (labels[1], labels[3], labels[4], labels[22], labels[24]) == ("1-3", "1-3", "4-6", "22-24", "22-24")
    assert len(set(labels.values()) - {"all"}) == 8
    assert difficulty_buckets([5, 2, 2, 9]) == {None: "all", 2: "2", 5: "5", 9: "9"}


def test_the_picture_is_written(tmp_path):
    eps = _episodes([(0, 1, 2, True), (0, 2, 4, False), (1, 1, 2, False), (1, 2, 4, True)])
    plot_difficulty(success_by_difficulty(eps), tmp_path / "d.png", "t")
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"

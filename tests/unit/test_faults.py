"""Faults and bad input: a misbehaving model, a misbehaving environment, non-finite numbers.

The model is scripted (`generate` replaced) so that every case is exact; the environment is real Sokoban,
wrapped so that a test can make one episode's step raise.
"""

import re

import polars as pl
import pytest

import pipeline.model.engines as engines
import pipeline.rollout.episodes as rollout
from pipeline.config.params import CreditConfig
from pipeline.envs.sokoban import SokobanEnv
from pipeline.model.policy import Generation
from pipeline.rollout.episodes import EnvFailureError, EpisodeSpec, check_env_errors, episode_summary, play_episodes

CAP = 48  # max_new_tokens: a scripted response is one "token" a character, cut at the cap


class Wrapped:
    """Sokoban whose task line names the episode and turn (so the scripted policy knows what to answer), and
    whose step raises at the turns in `raise_at`."""

    def __init__(self, k: int, raise_at: set[tuple[int, int]], max_turns: int):
        self.inner = SokobanEnv(max_turns=max_turns)
        self.name, self.actions = self.inner.name, self.inner.actions
        self.k, self.turn, self.raise_at = k, 0, raise_at

    def task_description(self) -> str:
        return f"episode={self.k} turn={self.turn}"

    def reset(self, seed):
        return self.inner.reset(seed)

    def step(self, text):
        if (self.k, self.turn) in self.raise_at:
            raise RuntimeError(f"simulator crashed in episode {self.k}")
        self.turn += 1
        return self.inner.step(text)


def play(monkeypatch, script: list[list[str | bytes]], raise_at=(), max_turns: int = 4) -> pl.DataFrame:
    """Episode k answers script[k][t] at turn t (the last entry repeats); raw bytes are decoded as a byte-level
    tokenizer decodes an invalid sequence (U+FFFD for each bad byte)."""

    def encode(tokenizer, prompt):
        m = re.search(r"episode=(\d+) turn=(\d+)", prompt)
        return [int(m[1]), int(m[2])]

    def generate(model, tokenizer, prompt_ids, max_new_tokens, temperature, seed, entropy=None):
        out = []
        for k, t in prompt_ids:
            text = script[k][min(t, len(script[k]) - 1)]
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            text = text[:max_new_tokens]
            n = max(len(text), 1)
            out.append(Generation(list(range(n)), [-0.5] * n, text))
        return out

    monkeypatch.setattr(rollout, "encode_prompt", encode)
    monkeypatch.setattr(engines, "generate", generate)
    made = iter(range(len(script)))
    specs = [EpisodeSpec(task_id=100 + k, task_group=0, episode_id=k) for k in range(len(script))]
    class NoModel:
        def eval(self):
            return self

    return play_episodes(NoModel(), None, lambda: Wrapped(next(made), set(raise_at), max_turns), specs, history_turns=0,
                         max_new_tokens=CAP, temperature=1.0, batch_size=64, seed=0)


def test_a_misbehaving_model_gives_invalid_turns_and_the_episode_goes_on(monkeypatch):
    bad = ["",                                        # empty response
           "<action>" + " " * 40 + "up</action>",    # runs past the length cap: cut before the closing tag
           "I think so",                              # no action tag
           b"\xff\xfe<action>",                       # invalid UTF-8, then an unclosed tag
           "<action>jump</action>"]                   # not an admissible action
    steps = play(monkeypatch, [bad, ["<action>up</action><action>down</action>"]], max_turns=5)
    ep0 = steps.filter(pl.col("episode_id") == 0).sort("step")
    assert ep0.height == 5 and ep0["step"].to_list() == [0, 1, 2, 3, 4]
    assert ep0["action_valid"].to_list() == [False] * 5 and ep0["action"].to_list() == [None] * 5
    assert ep0["reward"].to_list() == [-0.1] * 5                 # each a no-op move: the step penalty only
    assert ep0["truncated"].to_list() == [False] * 4 + [True]    # the episode went on to its turn limit
    assert ep0["response"][3].startswith("\ufffd\ufffd")
    assert ep0["anchor"].n_unique() == 1                         # nothing moved
    ep1 = steps.filter(pl.col("episode_id") == 1)
    assert ep1["action_valid"].all() and ep1["action"][0] == "up"   # several tags: the first counts
    summary = episode_summary(steps)
    assert summary["invalid_action_rate"] == pytest.approx(5 / (5 + ep1.height))


def test_an_environment_exception_truncates_only_that_episode(monkeypatch):
    script = [["<action>left</action>"]] * 4
    steps = play(monkeypatch, script, raise_at={(1, 1)}, max_turns=3)
    ep1 = steps.filter(pl.col("episode_id") == 1).sort("step")
    assert ep1.height == 2                                       # turn 0 played, turn 1 raised: the episode ends
    last = ep1.row(1, named=True)
    assert last["truncated"] and not last["terminated"] and not last["action_valid"] and last["reward"] == 0.0
    assert last["env_error"] == "RuntimeError: simulator crashed in episode 1"
    assert ep1["env_error"][0] is None and not ep1["success"].any()
    for k in (0, 2, 3):                                          # the others play on to their limit (or solve)
        ep = steps.filter(pl.col("episode_id") == k)
        assert ep["env_error"].is_null().all() and (ep.height == 3 or ep["success"].any())
    assert check_env_errors(steps, 0.25, "rollout") == {"env_error_episodes": 1.0, "env_error_share": 0.25}
    with pytest.raises(EnvFailureError, match=r"rollout: the environment raised in 1 of 4 episodes \(25.0%\), "
                                              r"above faults.max_env_error_share = 0.2; first in episode 1 "
                                              r"\(task 101, turn 1\): RuntimeError: simulator crashed"):
        check_env_errors(steps, 0.2, "rollout")


def test_crashed_episodes_neither_train_nor_move_the_baseline():
    from stages.advantages import advantages_excluding_env_errors

    # task group 0: returns 1, 0 and a crashed episode whose 5.0 would otherwise shift the baseline
    df = pl.DataFrame({
        "episode_id": [0, 1, 2], "step": [0, 0, 0], "task_group": [0, 0, 0], "reward": [1.0, 0.0, 5.0],
        "action_valid": [True, True, False], "env_error": [None, None, "RuntimeError: boom"],
    }, schema_overrides={"env_error": pl.String, "step": pl.Int32})
    adv = advantages_excluding_env_errors(df, CreditConfig(method="grpo", episode={"mode": "mean_norm"}))
    assert adv["advantage"].to_list() == [0.5, -0.5, 0.0]      # mean of {1, 0} only
    assert adv["step_score"].is_null().all()

"""ALFWorld households on ALFWorld's real engine (`env.name: alfworld`).

Games are read the way ALFWorld's own `AlfredTWEnv` reads them: every folder under `<data_path>/<split>` with a
`traj_data.json` and a `game.tw-pddl`, skipping movable-receptacle and sliced tasks, task types outside
`task_types` and games not marked solvable. A game is played on TextWorld's PDDL backend with ALFWorld's
`AlfredDemangler` and `AlfredInfos` wrappers, so objects read "apple 1" and commands are ALFWorld's ("go to
countertop 1", "take apple 1 from countertop 1", "heat apple 1 with microwave 1").

`data_path` is a user's copy of the official release (its `json_2.1.1` folder); left empty, it is the small set of
games the project ships (`data/alfworld/json_2.1.1`, written by `pipeline.envs.alfworld.games` in the same format).
Training, warm-start and tokenizer tasks draw games from `split` by a hash of the task seed; held-out tasks
(`pipeline.data.seeds`, stream "eval") take the games of `eval_split` in order.

The policy sees the message its last command produced (at the start: the room); the anchor is that text, without
history, as in verl-agent's ALFWorld. The task text is ALFWorld's "Your task is to: ...". Reward 1 when the goal
holds.

Capabilities (from Fast Downward, the planner TextWorld's PDDL backend embeds):
- `oracle_distance`: the length of the planner's plan from the current state (minimising ALFRED's action costs:
  1 per step, 5 for clean, heat and cool, which every plan of a task needs equally often); inf when it finds none.
- `expert_actions`: the first command of that plan.
"""

from __future__ import annotations

import json
import math
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.data.section import EnvSection
from pipeline.data.seeds import fields, task_hash
from pipeline.envs.actions import parse_action
from pipeline.envs.base import EnvSpec, Observation, StepResult, data_root, register

SHIPPED = Path(__file__).resolve().parents[3] / "data" / "alfworld" / "json_2.1.1"
TASK_TYPES = {1: "pick_and_place_simple", 2: "look_at_obj_in_light", 3: "pick_clean_then_place_in_recep",
              4: "pick_heat_then_place_in_recep", 5: "pick_cool_then_place_in_recep", 6: "pick_two_obj_and_place"}


class AlfWorldConfig(EnvSection):
    """ALFWorld game files (the official release's json/pddl folders, or the project's shipped set)."""
    name: Literal["alfworld"] = "alfworld"
    data_path: str | None = Field(None, description="folder holding the splits (the official release's "
                                  "json_2.1.1); null: the small games the project ships")
    split: str = Field("train", description="split the training tasks are drawn from")
    eval_split: str = Field("valid_seen", description="split of the held-out tasks (valid_seen, valid_unseen)")
    task_types: list[int] = Field(default_factory=lambda: sorted(TASK_TYPES), min_length=1,
                                  description="ALFWorld task types: 1 pick_and_place_simple, 2 look_at_obj_in_light, "
                                  "3 pick_clean_then_place_in_recep, 4 pick_heat_then_place_in_recep, "
                                  "5 pick_cool_then_place_in_recep, 6 pick_two_obj_and_place")
    max_turns: int = Field(30, ge=1, le=500, description="turns before an episode is truncated")

    @model_validator(mode="after")
    def _splits_exist(self):
        """A missing data_path or split folder is refused when the params load, not in the first stage."""
        for split in dict.fromkeys((self.split, self.eval_split)):
            folder = _root(self) / split
            if not folder.is_dir():
                raise ValueError(f"data_path: {folder} is not a folder; expected ALFWorld's split folders "
                                 f"(train, valid_seen, valid_unseen) under {_root(self)}")
        return self


def _root(cfg: AlfWorldConfig) -> Path:
    return data_root(cfg.data_path, SHIPPED)


@lru_cache(maxsize=16)
def game_files(root: str, split: str, task_types: tuple[int, ...]) -> tuple[str, ...]:
    """The playable games of a split, sorted, selected as ALFWorld's `AlfredTWEnv.collect_game_files` does."""
    folder = Path(root) / split
    if not folder.is_dir():
        raise ValueError(f"env.data_path: {folder} is not a folder; expected ALFWorld's split folders "
                         f"(train, valid_seen, valid_unseen) under {root}")
    bad = [t for t in task_types if t not in TASK_TYPES]
    if bad:
        raise ValueError(f"env.task_types: unknown task types {bad}; expected numbers from {sorted(TASK_TYPES)}")
    wanted = {TASK_TYPES[t] for t in task_types}
    games = []
    for traj in sorted(folder.rglob("traj_data.json")):
        d = traj.parent
        game = d / "game.tw-pddl"
        if "movable" in str(d) or "Sliced" in str(d) or not game.is_file():
            continue
        try:
            if json.loads(traj.read_text())["task_type"] not in wanted:
                continue
            if not json.loads(game.read_text()).get("solvable", False):
                continue
        except (ValueError, KeyError) as e:
            raise ValueError(f"{traj.parent}: not an ALFWorld game folder ({type(e).__name__}: {e})") from None
        games.append(str(game))
    if not games:
        raise ValueError(f"env.data_path: no solvable games of task types {sorted(task_types)} under {folder}")
    return tuple(games)


def game_of(cfg: AlfWorldConfig, task: int) -> str:
    """The game file a task seed plays: held-out tasks in order through `eval_split`, the others by hash."""
    stream, _, _, index = fields(task)
    types = tuple(sorted(set(cfg.task_types)))
    if stream == "eval":
        games = game_files(str(_root(cfg)), cfg.eval_split, types)
        return games[index % len(games)]
    games = game_files(str(_root(cfg)), cfg.split, types)
    return games[task_hash(task) % len(games)]


class AlfWorldEnv:
    name = "alfworld"

    def __init__(self, cfg: AlfWorldConfig, cache_dir: Path):
        self.cfg = cfg
        self.env = None
        self.path: str | None = None
        self.state = None
        self.turn = 0
        self.objective = ""

    def _start(self, path: str):
        import textworld  # optional: textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos  # optional: alfworld

        if self.env is not None:
            self.env.close()
        infos = textworld.EnvInfos(admissible_commands=True, won=True, extras=["gamefile"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.env = textworld.start(path, request_infos=infos, wrappers=[AlfredDemangler(), AlfredInfos])
        self.path = path

    def _pddl(self):
        env = self.env
        while hasattr(env, "_wrapped_env"):
            env = env._wrapped_env
        return env

    @staticmethod
    def _commands(state) -> tuple[str, ...]:
        return tuple(c for c in state.admissible_commands if c != "help")

    def task_description(self) -> str:
        return f"ALFWorld. {self.objective}"

    def reset(self, task: int) -> Observation:
        path = game_of(self.cfg, task)
        if self.env is None or self.path != path:
            self._start(path)
        self.state = self.env.reset()
        self.turn = 0
        intro = self.state.feedback
        room, _, goal = intro.partition("Your task is to:")
        self.objective = f"Your task is to: {goal.strip()}"
        text = room.replace("-= Welcome to TextWorld, ALFRED! =-", "").strip()
        return Observation(text, text, self._commands(self.state))

    def step(self, response_text: str) -> StepResult:
        if self.state is None:
            raise RuntimeError("AlfWorldEnv.step called before reset")
        self.turn += 1
        admissible = self._commands(self.state)
        action = parse_action(response_text, admissible)
        if action is not None:
            self.state, _, _ = self.env.step(action)
            text = self.state.feedback.strip()
        else:
            text = "Nothing happens."
        won = bool(self.state.won)
        return StepResult(observation=text, anchor=text, reward=1.0 if won and action is not None else 0.0,
                          terminated=won, truncated=not won and self.turn >= self.cfg.max_turns,
                          action_valid=action is not None, success=won, action=action,
                          admissible=self._commands(self.state))

    # -- capabilities -----------------------------------------------------------------------------------------

    def _plan(self) -> list[str]:
        pddl = self._pddl()
        return pddl._pddl_state.replan(pddl._entity_infos)

    def oracle_distance(self) -> float:
        if self.state.won:
            return 0.0
        plan = self._plan()
        return float(len(plan)) if plan else math.inf

    def expert_actions(self) -> list[str]:
        if self.state.won:
            return []
        plan = self._plan()
        return [plan[0]] if plan and plan[0] in self._commands(self.state) else []


SPEC = register(EnvSpec("alfworld", AlfWorldConfig, AlfWorldEnv, requires=("alfworld", "fast_downward"),
                        packages="the alfworld and textworld[pddl] packages"))

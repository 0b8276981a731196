"""Sokoban as a text environment, with an exact breadth-first solver.

Rooms follow gym-sokoban's conventions (a `dim_room` square including its outer wall, rewards -0.1 a move,
+1 for a box pushed onto a target, -1 for one pushed off, +10 when every box is on a target) but are generated
here, identically for the same seed, and are always solvable: the generator keeps a room only when the solver
finds a solution of at least `min_solution_moves` moves.

The solver gives `d(s)`, the optimal number of moves to solve from any state (infinite for a dead state). It makes
the warm-start demonstrations and the oracle of docs/credit-assignment.md ("Oracle credit (Sokoban)").

Text rendering (XSB symbols, with `_` for floor so that rows keep their width in any font; the outer wall ring,
the same in every room, is left out of observations):
`#` wall, `_` floor, `.` target, `$` box, `*` box on target, `@` player, `+` player on target.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from pipeline.data.section import EnvSection
from pipeline.envs.actions import parse_action
from pipeline.envs.base import EnvSpec, Observation, StepResult, register

ACTIONS: tuple[str, ...] = ("up", "down", "left", "right")
MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}

REWARD_STEP = -0.1
REWARD_BOX_ON = 1.0
REWARD_BOX_OFF = -1.0
REWARD_SOLVED = 10.0

Pos = tuple[int, int]
State = tuple[Pos, tuple[Pos, ...]]  # (player, sorted boxes)


@dataclass(frozen=True)
class Room:
    """The fixed part of a level: walls and targets. The moving part is a `State`."""

    walls: frozenset[Pos]
    targets: frozenset[Pos]
    dim: int

    def render(self, state: State, border: bool = False) -> str:
        """The grid as text; without `border` the outer wall ring (the same in every room) is left out."""
        player, boxes = state
        box_set = set(boxes)
        rows = []
        span = range(self.dim) if border else range(1, self.dim - 1)
        for r in span:
            row = []
            for c in span:
                p = (r, c)
                if p in self.walls:
                    ch = "#"
                elif p in box_set:
                    ch = "*" if p in self.targets else "$"
                elif p == player:
                    ch = "+" if p in self.targets else "@"
                else:
                    ch = "." if p in self.targets else "_"
                row.append(ch)
            rows.append("".join(row))
        return "\n".join(rows)

    def describe(self, state: State) -> str:
        """One line locating each box from the player and its nearest target from the box, as a text game would
        ("box: up 1, left 2. target: down 1.")."""
        (pr, pc), boxes = state
        parts = []
        for br, bc in boxes:
            tr, tc = min(self.targets, key=lambda t: abs(t[0] - br) + abs(t[1] - bc))
            parts.append(f"box: {_offset(br - pr, bc - pc)}. target: {_offset(tr - br, tc - bc)}.")
        return " ".join(parts)

    def solved(self, state: State) -> bool:
        return all(b in self.targets for b in state[1])

    def move(self, state: State, action: str) -> tuple[State, float]:
        """Apply one move; returns the next state and the box-on/off part of the reward (no step penalty)."""
        (pr, pc), boxes = state
        dr, dc = MOVES[action]
        nxt = (pr + dr, pc + dc)
        if nxt in self.walls:
            return state, 0.0
        if nxt in boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond in self.walls or beyond in boxes:
                return state, 0.0
            new_boxes = tuple(sorted(beyond if b == nxt else b for b in boxes))
            shaped = 0.0
            if nxt in self.targets and beyond not in self.targets:
                shaped = REWARD_BOX_OFF
            elif beyond in self.targets and nxt not in self.targets:
                shaped = REWARD_BOX_ON
            return (nxt, new_boxes), shaped
        return (nxt, boxes), 0.0

    def successors(self, state: State):
        for a in ACTIONS:
            nxt, _ = self.move(state, a)
            if nxt != state:
                yield a, nxt


def _offset(dr: int, dc: int) -> str:
    words = []
    if dr:
        words.append(f"{'down' if dr > 0 else 'up'} {abs(dr)}")
    if dc:
        words.append(f"{'right' if dc > 0 else 'left'} {abs(dc)}")
    return ", ".join(words) if words else "here"


class Solver:
    """Exact optimal move counts for every state reachable from a start state.

    Forward BFS enumerates the reachable states (at most (floor cells) x C(floor cells, boxes), a few hundred for
    a 6x6 room with one box), then a backward BFS from the solved ones gives d(s). A state from which no solved
    state is reachable is dead: d = inf.
    """

    def __init__(self, room: Room, start: State):
        self.room = room
        self._dist: dict[State, float] = {}
        self._explore(start)

    def _explore(self, start: State) -> None:
        seen = {start}
        order = [start]
        preds: dict[State, list[State]] = {start: []}
        queue = deque([start])
        while queue:
            s = queue.popleft()
            for _, nxt in self.room.successors(s):
                preds.setdefault(nxt, []).append(s)
                if nxt not in seen:
                    seen.add(nxt)
                    order.append(nxt)
                    queue.append(nxt)
        dist = {s: math.inf for s in order}
        queue = deque()
        for s in order:
            if self.room.solved(s):
                dist[s] = 0
                queue.append(s)
        while queue:
            s = queue.popleft()
            for p in preds.get(s, ()):
                if dist[p] == math.inf:
                    dist[p] = dist[s] + 1
                    queue.append(p)
        self._dist.update(dist)

    def distance(self, state: State) -> float:
        if state not in self._dist:
            self._explore(state)
        return self._dist[state]

    def optimal_actions(self, state: State) -> list[str]:
        """Every action that lowers d by one, in `ACTIONS` order; empty for solved or dead states."""
        d = self.distance(state)
        if d == 0 or d == math.inf:
            return []
        return [a for a in ACTIONS if self.distance(self.room.move(state, a)[0]) == d - 1]


def generate_room(seed: int, dim: int = 6, num_boxes: int = 1, min_solution_moves: int = 1,
                  max_solution_moves: int | None = None, max_tries: int = 1000) -> tuple[Room, State]:
    """A solvable room, the same for the same arguments.

    Floor is carved by a random walk over the interior (as gym-sokoban does), then targets, boxes and the player
    are placed on floor cells at random; a placement is kept when no box starts on a target and the optimal
    solution takes at least `min_solution_moves` moves and at most `max_solution_moves` (None: no bound). The
    bounds only skip placements: where the unbounded room of a seed is within them, it is the room they give.
    """
    rng = np.random.default_rng(seed)
    interior = dim - 2
    for _ in range(max_tries):
        floor: set[Pos] = set()
        r, c = int(rng.integers(1, dim - 1)), int(rng.integers(1, dim - 1))
        floor.add((r, c))
        for _ in range(int(1.5 * interior * interior)):
            dr, dc = MOVES[ACTIONS[int(rng.integers(4))]]
            if 1 <= r + dr <= dim - 2 and 1 <= c + dc <= dim - 2:
                r, c = r + dr, c + dc
                floor.add((r, c))
        cells = sorted(floor)
        if len(cells) < 2 * num_boxes + 1:
            continue
        pick = rng.permutation(len(cells))[: 2 * num_boxes + 1]
        targets = frozenset(cells[i] for i in pick[:num_boxes])
        boxes = tuple(sorted(cells[i] for i in pick[num_boxes: 2 * num_boxes]))
        player = cells[pick[-1]]
        if any(b in targets for b in boxes):
            continue
        walls = frozenset((i, j) for i in range(dim) for j in range(dim) if (i, j) not in floor)
        room = Room(walls=walls, targets=targets, dim=dim)
        start: State = (player, boxes)
        d = Solver(room, start).distance(start)
        if d != math.inf and d >= min_solution_moves and (max_solution_moves is None or d <= max_solution_moves):
            return room, start
    bounds = f"{min_solution_moves}-{max_solution_moves if max_solution_moves is not None else 'any'} moves"
    raise RuntimeError(f"no solvable Sokoban room of {bounds} found for seed {seed} after {max_tries} tries")


def parse_grid(text: str, border: bool = False) -> tuple[Room, State]:
    """Inverse of `Room.render`, for hand-written rooms in tests and for the oracle."""
    rows = text.strip("\n").split("\n")
    if not border:
        rows = ["#" * (len(rows) + 2)] + [f"#{row}#" for row in rows] + ["#" * (len(rows) + 2)]
    dim = len(rows)
    walls, targets, boxes = set(), set(), []
    player = None
    for r, row in enumerate(rows):
        if len(row) != dim:
            raise ValueError(f"grid row {r} has {len(row)} cells; expected a {dim}x{dim} square")
        for c, ch in enumerate(row):
            p = (r, c)
            if ch == "#":
                walls.add(p)
            if ch in ".*+":
                targets.add(p)
            if ch in "$*":
                boxes.append(p)
            if ch in "@+":
                player = p
            if ch not in "#_.$*@+":
                raise ValueError(f"grid cell ({r},{c}) is {ch!r}; expected one of #_.$*@+")
    if player is None:
        raise ValueError("grid has no player (@ or +)")
    return Room(frozenset(walls), frozenset(targets), dim), (player, tuple(sorted(boxes)))


class SokobanConfig(EnvSection):
    """Sokoban rooms generated from the task seed (`env.name: sokoban`)."""
    name: Literal["sokoban"] = "sokoban"
    dim_room: int = Field(6, ge=4, le=12, description="room side, outer wall included")
    num_boxes: int = Field(1, ge=1, le=3, description="boxes (and targets) per room")
    max_turns: int = Field(15, ge=1, le=200, description="turns before an episode is truncated")
    min_solution_moves: int = Field(2, ge=1, description="rooms whose optimal solution is shorter are skipped")
    max_solution_moves: int | None = Field(None, ge=1, description="rooms whose optimal solution is longer are "
                                           "skipped (null: no bound); with min_solution_moves, the task mix's "
                                           "difficulty, for training and held-out rooms alike")

    @model_validator(mode="after")
    def _bounds_ordered(self):
        if self.max_solution_moves is not None and self.max_solution_moves < self.min_solution_moves:
            raise ValueError(f"max_solution_moves {self.max_solution_moves} is below min_solution_moves "
                             f"{self.min_solution_moves}; expected max >= min (or null)")
        return self


class SokobanEnv:
    """Capabilities: `oracle_distance` (the exact BFS solver), `expert_actions` (its optimal moves) and
    `snapshot`/`restore`."""
    name = "sokoban"
    actions = ACTIONS

    def __init__(self, dim_room: int = 6, num_boxes: int = 1, max_turns: int = 15, min_solution_moves: int = 1,
                 max_solution_moves: int | None = None):
        self.dim_room = dim_room
        self.num_boxes = num_boxes
        self.max_turns = max_turns
        self.min_solution_moves = min_solution_moves
        self.max_solution_moves = max_solution_moves
        self.room: Room | None = None
        self.state: State | None = None
        self.turn = 0
        self._solver: Solver | None = None

    def task_description(self) -> str:
        return "Sokoban. Push every box $ onto a target . (# wall, _ floor, @ you, * box on target, + you on target)"

    def reset(self, task: int) -> Observation:
        self.room, self.state = generate_room(task, self.dim_room, self.num_boxes, self.min_solution_moves,
                                              self.max_solution_moves)
        self.turn = 0
        self._solver = None
        text, anchor = self._observe()
        return Observation(text, anchor, ACTIONS)

    def _observe(self) -> tuple[str, str]:
        """(observation, anchor): the grid plus a line of coordinates; the anchor is the grid alone."""
        grid = self.room.render(self.state)
        return f"{grid}\n{self.room.describe(self.state)}", grid

    def solver(self) -> Solver:
        assert self.room is not None and self.state is not None, "reset() first"
        if self._solver is None or self._solver.room is not self.room:
            self._solver = Solver(self.room, self.state)
        return self._solver

    def oracle_distance(self) -> float:
        return self.solver().distance(self.state)

    def snapshot(self) -> tuple:
        return self.room, self.state, self.turn     # immutable: the room is frozen, a state is tuples

    def restore(self, snap: tuple) -> None:
        self.room, self.state, self.turn = snap
        self._solver = None

    def expert_actions(self) -> list[str]:
        return self.solver().optimal_actions(self.state)

    def step(self, response_text: str) -> StepResult:
        if self.room is None or self.state is None:
            raise RuntimeError("SokobanEnv.step called before reset")
        self.turn += 1
        action = parse_action(response_text, self.actions)
        reward = REWARD_STEP
        if action is not None:
            self.state, shaped = self.room.move(self.state, action)
            reward += shaped
        success = self.room.solved(self.state)
        if success:
            reward += REWARD_SOLVED
        obs, anchor = self._observe()
        return StepResult(
            observation=obs,
            anchor=anchor,
            reward=reward,
            terminated=success,
            truncated=(not success) and self.turn >= self.max_turns,
            action_valid=action is not None,
            success=success,
            action=action,
            admissible=ACTIONS,
        )


def _make(cfg: SokobanConfig, cache_dir=None) -> SokobanEnv:
    return SokobanEnv(dim_room=cfg.dim_room, num_boxes=cfg.num_boxes, max_turns=cfg.max_turns,
                      min_solution_moves=cfg.min_solution_moves, max_solution_moves=cfg.max_solution_moves)


# Every grid symbol and newline is its own token, so that a state is a sequence of cells the model can read
# (merged rows or whole grids would make every unseen state an unseen token).
SPEC = register(EnvSpec("sokoban", SokobanConfig, _make, isolate=r"[#_.$*@+\n0-9]"))

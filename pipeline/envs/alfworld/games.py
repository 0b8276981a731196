"""Small ALFWorld games in ALFWorld's own file format, written by the project (not a copy of the ALFRED data).

    python -m pipeline.envs.alfworld.games --out data/alfworld/json_2.1.1

Each game is a folder `<split>/<task_type>-<Object>-None-<Receptacle>-<room>/trial_<id>/` holding what ALFWorld's
own loader (`AlfredTWEnv.collect_game_files`) reads: `traj_data.json` (`task_type`, `pddl_params`, the scene) and
`game.tw-pddl` (`pddl_domain` and `grammar` from the alfworld package, the grammar with the task's text added by
ALFWorld's `add_task_to_grammar`, the `pddl_problem`, and `solvable`). The problems follow the official ones:
ALFRED's object and receptacle ids (`Name_bar_x_bar_y_bar_z`, a sink basin `Sink_bar_..._bar_SinkBasin`), one
location per receptacle, `canContain` from ALFRED's receptacle table, and the goal of the task type from ALFWorld's
goal library. The rooms are small (3-6 receptacles, 2-4 objects) so that the planner answers in milliseconds.

Generation is deterministic: the same `--seed` writes byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from importlib.resources import files
from pathlib import Path

TASK_TYPES = {1: "pick_and_place_simple", 3: "pick_clean_then_place_in_recep",
              4: "pick_heat_then_place_in_recep", 5: "pick_cool_then_place_in_recep"}
# the receptacle an action needs (ALFRED's domain: CleanObject at a sink basin, HeatObject at a microwave,
# CoolObject at a fridge)
TOOL = {3: "SinkBasin", 4: "Microwave", 5: "Fridge"}
ABILITY = {3: "Cleanable", 4: "Heatable", 5: "Coolable"}
PLACES = ["CounterTop", "DiningTable", "Shelf", "Cabinet", "Drawer", "SideTable", "GarbageCan", "StoveBurner"]
OBJECTS = ["Apple", "Tomato", "Potato", "Egg", "Bread", "Lettuce", "Mug", "Cup", "Bowl", "Plate", "Spoon", "Knife",
           "Fork", "SoapBar", "Cloth", "Book", "KeyChain", "CreditCard", "Pencil", "Vase"]


def _coord(rng: random.Random) -> str:
    parts = []
    for _ in range(3):
        v = rng.randint(-300, 300) / 100
        sign = "_plus_" if v >= 0 else "_minus_"
        parts.append(f"{sign}{abs(v):05.2f}".replace(".", "_dot_"))
    return "_bar_".join(parts)


def _loc(rng: random.Random) -> str:
    vals = [rng.randint(-10, 10), rng.randint(-10, 10), rng.randint(0, 3), rng.choice([0, 15, 30, 45, 60])]
    return "loc_bar_" + "_bar_".join(f"_minus_{-v}" if v < 0 else str(v) for v in vals)


def _rid(kind: str, rng: random.Random) -> str:
    if kind == "SinkBasin":
        return f"Sink_bar_{_coord(rng)}_bar_SinkBasin"
    return f"{kind}_bar_{_coord(rng)}"


def make_game(task_type: int, rng: random.Random):
    """One solvable game of `task_type`: (traj_data, pddl problem text, pddl_params)."""
    import alfworld.gen.constants as C  # optional: alfworld
    import alfworld.gen.goal_library as glib  # optional: alfworld

    can = C.VAL_RECEPTACLE_OBJECTS
    while True:
        n_places = rng.randint(2, 4)
        kinds = rng.sample(PLACES, n_places)
        if task_type in TOOL:
            kinds.append(TOOL[task_type])
        if rng.random() < 0.5 and "Fridge" not in kinds:
            kinds.append("Fridge")
        rng.shuffle(kinds)
        pool = [o for o in OBJECTS if task_type not in ABILITY or o in C.VAL_ACTION_OBJECTS[ABILITY[task_type]]]
        target = rng.choice(pool)
        # the goal's receptacle: one that can hold the target and is not the action's tool
        dest = [k for k in kinds if target in can.get(k, ()) and k != TOOL.get(task_type)]
        if not dest:
            continue
        parent = rng.choice(dest)
        # the target starts in another receptacle that can hold it (so the task is not solved at the start)
        start = [k for k in kinds if target in can.get(k, ()) and k != parent and k != TOOL.get(task_type)]
        if not start:
            continue
        break
    recs = {k: _rid(k, rng) for k in kinds}
    locs = {k: _loc(rng) for k in kinds}
    agent_loc = _loc(rng)
    while agent_loc in locs.values():
        agent_loc = _loc(rng)
    objects = [(target, rng.choice(start))]
    for _ in range(rng.randint(1, 3)):
        o = rng.choice([x for x in OBJECTS if x != target])
        holders = [k for k in kinds if o in can.get(k, ()) and k != TOOL.get(task_type)]
        if holders:
            objects.append((o, rng.choice(holders)))
    oids = [(o, f"{o}_bar_{_coord(rng)}", k) for o, k in objects]

    # the types the problem uses, and the ones ALFRED's domain names as constants; a name is declared once
    otypes = sorted({o for o, _ in objects} | {"ButterKnife", "Knife"})
    rtypes = sorted((set(kinds) | {"Sink", "SinkBasin", "Microwave", "Fridge"}) - set(otypes))
    lines = ["(define (problem plan_trial_{name})", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"        {t}Type - otype" for t in otypes]
    lines += [f"        {t}Type - rtype" for t in rtypes]
    lines += [f"        {oid} - object" for _, oid, _ in oids]
    lines += [f"        {recs[k]} - receptacle" for k in kinds]
    lines += [f"        {loc} - location" for loc in sorted(set(locs.values()) | {agent_loc})]
    lines += ["        )", "", "(:init", ""]
    init = [f"(receptacleType {recs[k]} {k}Type)" for k in kinds]
    init += [f"(objectType {oid} {o}Type)" for o, oid, _ in oids]
    init += [f"(canContain {k}Type {o}Type)" for k in kinds for o in otypes if o in can.get(k, ())]
    init += [f"(pickupable {oid})" for _, oid, _ in oids]
    init += [f"(openable {recs[k]})" for k in kinds if k in C.OPENABLE_CLASS_SET]
    init += [f"(atLocation agent1 {agent_loc})"]
    for o, oid, _ in oids:
        for ability, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable")):
            if o in C.VAL_ACTION_OBJECTS[ability]:
                init.append(f"({pred} {oid})")
    init += [f"(inReceptacle {oid} {recs[k]})" for _, oid, k in oids]
    init += [f"(receptacleAtLocation {recs[k]} {locs[k]})" for k in kinds]
    init += [f"(objectAtLocation {oid} {locs[k]})" for _, oid, k in oids]
    lines += [f"        {x}" for x in init]
    lines += ["        )", ""]
    goal = glib.gdict[TASK_TYPES[task_type]]["pddl"].format(obj=target, recep=parent, toggle="", mrecep="")
    goal = goal.replace("#", "-").rstrip()
    assert goal.endswith(")")
    goal = goal[:-1].rstrip()    # the problem's closing parenthesis comes after the metric
    lines += [goal, "        (:metric minimize (total-cost))", "    )", ""]
    params = {"object_target": target, "parent_target": parent, "toggle_target": "", "mrecep_target": "",
              "object_sliced": False}
    return "\n".join(lines), params


def write_games(out: Path, split: str, count: int, seed: int, task_types: list[int]) -> list[Path]:

    import alfworld  # optional: alfworld
    from alfworld.agents.utils.misc import add_task_to_grammar  # optional: alfworld

    data = files(alfworld) / "data"
    domain = (data / "alfred.pddl").read_text()
    grammar = (data / "alfred.twl2").read_text()
    rng = random.Random(f"{seed}-{split}")
    written = []
    for i in range(count):
        task_type = task_types[i % len(task_types)]
        problem, params = make_game(task_type, rng)
        room = 900 + i
        trial = f"trial_T{seed:04d}{i:04d}_{split}"
        name = f"{TASK_TYPES[task_type]}-{params['object_target']}-None-{params['parent_target']}-{room}"
        folder = out / split / name / trial
        folder.mkdir(parents=True, exist_ok=True)
        traj = {"task_type": TASK_TYPES[task_type], "pddl_params": params, "scene": {"scene_num": room},
                "task_id": trial, "turk_annotations": {"anns": []}}
        template_rng = random.Random(f"{seed}-{split}-{i}")
        state = random.getstate()              # ALFWorld's template choice draws from the global generator
        random.seed(template_rng.random())
        try:
            g = add_task_to_grammar(grammar, traj)
        finally:
            random.setstate(state)
        problem = problem.replace("{name}", trial[6:])
        game = {"pddl_domain": domain, "grammar": g, "pddl_problem": problem, "solvable": True}
        (folder / "traj_data.json").write_text(json.dumps(traj, indent=2, sort_keys=True) + "\n")
        (folder / "game.tw-pddl").write_text(json.dumps(game) + "\n")
        written.append(folder / "game.tw-pddl")
    return written


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=24)
    ap.add_argument("--valid", type=int, default=8)
    ap.add_argument("--task-types", type=int, nargs="+", default=sorted(TASK_TYPES))
    a = ap.parse_args(argv)
    n = len(write_games(a.out, "train", a.train, a.seed, a.task_types))
    n += len(write_games(a.out, "valid_seen", a.valid, a.seed + 1, a.task_types))
    print(f"wrote {n} games under {a.out}")


if __name__ == "__main__":
    main()

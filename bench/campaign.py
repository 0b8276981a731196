"""A claim's campaign: paired seeds in batches under a group-sequential design fixed in advance, so that it stops
as soon as the claim is decided and its error rate still holds (docs/statistics.md, Campaigns).

The design (`Design`) fixes before any run: the claim's two arms, the primary metric, the maximum number of seeds,
the looks (the seeds after which the data are read; the first at 8 or more, since the sign-flip test cannot reach
the early boundaries with fewer), the seed order, alpha and the equivalence margin delta.

At look k with n_k seeds, the per-seed paired differences d_1..d_{n_k} (in seed order) are tested against an
alpha-spending boundary: Lan-DeMets' O'Brien-Fleming-type function `spent(t) = 2 - 2 Phi(z_{1 - alpha/2} /
sqrt(t))`, t = n_k / max seeds, calibrated exactly on the sign patterns of the observed differences
(`boundaries`): c_k is the smallest |mean| at which the patterns that cross c_1..c_{k-1} at an earlier look, or
c_k at this one, are at most `spent(t_k)` of all 2^{n_k} (random patterns past `EXACT_UP_TO` seeds). The claim is
*better* or *worse* when the observed |mean| reaches c_k; *equivalent within +-delta* (a non-binding stop: it
never moves the efficacy boundary) when both one-sided sign-flip tests of the shifted differences pass at this
look's increment of alpha and the 90 % t-interval is inside +-delta; else the campaign goes on to the next look,
and at the last one it is *undecided*, with the seeds a simulation expects a decision to need. A seed whose run
crashed counts: its arm scores 0 at every iteration it did not evaluate.

    python -m bench.campaign CLAIM --jobs 2 --cores 1          # run the next batch, record it, decide
    python -m bench.campaign CLAIM --report-only               # decide from what is recorded

A claim is a folder `docs/data/claims/<CLAIM>/` holding `design.yaml` (the `Design`'s keys, plus `params`: the
config file, `sets`: overrides for every run, `arms`: {label: [credit method, KEY=VALUE ...]} for the method
and the baseline, `secondary`: labels of further arms run on the same seeds and reported beside the claim, outside
its stopping rule, and `shared_through`: 1, the arms of a seed share its initial policy and first rollout, or 0,
the initial policy only, for arms that roll out differently). Each finished run is recorded there as
`runs/<label>_s<seed>/` (its per-task held-out success,
`task_success.csv`; its params; `run.json`: status, CPU, bf16 flags, commit, wall seconds), small files to commit
as they land, so that a campaign goes on after a restart on another machine. The runner takes the seeds the next
look needs that are not recorded, runs every arm of each (`bench.learning`: one initial policy and first rollout
per seed through `run.base`, on this machine: a pair never spans two machines), records them, and writes
`looks.csv`, one row per look reached, the last one's decision the campaign's, and with secondary arms
`secondary.csv`: each secondary arm against the claim's method on the paired seeds (`bench.verdicts.
compare_methods`, Holm-corrected across the secondary arms; descriptive: the campaign neither stops nor goes on
for them), and `campaign.png` (`plot`): the arms' curves and the sequential test at a glance.

    python -m bench.campaign CLAIM --seeds 0 1                 # only these seeds of the next batch, this time

Claims that start from one config (the same `params`, `sets` and `shared_through`) run together: `python -m
bench.campaign CLAIM CLAIM ...` makes each seed's base once and each distinct arm (the same credit method and
overrides) once, and records that run under every claim that has the arm (`run.json`'s `shared_with` names the
others). GiGPO and OPRL against GRPO on Sokoban then run three arms a seed, not four; the three SQL claims four
runs, not six. A shared baseline arm correlates the claims' verdicts; each claim's own error rate is unchanged
(docs/statistics.md, Campaigns). A claim already decided drops out and its arms stop running for it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from statistics import NormalDist

import numpy as np
import polars as pl
import yaml

from bench import cpu_generation, cpu_name, label_seed
from bench.verdicts import (
    DELTA,
    Verdict,
    compare_methods,
    equivalence_p,
    evaluated_iterations,
    interval,
    seed_pair,
    seeds_to_decide,
    sign_patterns,
    task_success,
    verdict_frame,
)

EXACT_UP_TO = 16          # seeds whose 2^n sign patterns are enumerated at a look
RANDOM_PATTERNS = 100_000
FIRST_LOOK = 8


@dataclass(frozen=True)
class Design:
    claim: str
    method: str                    # the arm the claim is about
    baseline: str
    metric: str                    # the primary metric: final or auc (bench.verdicts)
    looks: tuple[int, ...]         # seeds at each look, increasing; the last is the maximum
    alpha: float = 0.05
    delta: float = DELTA
    seed_order: tuple[int, ...] = field(default=())   # default 0, 1, ..., max - 1

    def __post_init__(self):
        if self.metric not in ("final", "auc"):
            raise ValueError(f"design {self.claim}: metric {self.metric!r}; expected final or auc")
        if not self.looks or list(self.looks) != sorted(set(self.looks)):
            raise ValueError(f"design {self.claim}: looks {self.looks} must be increasing seed counts")
        if self.looks[0] < FIRST_LOOK:
            raise ValueError(f"design {self.claim}: the first look at {self.looks[0]} seeds; the sign-flip test "
                             f"cannot reach an O'Brien-Fleming boundary before {FIRST_LOOK}")
        if self.seed_order and len(self.seed_order) != self.max_seeds:
            raise ValueError(f"design {self.claim}: seed_order has {len(self.seed_order)} seeds, the design "
                             f"{self.max_seeds}")

    @property
    def max_seeds(self) -> int:
        return self.looks[-1]

    @property
    def seeds(self) -> tuple[int, ...]:
        return self.seed_order or tuple(range(self.max_seeds))


def spent(t: float, alpha: float = 0.05) -> float:
    """Lan-DeMets' O'Brien-Fleming-type alpha spent by information fraction t (two-sided)."""
    if t <= 0:
        return 0.0
    z = NormalDist().inv_cdf(1 - alpha / 2)
    return min(alpha, 2 - 2 * NormalDist().cdf(z / math.sqrt(t)))


def _patterns(n: int, seed: int = 0) -> np.ndarray:
    if n <= EXACT_UP_TO:
        return sign_patterns(n)
    return np.random.default_rng(seed).choice((1.0, -1.0), size=(RANDOM_PATTERNS, n))


def boundaries(d: np.ndarray, looks: tuple[int, ...], max_seeds: int, alpha: float = 0.05) -> list[float]:
    """The critical |mean| of the differences at each look that `d` reaches (in order; inf: no |mean| can cross
    within the alpha spent so far), each calibrated on the sign patterns of the differences seen at that look with
    the earlier looks' boundaries fixed."""
    d = np.asarray(d, dtype=np.float64)
    out: list[float] = []
    for k, n in enumerate(looks):
        if n > len(d):
            break
        signs = _patterns(n)
        stats = [np.abs(signs[:, :m] @ d[:m]) / m for m in looks[: k + 1]]
        tol = 1e-12 * max(1.0, float(np.abs(d[:n]).max()))
        crossed = np.zeros(len(signs), dtype=bool)
        for j, c in enumerate(out):
            crossed |= stats[j] >= c - tol
        budget = spent(n / max_seeds, alpha) * len(signs)
        free = np.sort(stats[k][~crossed])[::-1]          # the patterns not yet crossed, largest |mean| first
        room = math.floor(budget - crossed.sum() + 1e-9)
        if room <= 0 or not len(free):
            out.append(math.inf)
            continue
        # the smallest c with #(free >= c) <= room: ties at the cut move c up past them
        c = free[min(room, len(free)) - 1]
        while (free >= c - tol).sum() > room:
            above = free[free > c + tol]
            if not len(above):
                c = math.inf
                break
            c = above.min()
        out.append(float(c))
    return out


@dataclass
class Look:
    seeds: int
    mean: float
    boundary: float
    alpha_spent: float
    p_equivalence: float
    ci90: tuple[float, float]
    decision: str           # better, worse, equivalent, continue, undecided
    seeds_to_decide: int | None = None


def decide(design: Design, d: np.ndarray, estimate: bool = True) -> list[Look]:
    """Every look the per-seed differences `d` (points, in the design's seed order) reach, the last one's decision
    being the campaign's: it stops at the first look that decides. `estimate`: an undecided campaign's seeds to
    decide (a simulation of its own)."""
    d = np.asarray(d, dtype=np.float64)
    bounds = boundaries(d, design.looks, design.max_seeds, design.alpha)
    looks, before = [], 0.0
    for n, c in zip(design.looks, bounds):
        x = d[:n]
        mean = float(x.mean())
        a = spent(n / design.max_seeds, design.alpha)
        se = float(x.std(ddof=1)) / math.sqrt(n)
        ci90 = interval(mean, se, n - 1, 0.90)
        p_eq = equivalence_p(x, design.delta)
        tol = 1e-12 * max(1.0, float(np.abs(x).max()))
        if abs(mean) >= c - tol:
            decision = "better" if mean > 0 else "worse"
        elif p_eq < a - before and -design.delta < ci90[0] and ci90[1] < design.delta:
            decision = "equivalent"
        elif n == design.max_seeds:
            decision = "undecided"
        else:
            decision = "continue"
        need = seeds_to_decide(x, design.delta) if decision == "undecided" and estimate else None
        looks.append(Look(n, mean, c, a, p_eq, ci90, decision, need))
        before = a
        if decision != "continue":
            break
    return looks


CLAIMS = Path(__file__).resolve().parents[1] / "docs" / "data" / "claims"
DESIGN_KEYS = {f.name for f in fields(Design)}


@dataclass(frozen=True)
class Claim:
    design: Design
    params: Path                   # the config every run starts from
    sets: tuple[str, ...]          # overrides for every run
    arms: dict                     # label -> [credit method, KEY=VALUE ...]
    folder: Path
    shared_through: int = 1        # the arms share iteration 0 (0) or iterations 0 and 1 (1) of each seed's base run
    secondary: tuple[str, ...] = ()   # further arms run on the same seeds, reported outside the stopping rule

    @property
    def labels(self) -> tuple[str, ...]:
        """Every arm a seed runs: the method, the baseline, then the secondary arms."""
        return (self.design.method, self.design.baseline, *self.secondary)


def load_claim(folder: Path) -> Claim:
    """The claim in `folder` (its design.yaml), checked before any run: one clear error naming the file and key."""
    f = folder / "design.yaml"
    if not f.is_file():
        raise SystemExit(f"error: {f}: no design.yaml; a claim folder holds one (bench/campaign.py)")
    raw = yaml.safe_load(f.read_text()) or {}
    for key in ("params", "arms", "claim", "method", "baseline", "metric", "looks"):
        if key not in raw:
            raise SystemExit(f"error: {f}: key {key!r} is missing")
    arms = raw["arms"]
    for label in (raw["method"], raw["baseline"]):
        if label not in arms or not arms[label]:
            raise SystemExit(f"error: {f}: arms has no {label!r} (the method and the baseline each need [credit "
                             f"method, KEY=VALUE ...])")
    secondary = raw.get("secondary", [])
    if not isinstance(secondary, list):
        raise SystemExit(f"error: {f}: secondary {secondary!r}; expected a list of arm labels")
    for label in secondary:
        if label not in arms or not arms[label] or label in (raw["method"], raw["baseline"]):
            raise SystemExit(f"error: {f}: secondary arm {label!r} is not an arm of its own in arms (the method "
                             f"and the baseline are the claim's)")
    unknown = set(raw) - DESIGN_KEYS - {"params", "sets", "arms", "shared_through", "secondary"}
    if unknown:
        raise SystemExit(f"error: {f}: unknown keys {sorted(unknown)}")
    try:
        design = Design(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in raw.items() if k in DESIGN_KEYS})
    except (TypeError, ValueError) as e:
        raise SystemExit(f"error: {f}: {e}") from None
    root = Path(__file__).resolve().parents[1]
    params = Path(raw["params"]) if Path(raw["params"]).is_absolute() else root / raw["params"]
    if not params.is_file():
        raise SystemExit(f"error: {f}: params {raw['params']!r} is not a file")
    through = raw.get("shared_through", 1)
    if through not in (0, 1):
        raise SystemExit(f"error: {f}: shared_through {through!r}; expected 1 (the arms share each seed's initial "
                         "policy and first rollout) or 0 (the initial policy only: arms whose rollouts differ)")
    return Claim(design, params, tuple(raw.get("sets", [])), arms, folder, through, tuple(secondary))


def recorded(claim: Claim) -> dict[tuple[str, int], tuple[pl.DataFrame, dict]]:
    """The recorded runs: (label, seed) -> (per-task success table, run.json)."""
    out = {}
    for d in sorted((claim.folder / "runs").glob("*_s*")):
        label, seed = label_seed(d.name)
        if (d / "task_success.csv").is_file() and (d / "run.json").is_file():
            out[(label, seed)] = (pl.read_csv(d / "task_success.csv"), json.loads((d / "run.json").read_text()))
    return out


MACHINE_KEYS = ("cpu", "cpu_family", "cpu_model", "bf16_flags")


def machine_differs(a: dict, b: dict) -> str | None:
    """The first of `MACHINE_KEYS` on which two runs' records disagree: the CPU's name always, its family, model and
    bf16 flags where both records hold them (records made before those were kept name the CPU only); None where
    they ran on one kind of machine."""
    return next((k for k in MACHINE_KEYS if (k == "cpu" or k in a and k in b) and a.get(k) != b.get(k)), None)


def differences(claim: Claim, runs: dict) -> tuple[list[int], np.ndarray]:
    """The seeds (in the design's order, as far as both arms are recorded without a gap) and their paired
    differences in the primary metric, points. A crashed arm scores 0 at every iteration its pair evaluated and
    it did not; a pair whose arms ran on different CPUs is refused (`machine_differs`)."""
    design = claim.design
    seeds, d = [], []
    for s in design.seeds:
        a, b = runs.get((design.method, s)), runs.get((design.baseline, s))
        if a is None or b is None:
            break
        k = machine_differs(a[1], b[1])
        if k:
            raise SystemExit(f"error: {claim.folder}: seed {s}'s arms ran on {k} {a[1].get(k)!r} and "
                             f"{b[1].get(k)!r} (runs/{design.method}_s{s}/run.json, runs/{design.baseline}_s{s}/"
                             "run.json); a pair is compared within one machine")
        ta, tb = a[0], b[0]
        its = sorted(set(ta["iteration"].to_list()) | set(tb["iteration"].to_list()))
        tasks = sorted(set(ta["task_id"].to_list()) & set(tb["task_id"].to_list()))

        final, auc, _ = seed_pair(_matrix(ta, its, tasks), _matrix(tb, its, tasks), its)
        seeds.append(s)
        d.append(100.0 * float((final if design.metric == "final" else auc).mean()))
    return seeds, np.array(d)


def _matrix(t: pl.DataFrame, its: list[int], tasks: list) -> np.ndarray:
    """Iterations x tasks success of a recorded run, 0 where it did not evaluate (a crashed run)."""
    m = np.zeros((len(its), len(tasks)))
    where = {(int(r["iteration"]), r["task_id"]): r["success"] for r in t.iter_rows(named=True)}
    for i, it in enumerate(its):
        for j, task in enumerate(tasks):
            m[i, j] = where.get((it, task), 0.0)
    return m


def record(claim: Claim, label: str, seed: int, run_dir: Path, status: str, wall_s: float,
           shared_with: list[str] = ()) -> None:
    """Copy a finished (or crashed) run's per-task success, params and provenance into the claim's folder
    (`shared_with`: the other claims the same run is recorded under)."""
    from pipeline.model.precision import cpu_bf16_flags  # start-up cost: torch, for a run being recorded

    results = run_dir / "results"
    its = evaluated_iterations(results) if results.is_dir() else []
    table = task_success(results, its) if its else pl.DataFrame(
        schema={"iteration": pl.Int64, "task_id": pl.Int64, "success": pl.Float64})
    out = claim.folder / "runs" / f"{label}_s{seed}"
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    table.write_csv(tmp / "task_success.csv")
    if (run_dir / "params.yaml").is_file():
        shutil.copy(run_dir / "params.yaml", tmp / "params.yaml")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    (tmp / "run.json").write_text(json.dumps({
        "status": status, "cpu": cpu_name(), **cpu_generation(), "bf16_flags": cpu_bf16_flags(),
        "machine": platform.node(), "commit": commit, "wall_s": round(wall_s, 1),
        "iterations": its, **({"shared_with": list(shared_with)} if shared_with else {})}, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def next_batch(claim: Claim, runs: dict) -> list[int]:
    """The seeds of the next look that are not recorded for both arms (in the design's order)."""
    design = claim.design
    seeds, d = differences(claim, runs)
    looks = decide(design, d, estimate=False)          # none before the first look
    if looks and looks[-1].decision != "continue":
        return []
    target = next((n for n in design.looks if n > len(seeds)), None)
    if target is None:
        return []
    return [s for s in design.seeds[:target] if any((label, s) not in runs for label in claim.labels)]


def together(claims: list[Claim]) -> None:
    """Claims run together share each seed's base run, so they must start from one config: the same params file,
    overrides and `shared_through` (one clear error naming the two claims and the key)."""
    first = claims[0]
    for c in claims[1:]:
        for key, a, b in (("params", first.params, c.params), ("sets", first.sets, c.sets),
                          ("shared_through", first.shared_through, c.shared_through)):
            if a != b:
                raise SystemExit(f"error: claims {first.design.claim} and {c.design.claim} differ in {key} ({a!r}, "
                                 f"{b!r}); claims run together share each seed's base run: run them one at a time")
    names = [c.design.claim for c in claims]
    if len(set(names)) != len(names):
        raise SystemExit(f"error: claims {names}: one claim named twice")


def shared_runs(claims: list[Claim]) -> dict[str, tuple[str, list[str], list[tuple[Claim, str]]]]:
    """The distinct arms of `claims`: run label -> (credit method, overrides, [(claim, its label for the arm)]).
    Two claims' arms are one run where their method and overrides are the same; a run takes the first claim's label
    for it, or, where another arm already holds that label, `<claim>.<label>`."""
    runs: dict[str, tuple[str, list[str], list[tuple[Claim, str]]]] = {}
    by_spec: dict[tuple, str] = {}
    for c in claims:
        for label in c.labels:
            method, *own = c.arms[label]
            spec = (method, tuple(own))
            name = by_spec.get(spec)
            if name is None:
                name = label if label not in runs else f"{c.design.claim}.{label}"
                by_spec[spec] = name
                runs[name] = (method, list(own), [])
            runs[name][2].append((c, label))
    return runs


def run_batch(claims: list[Claim], seeds: list[int], work: Path, jobs: int, cores: int) -> None:
    """Every arm of every claim in `claims` (which need the same `seeds`; `together`) for every seed:
    bench.learning's runs from one initial policy per seed, each distinct arm run once (`shared_runs`) and
    recorded under every claim that has it the moment it ends, crashed or not (commit them as they land: the next
    session may be on another machine); a run that never started (its seed's base run failed) is recorded as
    crashed when the batch ends."""
    from bench import learning

    together(claims)
    shared = shared_runs(claims)
    arms = {name: (method, own) for name, (method, own, _) in shared.items()}
    started = time.perf_counter()
    done: set[Path] = set()

    def record_all(d: Path, status: str, wall: float) -> None:
        name, seed = label_seed(d.name)
        users = shared[name][2]
        for c, label in users:
            others = [o.design.claim for o, _ in users if o is not c]
            record(c, label, seed, d, status, wall, shared_with=others)
            print(f"campaign {c.design.claim}: {d.name} {status} in {wall:.0f} s, recorded in "
                  f"{c.folder / 'runs' / f'{label}_s{seed}'}", flush=True)

    def ended(d: Path, error: BaseException | None, wall: float) -> None:
        record_all(d, "ok" if error is None and _finished(d) else "crashed", wall)
        done.add(d)

    first = claims[0]
    try:
        learning.run_all(first.params, [], seeds, work, jobs, cores, list(first.sets), arms, first.shared_through,
                         on_done=ended)
    except RuntimeError as e:            # some runs failed: they are recorded as crashed, and count
        print(f"campaign: {e}", flush=True)
    wall = time.perf_counter() - started
    for s in seeds:
        for name in arms:
            d = work / f"{name}_s{s}"
            if d not in done:
                record_all(d, "ok" if _finished(d) else "crashed", wall)


def plan(claims: list[Claim], batches: dict[str, list[int]]) -> list[tuple[list[Claim], list[int]]]:
    """The batches of claims run together: each seed some claim's next look needs, with the claims that need it
    (their arms run from one base of that seed); seeds needed by the same claims form one batch, in the order
    the first claim lists its seeds."""
    order: list[int] = []
    for c in claims:
        order += [s for s in batches[c.design.claim] if s not in order]
    groups: dict[tuple[str, ...], list[int]] = {}
    for s in order:
        key = tuple(c.design.claim for c in claims if s in batches[c.design.claim])
        groups.setdefault(key, []).append(s)
    by_name = {c.design.claim: c for c in claims}
    return [([by_name[n] for n in key], seeds) for key, seeds in groups.items()]


def _finished(run_dir: Path) -> bool:
    """Whether the run evaluated its last iteration."""
    f = run_dir / "params.yaml"
    if not f.is_file():
        return False
    last = (yaml.safe_load(f.read_text()) or {}).get("loop", {}).get("iterations", 6)
    return (run_dir / "results" / f"iter_{last}" / "eval.parquet").is_file()


def secondary(claim: Claim, runs: dict, seeds: list[int]) -> tuple[list[Verdict], str]:
    """Each secondary arm against the claim's method on `seeds` (the paired ones), where both ran on one machine:
    `compare_methods` with the method as the baseline, reversed (each reads method − arm), Holm-corrected across
    the secondary arms, the design's metric primary; and a sentence on the panel and any seed left out."""
    method = claim.design.method
    tables, skipped = {}, []
    for label in claim.secondary:
        for s in seeds:
            a, m = runs.get((label, s)), runs[(method, s)]
            if a is None or machine_differs(a[1], m[1]):
                skipped.append(f"{label} seed {s} " + ("not recorded" if a is None else "ran on another machine"))
                continue
            tables[(label, s)], tables[(method, s)] = a[0], m[0]
    verdicts, panel = compare_methods(tables, method, claim.design.metric, claim.design.delta, reverse=True)
    return verdicts, " ".join([panel, *([f"Left out: {', '.join(skipped)}."] if skipped else [])])


def plot(claim: Claim, runs: dict, seeds: list[int], d: np.ndarray, looks: list[Look], path: Path) -> None:
    """The campaign at a glance: every arm's learning curve over the paired seeds and each arm minus the baseline
    on the same seed (`bench.learning.draw_curves`), then the sequential test: each seed's difference in the primary
    metric in the design's order, their running mean, the boundary on the mean at each look reached, the ±delta
    band of equivalence, and the looks still to come."""
    from bench.learning import draw_curves
    from pipeline.data.figures import pyplot, save_figure

    design = claim.design
    tables = {(label, s): runs[(label, s)][0] for label in claim.labels for s in seeds if (label, s) in runs}
    curves = pl.concat([t.group_by("iteration").agg(pl.col("success").mean().alias("success_rate"))
                        .with_columns(pl.lit(label).alias("method"), pl.lit(s).alias("seed"))
                        for (label, s), t in tables.items() if t.height]).select(
        "method", "seed", pl.col("iteration").cast(pl.Int64), "success_rate").sort("method", "seed", "iteration")
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.4), dpi=110)
    draw_curves(axes[:2], curves, tables, design.baseline)
    ax = axes[2]
    n = np.arange(1, len(d) + 1)
    ax.axhspan(-design.delta, design.delta, color="tab:green", alpha=0.08, label=f"±δ = {design.delta:g} (equivalence)")
    ax.scatter(n, d, color="tab:gray", zorder=3, label="one seed's difference")
    for k, s in zip(n, seeds):
        ax.annotate(f"s{s}", (k, d[k - 1]), textcoords="offset points", xytext=(4, 3), fontsize=7, color="tab:gray")
    ax.plot(n, np.cumsum(d) / n, color="black", marker=".", label="running mean")
    labelled = False
    for look in looks:
        if math.isfinite(look.boundary):
            ax.plot([look.seeds] * 2, [-look.boundary, look.boundary], ls="none", marker="_", ms=18, mew=2,
                    color="tab:red", label=None if labelled else "± the boundary on the mean at a look")
            ax.annotate(f"±{look.boundary:.2f}", (look.seeds, -look.boundary), textcoords="offset points",
                        xytext=(6, -4), fontsize=8, color="tab:red")
            labelled = True
        else:
            ax.annotate("no boundary\nwithin the α spent", (look.seeds, 1), xycoords=("data", "axes fraction"),
                        textcoords="offset points", xytext=(3, -22), fontsize=7, color="tab:red")
        ax.annotate(look.decision, (look.seeds, look.mean), textcoords="offset points", xytext=(6, 6), fontsize=8,
                    fontweight="bold")
    for k in design.looks:
        ax.axvline(k, color="tab:red", ls=":", lw=0.8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xlim(0.5, design.max_seeds + 0.5)
    ax.set_ylim(1.15 * min(-design.delta, float(d.min())), 1.15 * max(design.delta, float(d.max())))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel(f"seeds paired (looks at {', '.join(map(str, design.looks))}: dotted)")
    metric = "final" if design.metric == "final" else "mean over the unshared iterations"
    ax.set_ylabel(f"{design.method} − {design.baseline}, {metric} (points)")
    ax.set_title(f"The sequential test: {looks[-1].decision if looks else 'before the first look'}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{design.claim}: {len(seeds)} of {design.max_seeds} seeds paired")
    save_figure(fig, path)


def report(claim: Claim, estimate: bool = True) -> list[Look]:
    runs = recorded(claim)
    seeds, d = differences(claim, runs)
    rows = []
    looks = decide(claim.design, d, estimate)           # none before the first look
    for x in looks:
        rows.append({**{k: v for k, v in asdict(x).items() if k != "ci90"}, "ci90_low": x.ci90[0],
                     "ci90_high": x.ci90[1]})
    from pipeline.data.tables import write_text_atomic

    if rows:
        write_text_atomic(claim.folder / "looks.csv", pl.DataFrame(rows).write_csv())
    d_text = ", ".join(f"{v:+.1f}" for v in d)
    print(f"{claim.design.claim}: {len(seeds)} of {claim.design.max_seeds} seeds paired ({d_text})")
    for x in looks:
        print(f"  look at {x.seeds} seeds: mean {x.mean:+.1f} points, boundary {x.boundary:.2f}, alpha spent "
              f"{x.alpha_spent:.4f}, equivalence p {x.p_equivalence:.3f}: {x.decision}"
              + (f" (about {x.seeds_to_decide} seeds expected to decide)" if x.seeds_to_decide else ""))
    if seeds:
        plot(claim, runs, seeds, d, looks, claim.folder / "campaign.png")
    if claim.secondary and seeds:
        verdicts, panel = secondary(claim, runs, seeds)
        if verdicts:
            write_text_atomic(claim.folder / "secondary.csv", verdict_frame(verdicts).write_csv())
        print(f"  secondary arms (outside the stopping rule): {panel}")
        for v in verdicts:
            print(f"    {v.sentence}")
    return looks


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("claims", nargs="+", metavar="claim",
                    help="a folder under docs/data/claims/ (or a path to one); several start from one config and "
                         "share their seeds' base runs and common arms")
    ap.add_argument("--work", type=Path, default=Path("results/bench/claims"), help="where the runs live")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--cores", type=int, default=1)
    ap.add_argument("--seeds", type=int, nargs="+", help="run only these of the next batch's seeds this time")
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args(argv)
    claims = [load_claim(Path(c) if Path(c).is_dir() else CLAIMS / c) for c in a.claims]
    together(claims)
    work = a.work / "+".join(c.design.claim for c in claims)
    while not a.report_only:
        batches = {}
        for c in claims:
            batch = next_batch(c, recorded(c))
            batches[c.design.claim] = [s for s in batch if a.seeds is None or s in a.seeds]
        steps = plan(claims, batches)
        if not steps:
            break
        for group, seeds in steps:
            names = ", ".join(c.design.claim for c in group)
            print(f"campaign {names}: running seeds {seeds}", flush=True)
            run_batch(group, seeds, work, a.jobs, a.cores)
        for c in claims:
            report(c, estimate=False)
    for c in claims:
        report(c)


if __name__ == "__main__":
    main()

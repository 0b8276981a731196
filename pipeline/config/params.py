"""Every knob of the pipeline, as a typed and validated schema of `params.yaml`.

An unknown key, a wrong type or a value out of range stops the run before any work, with one message that names
the file, the dotted key and what was expected (`ParamsError`).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated, Literal, Union

import yaml
from pydantic import Discriminator, Field, Tag, ValidationError, create_model, model_validator

from pipeline.config.allocator import CHOICES as ALLOCATORS
from pipeline.config.allocator import tcmalloc_library
from pipeline.config.files import ParamsError, chain_of, origin_of, read_params
from pipeline.credit.methods import METHODS, EpisodeConfig, Method, history_depth
from pipeline.data.section import LoraSettings, MicroBatching, Section
from pipeline.data.seeds import MAX_INDEX, MAX_ITERATION
from pipeline.envs.base import CAPABILITIES
from pipeline.envs.base import registered as registered_envs
from pipeline.model.gguf_import import gguf_header, is_gguf
from pipeline.rollout.shards import shard_slices

GROUPS_PER_ITERATION = 1_000_000  # task-group ids of iteration i are i * GROUPS_PER_ITERATION + index


class LoopConfig(Section):
    iterations: int = Field(6, ge=1, le=min(1000, MAX_ITERATION),
                            description="RL iterations after iteration 0 (the initial policy)")
    off_policy_lag: Literal[0, 1] = Field(0, description="1: rollout i samples from the checkpoint of i-2 (iterations "
                                          "1 and 2 from iteration 0's), so that rollout i+1 runs beside update i; "
                                          "the update then uses the decoupled PPO loss (docs/credit-assignment.md, "
                                          "One step off-policy). 0: rollout i samples from the checkpoint of i-1")


ENV_REGISTRY = registered_envs()
DEFAULT_ENV = "sokoban"


def _env_name(value) -> str:
    return (value.get("name", DEFAULT_ENV) if isinstance(value, dict) else getattr(value, "name", DEFAULT_ENV))


# `env` is the section of the environment `env.name` names (default sokoban); each environment module declares its
# own (pipeline/envs/).
EnvConfig = Annotated[Union[tuple(Annotated[s.config, Tag(n)] for n, s in ENV_REGISTRY.items())],  # noqa: UP007
                      Discriminator(_env_name)]


class PromptConfig(Section):
    history_turns: int = Field(2, ge=0, le=20, description="earlier turns (observation, action) shown in the prompt")
    demonstrations: int = Field(0, ge=0, le=20, description="expert episodes of the most similar training tasks "
                                "shown in the task text, after the part tasks share (a database's schema; BM25 over "
                                "the task text; LearNAT's adaptive demonstrations; needs an environment with an "
                                "expert); 0: none")
    demonstration_pool: int = Field(200, ge=1, le=100_000, description="warm-start tasks whose expert episodes the "
                                    "demonstrations are drawn from, played once per run")


class TinyModelConfig(Section):
    vocab_size: int = Field(768, ge=300, le=65536, description="byte-level BPE vocabulary trained on env text")
    hidden_size: int = Field(64, ge=16, description="Llama hidden size")
    intermediate_size: int = Field(192, ge=16, description="Llama MLP size")
    num_hidden_layers: int = Field(2, ge=1, description="Llama layers")
    num_attention_heads: int = Field(2, ge=1, description="attention heads (must divide hidden_size); the head "
                                     "size hidden_size / heads must be one vLLM's CPU attention accepts (32 here)")
    tokenizer_corpus_episodes: int = Field(300, ge=10, le=MAX_INDEX,
                                           description="random episodes rendered to train the tokenizer")

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        return self


class PolicyConfig(Section):
    path: str | None = Field(None, description="a local Hugging Face model folder, or a GGUF file that init "
                             "dequantizes into a plain folder (scripts/install-models); null builds the tiny default")
    tiny: TinyModelConfig = TinyModelConfig()
    max_new_tokens: int = Field(12, ge=1, le=4096, description="response length cap in tokens")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32", description="the dtype the policy computes in (master weights and optimiser state stay fp32): "
        "auto is bfloat16 where the device computes bf16 natively (a CPU with avx512_bf16 or amx_bf16, a CUDA GPU of "
        "compute capability 8.0 on), else float32; the init stage decides it for the whole run and records it beside "
        "iteration 0's checkpoint (docs/models.md, Precision)")
    lora: LoraSettings | None = Field(None, description="train LoRA adapters instead of the whole policy (null: "
                                      "full fine-tuning)")
    merge_rounding: Literal["nearest", "stochastic"] = Field(
        "nearest", description="how a LoRA checkpoint sampled in bf16 (rollout, evaluation) rounds its merged weights: "
        "nearest (the adapter merged in bf16: an update below half of bf16's spacing at its weight is lost) or "
        "stochastic (merged in fp32, each weight then rounded up or down at random, the update kept in expectation; "
        "docs/models.md, Precision)")

    @model_validator(mode="after")
    def _path_exists(self):
        if self.path is not None and is_gguf(self.path):
            gguf_header(self.path)
        elif self.path is not None:
            p = Path(self.path).expanduser()
            if not p.is_dir() or not (p / "config.json").is_file():
                raise ValueError(f"path {self.path!r} is not a Hugging Face model folder (no config.json there)")
            try:
                config = json.loads((p / "config.json").read_text())
            except (OSError, ValueError) as e:
                raise ValueError(f"path {self.path!r}: config.json is not readable JSON ({e})") from None
            if not isinstance(config, dict) or not config.get("model_type"):
                raise ValueError(f"path {self.path!r}: config.json names no model_type, so transformers cannot load "
                                 "the folder as a model")
        return self


class WarmstartConfig(MicroBatching):
    """Supervised fine-tuning of iteration 0's policy on the environment's expert demonstrations, through the model's
    chat template, with the loss on the response tokens (`pipeline.rollout.warmstart`)."""
    episodes: int = Field(1500, ge=0, le=MAX_INDEX, description="expert-guided episodes turned into demonstrations")
    tasks: int | None = Field(None, ge=1, le=MAX_INDEX, description="distinct warm-start tasks the episodes cycle "
                              "through (null: a new task every episode; set it where tasks are costly to make, as "
                              "generated text games are)")
    random_action_share: float = Field(0.65, ge=0.0, le=1.0, description="share of demonstration turns labelled "
                                       "with a random action instead of an optimal one")
    steps: int | None = Field(None, ge=0, description="supervised optimisation steps; null: 800 for the tiny "
                              "default, 0 (no warm start) for a model from policy.path")
    clean_steps: int = Field(600, ge=0, description="the first steps, trained on optimal labels only (the mapping); "
                             "the remaining steps use the mixed labels (the policy's noise)")
    batch_size: int = Field(32, ge=1)
    lr: float | None = Field(None, gt=0.0, description="peak learning rate (warm-up over 20 steps, then linear "
                             "decay); null: 2e-3 for the tiny default, 1e-5 for a model from policy.path")
    lora: LoraSettings | None = Field(None, description="train LoRA adapters in the warm start and merge them into "
                                      "iteration 0's checkpoint (null: full fine-tuning)")
    demonstrations: int | None = Field(None, ge=0, le=20, description="retrieved demonstrations in the warm "
                                       "start's prompts (null: prompt.demonstrations'); set, the initial policy no "
                                       "longer depends on prompt.demonstrations, so runs that differ only in it "
                                       "share one warm start (run.base)")

    def steps_for(self, policy: PolicyConfig) -> int:
        return self.steps if self.steps is not None else (800 if policy.path is None else 0)

    def lr_for(self, policy: PolicyConfig) -> float:
        return self.lr if self.lr is not None else (2e-3 if policy.path is None else 1e-5)


class VllmSettings(Section):
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, le=1.0, description="share of the device's memory vLLM takes for weights and KV cache (on "
        "the CPU: of the machine's memory); null: 0.85 on a GPU, 0.2 on the CPU")
    max_model_len: int | None = Field(None, ge=16, description="longest prompt + response; null: the model's")
    lora: Literal["merged", "adapter"] = Field(
        "merged", description="how vLLM samples from a LoRA checkpoint: merged (the adapter merged into a temporary "
        "copy of the base, plain dense weights) or adapter (the base with vLLM's LoRA support, the adapter passed "
        "with every request)")
    prefix_caching: bool = Field(True, description="vLLM keeps the KV cache of prompt prefixes it has computed and "
                                 "reuses it for later prompts that start alike (the system text, a task group's "
                                 "state); vLLM's own default on a GPU and on this CPU (docs/models.md, Rollout "
                                 "engines)")


class BranchingSettings(Section):
    """`rollout.branching`: ARPO's adaptive rollout (docs/credit-assignment.md, Branching rollouts). Of a task's
    `rollout.group_size` (M) episodes, `initial` start as whole trajectories; in a state reached by a valid tool
    call each live path may hand `beam - 1` copies of that state to new episodes that share its turns so far and
    resample the turn it takes there."""
    mode: Literal["none", "entropy", "uniform"] = Field(
        "none", description="none: M independent episodes per task; entropy: a path branches in a state reached by a "
        "valid tool call with probability rising with the entropy of the response it samples there above its "
        "first turn's (ARPO); uniform: the same budget, each path branching once, at the first branch point from a "
        "turn drawn uniformly, whatever the entropy (the control)")
    initial: int | None = Field(None, ge=1, description="global trajectories started per task (N); null: half "
                                "of rollout.group_size (ARPO: 8 of 16)")
    beam: int = Field(2, ge=2, le=64, description="a branching path and its copies: beam - 1 copies at most per "
                      "path and turn")
    threshold: float = Field(0.5, ge=0.0, le=1.0, description="tau: a copy branches when clip(U - beta * dH, 0, "
                             "1) <= tau, U uniform in [0, 1)")
    entropy_weight: float = Field(0.2, ge=0.0, description="beta, the weight of dH = H(turn) - H(the path's first "
                                  "turn)")
    entropy_tokens: int = Field(20, ge=1, le=4096, description="H of a turn: the mean over its first this many "
                                "response tokens (fewer where the response is shorter)")
    top_logprobs: int = Field(10, ge=1, le=20, description="H sums -p log p over each position's top this many "
                              "candidates, divided by log |V| (ARPO's normalisation)")

    def initial_for(self, group_size: int) -> int:
        return self.initial if self.initial is not None else max(1, group_size // 2)


class RolloutConfig(Section):
    tasks_per_iteration: int = Field(32, ge=1, lt=GROUPS_PER_ITERATION, description="task groups per iteration")
    group_size: int = Field(8, ge=1, le=1000, description="episodes per task (G); episode ids are "
                            "task_group * 1000 + k")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature")
    batch_size: int = Field(256, ge=1, description="episodes generated together: the episodes are cut into fixed "
                            "blocks of this size, each generated as one batch (its live episodes) every turn")
    shards: int = Field(1, ge=1, le=256, description="Snakemake jobs per iteration's rollout, each playing a slice "
                        "of whole batches; a merge job writes the one step table, the same for any shard count")
    engine: Literal["hf", "vllm"] = Field("hf", description="what samples in rollout and evaluate: hf (Hugging Face "
                                          "generate) or vllm (vLLM's offline engine; scripts/install-vllm)")
    vllm: VllmSettings = VllmSettings()
    branching: BranchingSettings = Field(BranchingSettings(), description="adaptive branching of a task's "
                                         "episodes from each other's states (ARPO); mode none by default")

    @model_validator(mode="after")
    def _branching_fits(self):
        b = self.branching
        if b.mode != "none" and b.initial_for(self.group_size) >= self.group_size:
            raise ValueError(f"branching.initial ({b.initial_for(self.group_size)}) must be below group_size "
                             f"({self.group_size}): the episodes beyond the initial ones are the branches")
        return self


METHOD_NAMES: tuple[str, ...] = tuple(METHODS)  # the registered credit methods, in listing order
FIT_METHODS = tuple(n for n, m in METHODS.items() if m.fits)  # with a learned step reward (fit stage)


class _CreditBase(Section):
    method: Literal[METHOD_NAMES] = Field(METHOD_NAMES[0], description="advantage estimator, the first in listing "
                                          "order by default (docs/credit-assignment.md)")
    invalid_penalty: float = Field(0.1, ge=0.0, description="subtracted from an invalid turn's final advantage, "
                                   "after every normalisation (docs/credit-assignment.md, Invalid actions)")
    episode: EpisodeConfig = Field(EpisodeConfig(), description="the episode-level term A^E every method with one "
                                   "shares (docs/credit-assignment.md, Episode level, shared)")
    attribution: Literal["soft", "hard"] = Field(
        "soft", description="with rollout.branching: how the update trains a turn that branches share (copied "
        "from the parent, not sampled again). soft: every copy with its own episode's advantage (ARPO's code); "
        "hard: the turn once, with the mean advantage of its copies (docs/credit-assignment.md, Branching rollouts)")

    @property
    def method_def(self) -> Method:
        return METHODS[self.method]

    @property
    def section(self) -> Section:
        """The chosen method's own section (its step-level keys)."""
        return getattr(self, self.method)

    @property
    def needs_fit(self) -> bool:
        return self.method_def.fits

    def history_depth(self, history_turns: int) -> int:
        """How many anchors deep the group stage keys history groups (`pipeline.credit.methods.history_depth`)."""
        return history_depth(self, history_turns)


# `credit.<method>` for every registered method: each method module declares its own section.
CreditConfig = create_model(
    "CreditConfig", __base__=_CreditBase, __doc__="docs/credit-assignment.md: the method and every method's section",
    **{name: (m.config, Field(m.config(), description=m.summary)) for name, m in METHODS.items()})


class StepDpoSettings(Section):
    """Step-level preference updates (LearNAT's margin-aware DPO; docs/credit-assignment.md, Step-level preference
    updates): pairs of turns taken in the same state, the better one chosen."""
    beta: float = Field(0.1, gt=0.0, description="DPO's beta: the scale of the policy's log-ratio to the reference")
    min_gap: float = Field(0.0, ge=0.0, description="two turns of a state form a pair when their step values differ "
                           "by more than this")
    margin: Literal["value", "oracle"] = Field(
        "value", description="the rewards r whose difference the margin reads: value, the turns' step values; "
        "oracle: the similarity in [0, 1] of the state after each turn to the goal, 1 - d(s')/d(s_0) (on SQL the "
        "share of the gold query's AST covered: LearNAT's AST reward; privileged information, reports label it)")
    margin_form: Literal["log", "ratio", "linear"] = Field(
        "log", description="log: alpha x log(r_w - r_l) (LearNAT's released trainer, an ODPO offset); ratio: alpha "
        "x log(r_w / r_l), positive rewards only; linear: margin_scale x (r_w - r_l). A pair whose form is "
        "undefined (r_w <= r_l, a non-positive reward under ratio) is not made, and counted")
    alpha: float = Field(1.0, ge=0.0, description="the log and ratio forms' scale (LearNAT: 1); 0: plain DPO")
    margin_scale: float = Field(1.0, ge=0.0, description="the linear form's scale; 0: plain DPO")
    gamma: float = Field(0.95, ge=0.0, le=1.0, description="the discount of the step values that are returns (of "
                         "the environment's rewards, or of a learned per-turn score)")
    reference: Literal["previous", "init"] = Field(
        "previous", description="pi_ref: the checkpoint the update starts from, or the initial policy")
    sft_weight: float = Field(1.0, ge=0.0, description="weight of the chosen turns' negative log-likelihood, added "
                              "(0: plain DPO, which lowered the chosen turns' log-probs too and collapsed on Sokoban; "
                              "docs/results/preferences.md, Step-level DPO against PPO on the same rollouts)")
    max_pairs_per_state: int = Field(4, ge=1, le=1024, description="the pairs of one state kept at most (those of "
                                     "the largest gaps)")
    minibatch_pairs: int = Field(16, ge=1, description="pairs per optimiser step, at most")


class UpdateConfig(MicroBatching):
    objective: Literal["ppo", "step_dpo"] = Field(
        "ppo", description="ppo: PPO-clip on every turn with the credit method's advantages; step_dpo: a DPO loss "
        "on pairs of turns of one state, ranked by the credit method's step values (update.step_dpo)")
    step_dpo: StepDpoSettings = StepDpoSettings()
    lr: float = Field(2e-4, gt=0.0)
    epochs: int = Field(2, ge=1, description="passes over the iteration's turns")
    minibatch_size: int = Field(64, ge=1, description="turns per optimiser step, at most: an iteration's n turns "
                                "are cut into ceil(n / minibatch_size) minibatches of near-equal size")
    skip_zero_advantage: bool = Field(
        False, description="leave the turns whose advantage is exactly 0 out of the update (DAPO's filtered groups: a "
        "task group whose episodes all scored alike, under a method without a step term there). They move the policy "
        "only through update.kl_coef's penalty, yet each costs a forward and a backward pass; the token mean and the "
        "minibatches are then over the other turns, and an iteration without any trains nothing")
    clip_ratio: float = Field(0.2, gt=0.0, lt=1.0)
    dual_clip: float = Field(3.0, gt=1.0, description="dual-clip bound c for negative advantages")
    kl_coef: float = Field(0.0, ge=0.0, description="low_var_kl to the iteration-0 policy; 0 turns it off")
    entropy_coef: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    old_logprobs: Literal["auto", "recompute", "engine"] = Field(
        "recompute", description="recompute: the log-probs of the checkpoint that sampled the turns are recomputed "
        "by the trainer (log pi_old, or one step off-policy the behaviour policy's), as verl does; engine: the "
        "rollout engine's own log-probs of the sampled tokens stand in for them, one forward pass over the turns "
        "fewer, sound only where the engine computes what the trainer does (fp32; docs/models.md, Precision); auto: "
        "engine where the run samples and trains in float32 (policy.dtype and update.dtype), recompute otherwise")
    dtype: Literal["policy", "float32", "bfloat16", "float16"] = Field(
        "policy", description="the dtype the update's forward and backward passes (and its recomputed log-probs) run "
        "in: policy follows policy.dtype (as the run resolved it); float32 trains in full precision a policy that "
        "rollout and evaluation sample in bf16 (docs/models.md, Precision). Master weights and the optimiser state "
        "are fp32 either way")
    behaviour_weight_cap: float = Field(5.0, gt=1.0, description="loop.off_policy_lag 1: the importance weight "
                                        "pi_prox / pi_behav of a token is truncated at this value (unused at lag 0)")
    engine_correction: Literal["none", "tis"] = Field(
        "none", description="none: the turns count as sampled by the checkpoint that sampled them; tis: by the "
        "rollout engine as it computed (its own log-probs, e.g. vLLM in bf16), each token's loss weighted by "
        "min(pi_old / pi_engine, update.engine_weight_cap), truncated importance sampling (verl's rollout_is, token "
        "level, truncate). One step off-policy the engine is pi_behav (capped at update.behaviour_weight_cap). Needs "
        "log pi_old recomputed: update.old_logprobs recompute or auto (docs/credit-assignment.md, Policy update)")
    engine_weight_cap: float = Field(2.0, gt=1.0, description="update.engine_correction tis, lag 0: the weight "
                                     "pi_old / pi_engine of a token is truncated at this value (verl's default 2)")

    def trains_in(self, policy_dtype: str) -> str:
        """The dtype the update computes in under a policy of `policy_dtype`: `dtype`, or that one for `policy`."""
        return policy_dtype if self.dtype == "policy" else self.dtype


class EvaluateConfig(Section):
    tasks: int = Field(128, ge=1, lt=GROUPS_PER_ITERATION, description="held-out tasks")
    episodes_per_task: int = Field(2, ge=1, le=64, description="sampled episodes per held-out task (more: less "
                                   "noise in the success rate)")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy decoding")
    shards: int = Field(1, ge=1, le=256, description="Snakemake jobs per evaluation, each playing a slice of whole "
                        "batches of rollout.batch_size episodes; a merge job writes the episode table")
    every: int = Field(1, ge=1, le=1000, description="evaluate the checkpoints of iteration 0, of every k-th "
                       "iteration after it and of the last (verl's test_freq): the curve has those points, and the "
                       "iterations between cost no held-out episodes")


class TrackingConfig(Section):
    enabled: bool = True
    tracking_uri: str | None = Field(None, description="null: sqlite database mlflow.db at the repository root")
    experiment: str = "creditrl"


class ReportConfig(Section):
    credit_oracle: bool = Field(True, description="score the run's own advantages against the environment's oracle "
                                "(ROC-AUC, docs/credit-assignment.md: Oracle credit) in results/report/metrics.json; "
                                "the report then replays every training episode (slow where the oracle plans, as "
                                "ALFWorld's does); environments without an oracle skip it")


class StageResources(Section):
    """What one stage's cluster jobs ask for; a key left out keeps the registry's default
    (pipeline/workflow/registry.py)."""
    threads: int | None = Field(None, ge=1, description="cores (SLURM: --cpus-per-task)")
    mem_mb: int | None = Field(None, ge=1, description="memory in MB (SLURM: --mem)")
    runtime: int | None = Field(None, ge=1, description="wall time in minutes (SLURM: -t)")
    gpu: int | None = Field(None, ge=0, description="GPUs (SLURM: --gpus); default 1 for a stage that loads a model "
                            "when runtime.device is a GPU (update: runtime.update_processes), else 0")


class ResourcesConfig(Section):
    """`runtime.resources`: one optional entry per stage of the registry (a test keeps the two lists equal)."""
    init: StageResources | None = None
    reward_init: StageResources | None = None
    rollout: StageResources | None = None
    group: StageResources | None = None
    fit: StageResources | None = None
    advantages: StageResources | None = None
    pairs: StageResources | None = None
    update: StageResources | None = None
    evaluate: StageResources | None = None
    report: StageResources | None = None


class RuntimeConfig(Section):
    torch_threads: int = Field(0, ge=0, description="threads of torch, BLAS and polars in every stage, however it is "
                               "started; 0: the job's declared threads (runtime.resources), at most the machine's "
                               "cores, under Snakemake and DVC alike; all cores for a stage started by hand")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="where the models run: auto (cuda when torch sees a GPU, else cpu), cpu, cuda "
                        "or cuda:N. Sampling draws differ between a CPU and a GPU, so runs to be compared should "
                        "use the same device")
    keep_optimizer: Literal["last", "all"] = Field(
        "last", description="which iterations keep their optimiser state (results/iter_i/optimizer/): last, the "
        "newest two while the run goes on (the one the next update resumes from, and the one before, so that a stage "
        "killed before it exits reruns), the newest alone once the report has run; all, every one, so that any "
        "iteration can be rerun alone")
    resources: ResourcesConfig = Field(
        ResourcesConfig(), description="per stage (init, rollout, update, ...; a sharded stage's shards take its "
        "entry): threads, mem_mb, runtime, gpu, what each job declares to Snakemake and so to a cluster executor")
    fork_server: bool = Field(False, description="Snakemake runs every stage as a fork of one process that "
                              "imported torch and transformers once per workflow run (pipeline/workflow/forkserver.py)"
                              ": each job skips those imports, most of a job on the tiny configurations (docs/"
                              "workflow.md, Stage processes and the fork server); the benchmark files' memory columns "
                              "then measure the launcher, not the stage")
    allocator: Literal[ALLOCATORS] = Field(
        "auto", description="the memory allocator of every stage process (pipeline/config/allocator.py): auto, "
        "tcmalloc where its library is installed (scripts/install-vllm installs it), else the C library's malloc; "
        "tcmalloc, the same but refused where it is not installed; system, the C library's. tcmalloc keeps freed "
        "memory for the next tensor: the SmolLM2 update 1.13x faster on a 2-core CPU, the same floats")
    update_processes: int = Field(1, ge=1, le=64, description="processes of the update stage (torchrun, one per GPU "
                                  "on a GPU): each takes a share of every minibatch and gradients are all-reduced")
    update_sharding: Literal["replicate", "fsdp"] = Field(
        "replicate", description="with update_processes > 1: every process holds the whole model (replicate, as "
        "DDP), or a 1/N shard of its weights, gradients and AdamW moments (fsdp: FSDP2, for models whose full "
        "fine-tuning does not fit one GPU)")


class FaultsConfig(Section):
    """What the rollout and evaluate stages tolerate (README, Failures and resuming)."""
    max_env_error_share: float = Field(
        0.05, ge=0.0, le=1.0,
        description="share of episodes whose environment raised that the stage accepts before it fails")


class BaseRun(Section):
    """A finished run whose outputs this run reuses, linked on disk instead of copied or recomputed."""
    params: str = Field(description="the base run's params file; its outputs are in its run.dir, under the "
                        "folder holding the Snakefile at or above that file (docs/workflow.md, Where a run's outputs "
                        "are)")
    through: int = Field(1, ge=0, le=MAX_ITERATION, description="reuse the base's jobs of iterations 0..through "
                         "whose params this run shares (e.g. 1: the initial policy and iteration 1's rollout and "
                         "groups when only credit changes)")


class RunConfig(Section):
    dir: str = Field("results", min_length=1, description="the folder every output of this run goes under (runs "
                     "with different dirs coexist); a relative one is under the run's workflow folder, the one "
                     "holding the Snakefile (docs/workflow.md, Where a run's outputs are)")
    base: BaseRun | None = Field(None, description="a run to reuse outputs of (null: none)")

    @model_validator(mode="after")
    def _plain_dir(self):
        if Path(self.dir).name in ("", ".", "..") or "{" in self.dir:
            raise ValueError(f"dir {self.dir!r} must name a folder (not '.', '..' or a template)")
        return self


class Params(Section):
    seed: int = Field(0, ge=0, lt=2**31)
    run: RunConfig = RunConfig()
    loop: LoopConfig = LoopConfig()
    env: EnvConfig = Field(default_factory=lambda: ENV_REGISTRY[DEFAULT_ENV].config(),
                           description="the environment: its name and its own keys")
    prompt: PromptConfig = PromptConfig()
    policy: PolicyConfig = PolicyConfig()
    warmstart: WarmstartConfig = WarmstartConfig()
    rollout: RolloutConfig = RolloutConfig()
    credit: CreditConfig = CreditConfig()
    update: UpdateConfig = UpdateConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    report: ReportConfig = ReportConfig()
    tracking: TrackingConfig = TrackingConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    faults: FaultsConfig = FaultsConfig()

    @model_validator(mode="after")
    def _group_methods_need_groups(self):
        if self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size is {self.rollout.group_size}, but credit.method {self.credit.method!r} "
                "normalises within task groups and needs at least 2 episodes per task"
            )
        return self

    @model_validator(mode="after")
    def _fsdp_without_fp16(self):
        if self.runtime.update_sharding == "fsdp" and self.runtime.update_processes > 1 \
                and self.update.trains_in(self.policy.dtype) == "float16":
            raise ValueError("runtime.update_sharding: fsdp does not scale fp16 losses across shards; use "
                             "policy.dtype (or update.dtype) bfloat16 or float32")
        return self

    @model_validator(mode="after")
    def _engine_correction_needs_recompute(self):
        if self.update.engine_correction == "tis" and self.update.old_logprobs == "engine":
            raise ValueError("update.engine_correction tis weighs each token by pi_old / pi_engine, but "
                             "update.old_logprobs engine makes the engine's log-probs log pi_old (every weight 1); "
                             "set update.old_logprobs: recompute")
        return self

    @model_validator(mode="after")
    def _step_dpo_fits(self):
        if self.update.objective != "step_dpo":
            return self
        if self.runtime.update_processes > 1:
            raise ValueError("update.objective step_dpo runs in one process; set runtime.update_processes: 1")
        if self.loop.off_policy_lag:
            raise ValueError("update.objective step_dpo learns from preferences, not importance-weighted turns; set "
                             "loop.off_policy_lag: 0")
        return self

    @model_validator(mode="after")
    def _shards_fit(self):
        r, e = self.rollout, self.evaluate
        shard_slices(r.tasks_per_iteration * r.group_size, r.batch_size, r.shards, r.group_size, "rollout.shards")
        shard_slices(e.tasks * e.episodes_per_task, r.batch_size, e.shards, e.episodes_per_task, "evaluate.shards")
        return self


def _format_loc(loc: tuple) -> str:
    return ".".join(str(x) for x in loc) if loc else "(top level)"


def _moved(loc: tuple) -> str:
    """A hint for the episode-level keys that moved from the methods' sections to `credit.episode`."""
    if len(loc) == 3 and loc[0] == "credit" and loc[1] in METHOD_NAMES and (
            loc[2] in ("episode_mode", "episode_stats", "mode")):
        key = "mode" if loc[2] in ("mode", "episode_mode") else "episode_stats"
        return f"; the episode level is shared by every method now: set credit.episode.{key}"
    return ""


def load_params(path: str | Path = "params.yaml", overrides: list[str] = (), where: str = "--set") -> Params:
    """The params file at `path`, with dotted `KEY=VALUE` `overrides` (a bench's `--set`) applied before it is
    validated, so that an override can mend what the file alone would be refused for (a model path that exists
    only on this machine)."""
    path = Path(path)
    raw, origin = read_params(path)      # `extends:` resolved (pipeline.config.files)
    own = str(path)
    if overrides:
        raw = apply_overrides(raw, list(overrides), where)
        origin.update({item.partition("=")[0]: own for item in overrides})   # the message names the overrides
        path = f"{path} with its {where} overrides"
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = _format_loc(err["loc"])
            source = origin_of(origin, loc)
            # where a base file (`extends`) or an override set the key, say which
            set_in = f" (set in {source})" if source is not None and source != own else ""
            if err["type"] == "union_tag_invalid":
                problems.append(f"key '{loc}.name'{set_in}: unknown {loc} {err['ctx']['tag']!r}; expected one of "
                                f"{err['ctx']['expected_tags']}")
            elif err["type"] == "extra_forbidden":
                problems.append(f"key '{loc}'{set_in}: unknown key (not in the schema; check its spelling and "
                                "section)" + _moved(err["loc"]))
            else:
                got = err.get("input")
                got_s = "" if isinstance(got, dict) else f", got {got!r}"
                problems.append(f"key '{loc}'{set_in}: {err['msg'].removeprefix('Value error, ')}{got_s}")
        raise ParamsError(f"{path}: invalid parameters:\n  " + "\n  ".join(problems)) from None


def missing_dependencies(params: Params) -> list[str]:
    """What the params need that this environment cannot import or its data cannot give, one line per key:
    tcmalloc for `runtime.allocator: tcmalloc`, vLLM for `rollout.engine: vllm`, the environment's engine for
    `env.name`, held-out tasks for `evaluate.tasks`. Found with `importlib.util.find_spec` (tcmalloc: its library's
    file), so nothing heavy is imported."""
    problems = []
    if params.runtime.allocator == "tcmalloc" and tcmalloc_library() is None:
        problems.append("key 'runtime.allocator': tcmalloc, but its library (libtcmalloc_minimal.so.4) is not "
                        "installed: run scripts/install-vllm (Debian, Ubuntu: apt-get install "
                        "libtcmalloc-minimal4), or set runtime.allocator: auto")
    if params.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        problems.append("key 'rollout.engine': vllm, but vLLM is not installed: run scripts/install-vllm "
                        "(docs/models.md, Rollout engines), or set rollout.engine: hf")
    spec = ENV_REGISTRY[params.env.name]
    method = METHODS[params.credit.method]
    for capability in spec.lacking(method.requires):
        problems.append(f"key 'credit.method': {method.name} reads {CAPABILITIES[capability]}, which the "
                        f"{spec.name} environment does not give (no {capability}()): choose another "
                        "credit.method or an environment that has it (docs/environments.md)")
    absent = spec.missing()
    if absent:
        problems.append(f"key 'env.name': {spec.needs(absent)}: install the project as the README says "
                        "(README, The two commands)")
    else:
        if spec.lacks is not None:
            problems += [f"key '{key}': {why}" for key, why in missing_capabilities(params, spec)]
        if spec.held_out is not None and params.evaluate.tasks > (n := spec.held_out(params.env)):
            problems.append(f"key 'evaluate.tasks': {params.evaluate.tasks} held-out tasks, but env {spec.name}'s "
                            f"data holds {n}: the evaluation would play some twice, as different tasks; set "
                            f"evaluate.tasks at most {n} (evaluate.episodes_per_task samples a task more often)")
    return problems


def missing_capabilities(params: Params, spec) -> list[tuple[str, str]]:
    """(key, why) for each part of the params that needs an environment capability which the environment's data
    will not give it (`EnvSpec.lacks`): the warm start's expert, retrieved demonstrations, the oracle margin."""
    w = params.warmstart
    needs = []
    if w.steps_for(params.policy) > 0 and w.episodes > 0 and w.random_action_share < 1:
        what = (f"the warm start ({w.steps_for(params.policy)} steps, random_action_share {w.random_action_share} "
                "< 1) labels its demonstrations with the environment's expert")
        fix = ("set warmstart.steps: 0 (a pretrained policy.path needs none) or warmstart.random_action_share: 1 "
               "(random demonstrations only)")
        needs.append(("warmstart", "expert_actions", what, fix))
    if params.prompt.demonstrations > 0:
        needs.append(("prompt.demonstrations", "expert_actions", "retrieved demonstrations are expert episodes",
                      "set prompt.demonstrations: 0"))
    if params.update.objective == "step_dpo" and params.update.step_dpo.margin == "oracle":
        needs.append(("update.step_dpo.margin", "oracle_distance", "the oracle margin reads the oracle's distances",
                      "set update.step_dpo.margin: value"))
    out = []
    for key, capability, what, fix in needs:
        why = spec.lacks(params.env, capability)
        if why is not None:
            out.append((key, f"{what}, but {why}: {fix}"))
    return out


def check_dependencies(params: Params, path: str | Path) -> None:
    """A `ParamsError` naming the file and each key whose dependency is missing (`missing_dependencies`): called
    where work is planned or started (the Snakefile, every stage, `bench.learning`), before anything runs."""
    problems = missing_dependencies(params)
    if problems:
        raise ParamsError(f"{path}: " + "; ".join(problems))


def apply_overrides(data: dict, sets: list[str], where: str = "--set") -> dict:
    """A copy of the params mapping `data` with dotted `KEY=VALUE` overrides (values parsed as YAML); sections
    the mapping lacks are created (the schema validates the result)."""
    data = yaml.safe_load(yaml.safe_dump(data)) or {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ParamsError(f"{where} {item!r}: expected KEY=VALUE, e.g. update.lr=2e-4")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ParamsError(f"{where} {item!r}: '{part}' of key '{key}' is a value, not a section")
        node[leaf] = yaml.safe_load(value)
    return data


def with_overrides(params: Params, sets: list[str], where: str = "--set") -> Params:
    """`params` with dotted `KEY=VALUE` overrides (values parsed as YAML), validated like a params file."""
    data = apply_overrides(params.model_dump(), sets, where)
    try:
        return Params.model_validate(data)
    except ValidationError as e:
        raise ParamsError(f"{where}: invalid overrides: " + "; ".join(
            f"key '{_format_loc(err['loc'])}': {err['msg']}" for err in e.errors())) from None


def flat_keys(tree: dict) -> dict:
    """Flat `section.key -> value` mapping of a nested params mapping (an empty section has no keys)."""
    out: dict = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = obj

    walk("", tree)
    return out


def params_dict(params: Params) -> dict:
    """Flat `section.key -> value` mapping, for logging to MLflow."""
    return flat_keys(params.model_dump())


def resolved_yaml(path: str | Path) -> str:
    """The params of `path` with its `extends` chain merged, as a self-contained params file (validated first)."""
    load_params(path)
    raw, _ = read_params(path)
    head = f"# {path}, resolved: " + " <- ".join(reversed(chain_of(path))) + "\n"
    return head + yaml.safe_dump(raw, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pipeline.config.params",
                                 description="Check a params file, or print it with its `extends` chain merged.")
    ap.add_argument("file", nargs="?", default="params.yaml")
    ap.add_argument("--resolve", action="store_true", help="print the merged params (what the run records in "
                    "params.resolved.yaml)")
    a = ap.parse_args(argv)
    try:
        text = resolved_yaml(a.file)
    except ParamsError as e:
        print(f"error: {e}")
        return 1
    print(text if a.resolve else f"{a.file}: valid", end="" if a.resolve else "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

# The RL loop. Rules are built from the one stage registry (pipeline/workflow/registry.py), which also generates
# dvc.yaml.
#   snakemake --cores all                          # the whole loop on params.yaml
#   snakemake --cores all --config params=my.yaml  # another params file
import sys

from pipeline.config.params import ParamsError, check_dependencies, load_params
from pipeline.data.paths import strip_dir
from pipeline.workflow import forkserver
from pipeline.workflow.dvcgen import record_run
from pipeline.workflow.registry import (code_inputs, deps_for, enabled_stages, final_targets, job_file,
                                        params_fingerprint, processes_for, resources_for)
from pipeline.workflow.runs import record_params, share_base

PARAMS_FILE = config.get("params", "params.yaml")
try:
    P = load_params(PARAMS_FILE)
    check_dependencies(P, PARAMS_FILE)   # vLLM, the environment's engine: refused at plan time, not in a job
    share_base(P)   # run.base: link the base run's reusable outputs before Snakemake looks for them
    record_params(PARAMS_FILE, P.run.dir)   # the merged params (`extends:` resolved) beside the run's outputs
except (ParamsError, FileNotFoundError, ValueError) as e:
    sys.exit(f"error: {e}")
PY = sys.executable


onstart:
    forkserver.start(P.runtime.fork_server, P.runtime.allocator)   # torch imported once, every stage a fork


onsuccess:
    forkserver.stop()
    record_run(PARAMS_FILE)   # dvc.lock describes what Snakemake made (README, DVC)


onerror:
    forkserver.stop()

wildcard_constraints:
    it=r"\d+",

# The default profile's `--resources gpu=1` lets one model-loading job at a time hold a machine's GPU. On a cluster
# (profiles/slurm, profiles/kubernetes) each job gets GPUs of its own, so the limit is per job there, not global.
resource_scopes:
    gpu="local",


rule all:
    input:
        final_targets(P),
    default_target: True


def _outputs(stage):
    return [directory(strip_dir(o)) if o.endswith("/") else o for o in stage.outs_for(P)]


# Directives that Snakemake evaluates at job time (shell, input functions) must not read the loop variable:
# each binds its stage through a default argument or a params value.
for _st in enabled_stages(P):  # e.g. the fit stages only for OPRL and SPA; a sharded stage as shards and a merge
    _res = resources_for(_st, P)
    rule:
        name: _st.name
        input:
            data=(lambda wc, st=_st: deps_for(st, P, int(wc.it))) if _st.per_iteration else deps_for(_st, P, None),
            code=code_inputs(_st),
        output: _outputs(_st)
        params:
            fingerprint=params_fingerprint(_st, P),
            cmd=lambda wc, st=_st: st.command(PY, PARAMS_FILE, wc.get("it"), wc.get("shard"), processes_for(st, P)),
        log: job_file(_st, P, "logs")
        benchmark: job_file(_st, P, "benchmarks")
        threads: _res["threads"]
        # gpu only where > 0: the Kubernetes executor refuses a gpu resource without a manufacturer, even 0
        resources: mem_mb=_res["mem_mb"], runtime=_res["runtime"], **({"gpu": _res["gpu"]} if _res["gpu"] else {})
        wildcard_constraints: it=r"[1-9]\d*" if (_st.first or 0) >= 1 else r"\d+", shard=r"\d+"
        shell: "CREDITRL_THREADS={threads} {params.cmd} > {log} 2>&1"

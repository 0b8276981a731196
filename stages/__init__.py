"""One entry point per stage: `python -m stages.<name> --params P [--iteration I]` (the registry's commands).

Started that way, this package sets the stage's memory allocator from `runtime.allocator` (executing the command
again with it preloaded, `pipeline.config.allocator`) and its thread count from `runtime.torch_threads`
(`pipeline.workflow.threads`) before the stage module imports torch, numpy or polars; with a fork server
(`runtime.fork_server`) it hands the command to the server instead (`pipeline.workflow.launcher`). Importing a
stage module as a library changes nothing.
"""

import os
import sys

if sys.argv and sys.argv[0] == "-m":   # `python -m stages.X`: runpy is still locating the module
    if os.environ.get("CREDITRL_FORK_SERVER"):  # runtime.fork_server: a fork of the server runs it, if one answers
        from pipeline.workflow.launcher import delegate, launched_stage

        if (launched := launched_stage()) is not None:
            delegate(*launched)
    from pipeline.config.allocator import preload
    from pipeline.workflow.threads import configure, runtime_section

    runtime = runtime_section()
    preload(runtime)             # where it executes the stage again, nothing below runs in this process
    configure(runtime=runtime)

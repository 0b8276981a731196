"""One entry point per stage: `python -m stages.<name> --params P [--iteration I]` (the registry's commands).

Started that way, this package sets the stage's thread count from `runtime.torch_threads` before the stage module
imports torch, numpy or polars (`pipeline.workflow.threads`). Importing a stage module as a library changes nothing.
"""

import sys

if sys.argv and sys.argv[0] == "-m":   # `python -m stages.X`: runpy is still locating the module
    from pipeline.workflow.threads import configure

    configure()

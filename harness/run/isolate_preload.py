"""What the fork server of isolated runs (kvchaos.harness.run.isolate) imports once, before it
forks any worker: the runner and the reports, loaded and warmed (templates compiled, the commit
read), so that each worker starts with them instead of paying for them per run."""

from __future__ import annotations

import matplotlib.backends.backend_agg  # noqa: F401  a failing run's figure
import matplotlib.figure  # noqa: F401

from kvchaos.harness.report import index  # noqa: F401  publish points latest with it
from kvchaos.harness.report.render import TEMPLATES, template_env
from kvchaos.harness.run import isolate  # noqa: F401  the worker's own code
from kvchaos.harness.run.runner import git_commit

git_commit()
for _template in TEMPLATES.glob("*.j2"):
    template_env().get_template(_template.name)

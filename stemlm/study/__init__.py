"""The STEM study: matched-budget comparison, stability, context extension and mid-training insertion.

A spec (``studies/*.yaml``) expands into runs (``spec.plan``) that the trainer executes through its
library API (``runner.Study``); each run writes one result JSON, the optional eval stage calls
``stemlm eval`` (``evalstage``), and ``report.write_report`` draws tables and plots from the JSON
alone. See docs/study.md.
"""

from .measures import loss_roi
from .pipeline import ALL_STAGES, default_dirs, parse_stages, run_study
from .report import write_report
from .runner import Study
from .spec import RunSpec, load_spec, plan

__all__ = ["ALL_STAGES", "RunSpec", "Study", "default_dirs", "load_spec", "loss_roi", "parse_stages", "plan",
           "run_study", "write_report"]

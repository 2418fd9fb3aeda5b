"""The STEM study: lr sweep, best-vs-best comparison, stability, context extension, probes and their
controls, mid-training insertion; each of the paper's claims judged by one rule.

A spec (``studies/*.yaml``) expands into runs (``spec.plan``, ``stages``) that the trainer executes
through its library API (``runner.Study``); each run writes one result JSON, the optional eval stage
evaluates checkpoints (``evalstage``), ``claims`` holds the paper's numbers (``paper``) against the
measurements by the rule of ``stats``, and ``report.write_report`` draws tables and plots from the
JSON alone. See docs/study.md.
"""

from .measures import loss_roi
from .pipeline import ALL_STAGES, default_dirs, parse_stages, run_study
from .report import write_report
from .runner import Study
from .spec import RunSpec, load_spec, plan

__all__ = ["ALL_STAGES", "RunSpec", "Study", "default_dirs", "load_spec", "loss_roi", "parse_stages", "plan",
           "run_study", "write_report"]

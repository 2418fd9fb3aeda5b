"""``RunSpec``: one planned run of a study (the leaf every planning module imports), and ``slug``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STUDY_VERSION = 2


@dataclass
class RunSpec:
    """One training run of a study: what to train, from what, and what to measure afterwards."""

    name: str
    stage: str
    overrides: list[str]                          # train config overrides (run.out/data.dir/init_from added at run time)
    labels: dict[str, Any]                        # size, variant, seed, lr, ... (for the report)
    parent: str | None = None                     # run whose newest checkpoint starts this one (run.init_from)
    convert: dict | None = None                   # midtrain: convert_from_hf arguments for run.init_from
    teacher: dict | None = None                   # midtrain: convert_from_hf arguments of run.distill's teacher
    data: dict = field(default_factory=dict)      # {"dir": path}, {"tokenizer_of_init": True}, {"control": kind}
    measures: dict = field(default_factory=dict)  # position_loss, geometry, probes: {knowledge: {...}, needle: {...}}
    eval_tasks: list[str] = field(default_factory=list)
    eval_init: bool = False                       # also evaluate the model the run starts from (step 0)
    pending: str | None = None                    # why the run cannot be planned yet (it waits for the sweep)
    spec_hash: str = ""

    def hash_input(self, parent_hash: str | None) -> dict:
        return {"version": STUDY_VERSION, "stage": self.stage, "overrides": sorted(self.overrides),
                "parent": parent_hash, "convert": self.convert, "data": self.data, "measures": self.measures,
                **({"teacher": self.teacher} if self.teacher else {})}


def slug(text: str) -> str:
    """A file-name-safe form of a label (``stem-1/3`` -> ``stem-1_3``)."""
    return str(text).replace("/", "_").replace(",", "+").replace("=", "")

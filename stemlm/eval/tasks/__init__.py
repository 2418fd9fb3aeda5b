"""The task registry: a name (or a group name) to a ``Task`` that loads its items from pinned files.

Names: the ten multiple-choice tasks of ``olmo.MC_TASKS``, ``mmlu`` and ``mmlu_<subject>``,
``<name>_bpb`` for the bits-per-byte files (``olmo.BPB_FILES``), ``trivia_qa``, ``nq_open``,
``country_facts`` and ``needle``. Groups: ``core`` (the ten multiple-choice tasks), ``bpb``, ``qa``.
Building the registry reads no file; a task reads its data when evaluated.
"""

from __future__ import annotations

from .base import Task
from .country_facts import CountryFacts
from .mmlu import MMLU, SUBJECTS
from .needle import Needle
from .olmo import BPB_FILES, MC_TASKS, OlmoBPB, OlmoMC
from .qa import ClosedBookQA


def _registry() -> dict[str, Task]:
    tasks: list[Task] = [OlmoMC(n) for n in MC_TASKS]
    tasks += [MMLU()] + [MMLU(f"mmlu_{s}", (s,)) for s in SUBJECTS]
    tasks += [OlmoBPB(n, v) for n, v in BPB_FILES.items()]
    tasks += [ClosedBookQA("trivia_qa"), ClosedBookQA("nq_open"), CountryFacts(), Needle()]
    return {t.name: t for t in tasks}


TASKS: dict[str, Task] = _registry()
GROUPS: dict[str, tuple[str, ...]] = {
    "core": MC_TASKS,
    "bpb": tuple(f"{n}_bpb" for n in BPB_FILES),
    "qa": ("trivia_qa", "nq_open"),
}


def resolve_tasks(spec: str) -> list[Task]:
    """Tasks of a comma-separated list of task and group names, in order, each once."""
    names: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if part in GROUPS:
            names.extend(GROUPS[part])
        elif part in TASKS:
            names.append(part)
        else:
            raise ValueError(f"unknown task {part!r}; groups: {', '.join(GROUPS)}; tasks: "
                             f"{', '.join(n for n in TASKS if not n.startswith('mmlu_'))}, mmlu_<subject>")
    if not names:
        raise ValueError("no task given; pass --tasks NAME[,NAME...] (e.g. --tasks core)")
    return [TASKS[n] for n in dict.fromkeys(names)]


__all__ = ["GROUPS", "TASKS", "Task", "resolve_tasks"]

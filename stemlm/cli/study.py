"""Run the STEM study (lr sweep per variant, matched-budget comparison at the tuned lrs, stability,
context extension, the probes' positive controls, mid-training insertion, optional evaluation) and
write its report, which holds each of the paper's claims against the measurements; or regenerate
the report from result JSON.

A study is a spec in studies/*.yaml. Finished runs (result JSON with the same spec hash) are
skipped and a stopped run continues from its newest checkpoint, so `stemlm study run` resumes.
The comparison runs wait for the sweep to pick each variant's lr.

examples:
  stemlm study run --quick                       # the whole pipeline at tiny sizes (<= 10 min on 2 cores)
  stemlm study run --spec full                   # the full study (~3 h on 2 quiet cores, see docs/study.md)
  stemlm study run --spec full --stages sweep,compare
  stemlm study run --spec gpu                    # the second scale: d384 on one epoch of the wide corpus, one GPU
  stemlm study run --spec gpu --quick            # the same spec at a tiny size on the CPU
  stemlm study plan --spec full                  # the runs, their hashes, done or not, and the time estimate
  stemlm study report results/study/full         # report.md + PNGs from the JSON alone
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Sub-commands ``run``, ``plan`` and ``report``."""
    sub = parser.add_subparsers(dest="action", required=True)
    for name, text in (("run", "train (or resume) the selected stages, evaluate, write the report"),
                       ("plan", "list the runs of a spec and whether each is finished")):
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--spec", default=None, help="study spec: a YAML file, or a name in studies/ (quick, full, gpu); "
                                                    "default: full")
        p.add_argument("--quick", action="store_true",
                       help="alone: the 'quick' spec (same as --spec quick); with --spec: that spec's own quick section "
                            "(the same study at a tiny size, e.g. --spec gpu --quick on the CPU)")
        p.add_argument("--results", default=None, help="results dir (default: results/study/<spec name>)")
        p.add_argument("--scratch", default=None, help="run dirs and checkpoints (default: runs/study/<spec name>)")
        if name == "run":
            p.add_argument("--stages", default=None,
                           help="comma-separated subset of sweep,compare,context,controls,midtrain,timing,eval "
                                "(default: all; stability is part of sweep; timing measures each comparison variant's "
                                "step time side by side)")
            p.add_argument("--skip-eval", action="store_true", help="skip the eval stage (`stemlm eval` on each checkpoint)")
            p.add_argument("--no-report", action="store_true", help="do not write the report at the end")
            p.add_argument("--allow-dirty", action="store_true",
                           help="train even when the checkout has uncommitted changes (refused by default: a run's "
                                "recorded git commit must reproduce it; such runs record git_dirty: true; "
                                "STEMLM_ALLOW_DIRTY=1 does the same)")
            p.add_argument("--jobs", type=int, default=1,
                           help="train in this many processes at once, cores // JOBS threads each (default 1; "
                                "separately started `study run` processes on the same dirs also share the work)")
    p = sub.add_parser("report", help="write report.md and PNGs from a results dir",
                       description="write report.md and PNGs from a results dir (reads its JSON only)")
    p.add_argument("results_dir", help="results dir of a study (holds runs/*.json)")
    p.add_argument("--out", default=None, help="where report.md and the PNGs go (default: the results dir)")


def run(args) -> int:
    from ..study import Study, default_dirs, load_spec, parse_stages, run_study, write_report
    from ..study.spec import STAGES

    if args.action == "report":
        print(f"wrote {write_report(args.results_dir, args.out)}")
        return 0
    spec = load_spec(args.spec, quick=True) if args.quick and args.spec else load_spec(
        "quick" if args.quick else args.spec or "full")
    results, scratch = default_dirs(spec)
    results, scratch = args.results or results, args.scratch or scratch
    if args.action == "plan":
        from ..study.timing import estimate

        study = Study(spec, results, scratch)
        for r in study.runs:
            done = study.result(r)
            state = done["status"] if done else f"pending: {r.pending}" if r.pending else "to do"
            print(f"{r.name:<52} {r.spec_hash or '-':<16}  {state}")
        if study.tuned:
            print("tuned lrs: " + ", ".join(f"{v} {b['lr']:g}" + (f" ({b['edge']} edge)" if b["edge"] else "")
                                            for v, b in study.tuned.items()))
        est = estimate(study)
        if est["stages"]:
            total = sum(est["stages"].values())
            print("estimate (step times of timing.json): " + ", ".join(f"{k} {v / 60:.0f} min" for k, v in est["stages"].items())
                  + f"; total {total / 60:.0f} min" + (f" ({len(est['untimed'])} runs not timed)" if est["untimed"] else ""))
        return 0

    def log(msg: str) -> None:  # one write a line: workers share stderr, and print writes the newline apart
        sys.stderr.write(f"stemlm study: {msg}\n")
        sys.stderr.flush()

    stages, t0 = parse_stages(args.stages), time.perf_counter()
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs > 1 and (train := [s for s in stages if s in STAGES]):
        from ..study.workers import run_workers

        run_workers(["study", "run", "--spec", args.spec or ("quick" if args.quick else "full"),
                     *(["--quick"] if args.quick and args.spec else []), "--results", str(results),
                     "--scratch", str(scratch), "--stages", ",".join(train), "--no-report",
                     *(["--allow-dirty"] if args.allow_dirty else [])], args.jobs, log)
        stages = tuple(s for s in stages if s not in STAGES)  # timing, eval and the report: here, on every core
    out = run_study(spec, results, scratch, stages, args.skip_eval, not args.no_report, log,
                    True if args.allow_dirty else None)
    c = out["runs"]
    trained = (f"runs trained by {args.jobs} workers (their lines above)" if stages != parse_stages(args.stages) else
               f"{c['trained']} runs trained ({c['diverged']} diverged), {c['skipped']} skipped"
               + (f", {c['pending']} waiting for the sweep" if c.get("pending") else ""))
    print(f"study {spec['name']}: {trained}"
          + (f"; eval {out['eval']}" if out["eval"] else "") + f"; {time.perf_counter() - t0:.0f}s")
    if out["report"]:
        print(f"report: {out['report']}")
    return 0

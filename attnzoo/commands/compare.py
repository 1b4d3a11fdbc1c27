"""attnzoo compare PLAN.yaml | CONFIG.yaml ... [--vary key=value ...] [--seeds 0 1 2] [--set key=value]
[--out-dir DIR] [--parallel N] [--time-budget SECONDS]."""
from __future__ import annotations

import json
import time

from . import UsageError

HELP = ("train several models x seeds, then the comparison table (mean and 95% CI per model, paired "
        "difference, the paper's numbers) and the test curves")


def add_arguments(parser) -> None:
    parser.add_argument("plan", nargs="+", metavar="PLAN_OR_CONFIG",
                        help="a plan (configs/compare/*.yaml) or several training configs")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds per model (default: the plan's, "
                        "or 0 for configs)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field of every run, as in attnzoo train")
    parser.add_argument("--vary", action="append", default=[], metavar="KEY=VALUE",
                        help="with configs: one run of each config per value, named CONFIG-VALUE; repeat it to "
                             "compare variants of one config, e.g. --vary model.attention=softmax --vary "
                             'model.attention="sinkhorn(n_iters=5)" (several keys: every combination)')
    parser.add_argument("--out-dir", default=None, help="folder of the runs, the table and the curves")
    parser.add_argument("--data-dir", default=None, help="folder holding a local copy of the dataset")
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="train only these runs of the plan "
                        "(the table still shows every run found)")
    parser.add_argument("--report-only", action="store_true", help="train nothing: tabulate the runs found")
    parser.add_argument("--parallel", type=int, default=1, metavar="N",
                        help="train N runs at once, each in its own process sharing the device (default 1: one "
                             "after the other in this process); runs start seed by seed")
    parser.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                        help="stop each run after its last epoch that fits in SECONDS from now (checkpoints "
                             "written: run the command again to resume), start no run that cannot finish; the "
                             "table shows what is done")


def run(args) -> int:
    from pathlib import Path

    from ..train import protocol
    try:
        if len(args.plan) == 1 and Path(args.plan[0]).is_file() and protocol.is_plan(args.plan[0]):
            if args.vary:
                raise UsageError(f"--vary applies to configs; {args.plan[0]} is a plan: give its runs their "
                                 "settings with set: [KEY=VALUE, ...]")
            plan = protocol.load_plan(args.plan[0])
        else:
            for p in args.plan:
                if not Path(p).is_file():
                    raise UsageError(f"{p!r} not found: pass one plan (configs/compare/*.yaml) or training configs")
                if protocol.is_plan(p):
                    raise UsageError(f"{p} is a plan: pass it alone")
            keys = lambda items: {item.partition("=")[0].strip() for item in items}  # noqa: E731
            both = keys(args.overrides) & keys(args.vary)
            if both:
                raise UsageError(f"{', '.join(sorted(both))} is given by --set and by --vary: --set would replace "
                                 "every --vary value; drop one")
            plan = protocol.plan_from_configs(args.plan, args.out_dir, args.vary)
        if args.out_dir:
            plan.out_dir = Path(args.out_dir)
        if args.seeds:
            plan.seeds = list(dict.fromkeys(args.seeds))
        extra = list(args.overrides) + ([f"data.data_dir={json.dumps(args.data_dir)}"] if args.data_dir is not None else [])
        for r in plan.runs:
            r.overrides = r.overrides + extra
        if args.parallel < 1:
            raise UsageError(f"--parallel must be >= 1, got {args.parallel}")
        if args.time_budget is not None and not args.time_budget > 0:
            raise UsageError(f"--time-budget must be > 0 seconds, got {args.time_budget}")
        deadline = None if args.time_budget is None else time.time() + args.time_budget
        names = [r.name for r in plan.runs]
        if args.only:
            unknown = sorted(set(args.only) - set(names))
            if unknown:
                raise UsageError(f"--only names {unknown}, but the plan's runs are {names}")
        for _, _, cfg in protocol.configs(plan):  # every config checked before any training
            protocol.status(cfg)                    # and every existing run folder
        if args.only and not args.report_only:
            keep = plan.runs
            plan.runs = [r for r in keep if r.name in args.only]
            protocol.run_plan(plan, parallel=args.parallel, deadline=deadline)
            plan.runs = keep
        result = protocol.run_plan(plan, report_only=args.report_only or bool(args.only), parallel=args.parallel,
                                   deadline=deadline)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    print(result["text"])
    print(f"table: {plan.out_dir / 'table.md'} (and table.json); curves: {plan.out_dir / 'test_curves.png'}")
    return 0

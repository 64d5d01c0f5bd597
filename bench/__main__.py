"""`python -m bench [NAME ...] [--skip NAME ...]`: run the benchmarks side by side on this machine and
rewrite BENCHMARKS.md (a section per benchmark) and the PNGs under bench/plots/.

Results of each benchmark are also kept in bench/results/NAME.json, so running one benchmark alone
updates its section and keeps the others' last results.
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

from bench.common import code_version
from bench.document import MODULES, RESULTS, ROOT, write_markdown


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    # `[]` among the choices lets no NAME through (argparse checks the empty default against them); the
    # metavar keeps it out of --help, which lists the names once
    parser.add_argument(
        "names",
        nargs="*",
        choices=[*MODULES, []],
        metavar="NAME",
        help=f"benchmarks to run (default: all): {', '.join(MODULES)}",
    )
    parser.add_argument("--skip", action="append", default=[], choices=list(MODULES), metavar="NAME")
    parser.add_argument(
        "--quick", action="store_true", help="learning: a few steps, plumbing only (results are not written)"
    )
    parser.add_argument("--out", type=Path, default=None, help="learning: keep its run dirs here")
    parser.add_argument(
        "--jobs", type=int, default=2, help="learning: runs at a time (one torch thread each)"
    )
    parser.add_argument(
        "--analyse-only",
        action="store_true",
        help="learning: report the finished runs under --out, train nothing",
    )
    args = parser.parse_args()
    if args.quick:
        if args.names != ["learning"]:
            parser.error("--quick applies to `python -m bench learning --quick` only")
        from bench.bench_learning import run as run_learning

        result = run_learning(quick=True, out_dir=args.out)
        print("\n".join(result["reading"]))
        return
    names = [n for n in (args.names or MODULES) if n not in args.skip]
    RESULTS.mkdir(parents=True, exist_ok=True)
    measured = []
    for name in names:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        code = code_version(ROOT)
        module = importlib.import_module(MODULES[name])
        if name == "learning" and args.analyse_only:
            if args.out is None:
                parser.error("--analyse-only needs --out DIR (the run dirs of an earlier check)")
            result = module.report_only(args.out, workers=args.jobs)
        elif name == "learning":
            result = module.run(out_dir=args.out, workers=args.jobs)
        else:
            result = module.run()
        if result is None:  # nothing measured here (gpu without CUDA): keep the last results
            continue
        result_meta = {"ran_at": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.perf_counter() - started}
        if not args.analyse_only:  # the code that measured it (re-reading old runs measures nothing)
            now = code_version(ROOT)
            result_meta["code"] = code if now == code else f"{code}, then {now} (changed during the run)"
        (RESULTS / f"{name}.json").write_text(json.dumps({"meta": result_meta, "result": result}, indent=2))
        print(f"   done in {result_meta['seconds']:.0f} s", flush=True)
        measured.append(name)
    if measured:
        write_markdown()


if __name__ == "__main__":
    main()

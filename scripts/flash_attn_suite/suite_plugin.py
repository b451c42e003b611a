"""pytest plugin for running flash-attn's test file against flash_attn_cuda (run.sh loads it).

* --suite-sample N keeps about N of the collected cases, spread evenly over the
  test functions (a function with fewer cases than its share keeps them all
  and leaves the rest to the others). The choice depends only on the node ids
  and --suite-seed, so every pytest-xdist worker keeps the same cases.
* --suite-out DIR receives, at the end of the run (also of an interrupted
  one): summary.md (a table of collected / selected / passed / failed / error /
  skipped / not run cases per test function), summary.json (the same, plus
  every failing case's node id and first message line) and failures.txt.
* Without a GPU, torch.cuda.get_device_capability answers a made-up
  capability (FLASH_ATTN_SUITE_FAKE_CAPABILITY, default 9.0), because the test
  file asks for one at import: collection and counting then work on any
  machine, while the tests themselves fail there.
* A test that calls flash-attn's compiled module directly is skipped (NOT_APPLICABLE).
* On a flash_attn_cuda build with a reduced kernel set, a case the build
  refuses because it left that head dim or dtype out is reported as skipped,
  as tests/conftest.py does for this project's own tests.
"""

import json
import os
import random
from collections import Counter, defaultdict

import pytest

# test function -> why it cannot apply to flash_attn_cuda.
NOT_APPLICABLE = {
    "test_flash_attn_generator_arg_must_be_none": (
        "calls flash-attn's compiled module flash_attn_gpu (its raw C++ entry points) "
        "directly; flash_attn_cuda has no such module"
    ),
}

# As tests/reduced_build.py: build_info of a reduced build ends with the first, the
# refusal of a left-out head dim or dtype contains the second.
REDUCED_KERNEL_SET_MARK = "reduced kernel set"
LEFT_OUT_MESSAGE = "which this build left out"

# The config of this process: pytest_runtest_logreport is not handed one.
_CONFIG = {}

OUTCOMES = ("passed", "failed", "error", "crashed", "skipped", "xfailed", "xpassed")
COUNTS_FILE = "collected.json"


def pytest_addoption(parser):
    group = parser.getgroup("flash_attn_suite")
    group.addoption(
        "--suite-sample",
        type=int,
        default=0,
        help="keep about this many cases in all, spread over the test functions (0: all)",
    )
    group.addoption("--suite-seed", type=int, default=0, help="which sample --suite-sample takes")
    group.addoption(
        "--suite-out", default=None, help="folder for summary.md, summary.json, failures.txt"
    )


def _function_of(nodeid):
    """'test_flash_attn.py::test_x[a-b]' -> 'test_x'."""
    return nodeid.split("::")[-1].split("[")[0]


def _is_worker(config):
    return hasattr(config, "workerinput")


def _quotas(counts, total):
    """Water-filling: each function gets an equal share of `total`, capped at its count."""
    quotas = {}
    remaining = dict(counts)
    budget = total
    while remaining:
        share = budget // len(remaining)
        small = {f: c for f, c in remaining.items() if c <= share}
        if not small:
            # Everyone left has more than the share: hand out the share, and the
            # remainder one case each to the functions with the most cases.
            extra = budget - share * len(remaining)
            for i, f in enumerate(sorted(remaining, key=lambda f: (-remaining[f], f))):
                quotas[f] = share + (1 if i < extra else 0)
            break
        for f, c in small.items():
            quotas[f] = c
            budget -= c
            del remaining[f]
    return quotas


def pytest_configure(config):
    _CONFIG["config"] = config
    config._suite_results = {}  # nodeid -> outcome
    config._suite_messages = {}  # nodeid -> first line of the failure, or the skip reason
    config._suite_counts = None
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        fake = os.environ.get("FLASH_ATTN_SUITE_FAKE_CAPABILITY", "9.0")
        major, minor = (int(x) for x in fake.split("."))
        torch.cuda.get_device_capability = lambda device=None: (major, minor)
        config._suite_fake_capability = (major, minor)


def pytest_report_header(config):
    lines = []
    fake = getattr(config, "_suite_fake_capability", None)
    if fake is not None:
        lines.append(
            f"flash_attn_suite: no CUDA GPU; torch.cuda.get_device_capability answers {fake} "
            "so that the test file imports (its tests will fail here)"
        )
    try:
        import flash_attn
        import flash_attn_cuda

        lines.append(
            f"flash_attn_suite: flash_attn -> {os.path.dirname(flash_attn.__file__)} "
            f"(shim over flash_attn_cuda {flash_attn_cuda.__version__}: {flash_attn_cuda.build_info})"
        )
    except ImportError as exc:
        lines.append(f"flash_attn_suite: cannot import the shim or flash_attn_cuda: {exc}")
    sample = config.getoption("--suite-sample")
    if sample:
        lines.append(
            f"flash_attn_suite: sample of about {sample} cases, seed {config.getoption('--suite-seed')}"
        )
    return lines


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected theirs
def pytest_collection_modifyitems(session, config, items):
    by_function = defaultdict(list)
    for item in items:
        by_function[_function_of(item.nodeid)].append(item)
    collected = {f: len(v) for f, v in by_function.items()}

    sample = config.getoption("--suite-sample")
    if sample and sample < len(items):
        seed = config.getoption("--suite-seed")
        quotas = _quotas(collected, sample)
        keep = set()
        for function, function_items in by_function.items():
            ids = sorted(item.nodeid for item in function_items)
            keep.update(random.Random(f"{seed}:{function}").sample(ids, quotas[function]))
        deselected = [item for item in items if item.nodeid not in keep]
        items[:] = [item for item in items if item.nodeid in keep]
        config.hook.pytest_deselected(items=deselected)

    for item in items:
        reason = NOT_APPLICABLE.get(_function_of(item.nodeid))
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))

    selected = Counter(_function_of(item.nodeid) for item in items)
    config._suite_counts = {"collected": collected, "selected": dict(selected)}
    out = config.getoption("--suite-out")
    if out:
        # Under pytest-xdist only the workers collect: they leave the counts
        # (the same in every worker) for the controller's summary.
        os.makedirs(out, exist_ok=True)
        tmp = os.path.join(out, f"{COUNTS_FILE}.{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(config._suite_counts, f)
        os.replace(tmp, os.path.join(out, COUNTS_FILE))


def _left_out_reason(excinfo):
    try:
        import flash_attn_cuda
    except ImportError:
        return None
    if not isinstance(excinfo.value, RuntimeError) or REDUCED_KERNEL_SET_MARK not in (
        flash_attn_cuda.build_info or ""
    ):
        return None
    return next(
        (line.strip() for line in str(excinfo.value).splitlines() if LEFT_OUT_MESSAGE in line), None
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when != "call" or call.excinfo is None:
        return
    reason = _left_out_reason(call.excinfo)
    if reason is None:
        return
    report = outcome.get_result()
    report.outcome = "skipped"
    report.longrepr = (str(item.path), (item.location[1] or 0) + 1, f"Skipped: {reason}")


def _skip_reason(report):
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return _first_line(report)


def _first_line(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return crash.message.strip().splitlines()[0] if crash.message.strip() else ""
    text = getattr(report, "longreprtext", "") or ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None or _is_worker(config):
        return
    results, messages = config._suite_results, config._suite_messages
    nodeid = report.nodeid
    if hasattr(report, "wasxfail"):
        if report.when == "call" or report.skipped:
            results[nodeid] = "xfailed" if report.skipped else "xpassed"
        return
    if report.when == "setup":
        if report.failed:
            results[nodeid], messages[nodeid] = "error", _first_line(report)
        elif report.skipped:
            results[nodeid], messages[nodeid] = "skipped", _skip_reason(report)
    elif report.when == "call":
        results[nodeid] = report.outcome
        if report.failed:
            messages[nodeid] = _first_line(report)
        elif report.skipped:
            messages[nodeid] = _skip_reason(report)
    elif report.when == "teardown":
        if report.failed and results.get(nodeid) == "passed":
            results[nodeid], messages[nodeid] = "error", _first_line(report)
    elif report.failed:
        # pytest-xdist's report for a case whose worker process died (when "???").
        results[nodeid], messages[nodeid] = "crashed", _first_line(report)


def _summary(config):
    counts = config._suite_counts
    out = config.getoption("--suite-out")
    if counts is None and out and os.path.exists(os.path.join(out, COUNTS_FILE)):
        with open(os.path.join(out, COUNTS_FILE)) as f:
            counts = json.load(f)
    counts = counts or {"collected": {}, "selected": {}}
    per_function = defaultdict(Counter)
    for nodeid, outcome in config._suite_results.items():
        per_function[_function_of(nodeid)][outcome] += 1
    functions = list(counts["collected"]) + sorted(set(per_function) - set(counts["collected"]))
    rows = []
    for function in functions:
        tally = per_function[function]
        selected = counts["selected"].get(function, sum(tally.values()))
        row = {
            "function": function,
            "collected": counts["collected"].get(function, 0),
            "selected": selected,
        }
        row.update({o: tally.get(o, 0) for o in OUTCOMES})
        row["not_run"] = max(0, selected - sum(tally.values()))
        rows.append(row)
    failures = {
        nodeid: config._suite_messages.get(nodeid, "")
        for nodeid, outcome in sorted(config._suite_results.items())
        if outcome in ("failed", "error", "crashed", "xpassed")
    }
    skip_reasons = defaultdict(Counter)
    for nodeid, outcome in config._suite_results.items():
        if outcome == "skipped":
            skip_reasons[_function_of(nodeid)][config._suite_messages.get(nodeid, "")] += 1
    return rows, failures, skip_reasons


def _table(rows):
    columns = ["function", "collected", "selected", *OUTCOMES, "not_run"]
    columns = [
        c
        for c in columns
        if c in ("function", "collected", "selected", "passed", "failed")
        or any(row[c] for row in rows)
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    total = {c: sum(row[c] for row in rows) for c in columns if c != "function"}
    for row in rows + [dict(total, function="**total**")]:
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    out = config.getoption("--suite-out")
    if _is_worker(config) or not out:
        return
    rows, failures, skip_reasons = _summary(config)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(
            f"# flash-attn test suite against flash_attn_cuda\n\npytest exit status: {int(exitstatus)}\n"
        )
        not_run = sum(row["not_run"] for row in rows)
        if not_run:
            f.write(f"\nThe run was cut short: {not_run} selected cases did not run (not_run).\n")
        f.write("\n" + _table(rows) + "\n")
        if skip_reasons:
            f.write("\n## Skip reasons\n\n")
            for function, reasons in skip_reasons.items():
                for reason, n in reasons.most_common():
                    f.write(f"- {function}: {n} x {reason}\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(
            {
                "exit_status": int(exitstatus),
                "functions": rows,
                "failures": failures,
                "skip_reasons": {f: dict(r) for f, r in skip_reasons.items()},
            },
            f,
            indent=1,
        )
    with open(os.path.join(out, "failures.txt"), "w") as f:
        for nodeid, message in failures.items():
            f.write(f"{nodeid}\n    {message}\n")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _is_worker(config) or not config._suite_results:
        return
    rows, _, _ = _summary(config)
    terminalreporter.write_sep("=", "flash_attn_suite: cases per test function")
    terminalreporter.write_line(_table(rows))

"""One source for every number: README's figures and the simulator's defaults come from benchmarks/results.

- README's generated blocks (`<!-- measured:NAME -->` ... `<!-- /measured:NAME -->`) must equal what
  benchmarks/run.py renders from the stored results now (a stale block fails);
- every other figure README quotes (a decimal, a number with thousands separators, a ratio like
  2.4x or x1.14, a percentage, a range or count with a unit of time, size or rate: 1.13 s, 18-90 s,
  99 MiB, 6.5M) outside fenced code blocks must equal some number of benchmarks/results/*.json at the
  precision it is quoted with, unless it is a version (torch 2.13, 2.13.0) or in ALLOWED below.
  A figure quoted to whole units (14x, 611 s, 60,000) is too coarse for that: almost any integer
  is some result rounded, so outside the generated blocks it must be in ALLOWED;
- airay/measured.json (airay.simulate's defaults) is what benchmarks/run.py derives from the results.

Nothing here runs a benchmark or starts Ray: it calls benchmarks/run.py's pure rendering functions.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from benchmarks.run import (MEASURED, README_BLOCKS, RESULTS, fill_readme, load_results, measured_defaults,
                            readme_blocks)

ROOT = Path(__file__).resolve().parents[1]

# Figures README may quote that are not measurements, each with the reason. Keep it short; a
# measured figure belongs in a generated block.
ALLOWED = {
    "1e-4": "rtol of the elastic tests' loss comparison (tests/test_elastic.py), a tolerance",
    "0.01": "tolerance of the simulator against Daly's closed form, asserted in tests/test_simulate.py",
    "64 MiB": "chunk size of peer copies through the object store, a constant of airay/checkpoint",
    "1 MiB": "the gap below which durable ranged reads are coalesced (airay/checkpoint/ranges.py COALESCE_GAP), "
             "a constant",
    "30 s": "how long the stores' memory figures sent with a commit serve the next save (checkpoint/manager.py "
            "FIGURES_MAX_AGE_S), a constant",
    "75 MB": "object store size of tests/test_data_scale.py's cluster, a test setting",
    "500 MB": "dataset size of tests/test_data_scale.py, a test setting",
    "10%": "the data_stall event's threshold, a setting",
    "600 s": "default of timeouts.capacity_wait_s, a setting",
    "80%": "the memory tier's share of /dev/shm's room at most, a constant (airay/checkpoint/budget.py SHM_SHARE)",
    "3 MB": "the memory-tier budget of a run in tests/test_checkpoint_tiers.py, a test setting",
    "2.11": "torch version of the GPU run ('torch 2.13 (the suite, CPU) and 2.11 (CUDA ...)')",
}
VERSION_BEFORE = re.compile(r"(?:Python|torch|Ray|ray|DeepSpeed|deepspeed|PEP)\s*$")
UNITS = r"GB/s|MB/s|samples/s|tokens/s|GiB|MiB|MB|GB|ms|min|s|h|x|%"
FIGURE = re.compile(
    r"(?<![\w.\-/=:])"                       # not part of an identifier, a version, a path or key=value
    r"(?P<x>x)?"                               # x1.14
    r"(?P<num>\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?(?:e-?\d+)?)"
    r"(?:[-–](?P<num2>\d+(?:\.\d+)?))?"       # a range: 18-90 s
    r"(?P<scale>[kMB](?![\w]))?"               # 6.5M parameters, 1.04B
    r"(?!\.\d)(?![\w.]*\d)"                     # not the start of a version (2.13.0) or an address
    rf"(?:\s?(?P<unit>{UNITS})(?![\w/]))?")
SCALE = {"k": 1e3, "M": 1e6, "B": 1e9}
UNIT_SCALES = {"%": (1 / 100,), "MiB": (2**20, 1), "GiB": (2**30, 1), "ms": (1, 1e-3), "h": (1, 3600), "min": (1, 60)}
BLOCK = re.compile(r"<!-- measured:([\w-]+) -->\n.*?<!-- /measured:\1 -->\n?", re.S)
FENCE = re.compile(r"^```.*?^```[^\n]*\n?", re.S | re.M)


def results_numbers(results: dict) -> list[float]:
    """Every number stored in the results (bools left out)."""
    found: list[float] = []

    def walk(value) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            found.append(float(value))
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(results)
    return found


def prose(text: str) -> str:
    """README without its generated blocks (checked against rendering instead) and fenced code/config blocks."""
    return FENCE.sub("", BLOCK.sub("", text))


def figures(text: str) -> list[dict]:
    """Every figure quoted in `text`: {"text", "values": [(value, quantum)], "scales": [...]}."""
    out = []
    for m in FIGURE.finditer(text):
        num, num2, unit, scale = m["num"], m["num2"], m["unit"], m["scale"]
        is_figure = (m["x"] or unit or scale or "," in num or "." in num or "e" in num
                     or (num2 is not None and "." in num2))
        if not is_figure or VERSION_BEFORE.search(text[:m.start()]):
            continue
        values = []
        for n in (num, num2):
            if n is None:
                continue
            n = n.replace(",", "")
            mantissa, _, exp = n.partition("e")
            decimals = len(mantissa.partition(".")[2])
            values.append((float(n), 10.0 ** ((int(exp) if exp else 0) - decimals)))
        scales = [SCALE[scale]] if scale else list(UNIT_SCALES.get(unit or "", (1,)))
        out.append({"text": m.group(0).strip(), "values": values, "scales": scales})
    return out


def in_results(figure: dict, numbers: list[float]) -> bool:
    """Each of the figure's numbers equals a results number (in the figure's unit) rounded as quoted."""
    def found(value: float, quantum: float) -> bool:
        return any(math.isclose(round(n / s / quantum) * quantum, value, rel_tol=1e-9, abs_tol=quantum * 1e-6)
                   for n in numbers for s in figure["scales"])

    return all(found(v, q) for v, q in figure["values"])


def coarse(figure: dict) -> bool:
    """Quoted to whole units: matching it against the results would prove nothing."""
    return all(q >= 1 for _, q in figure["values"])


def unsourced(text: str, numbers: list[float]) -> list[str]:
    """The figures of `text` (README prose) that are neither allowed nor in the results."""
    return [f["text"] for f in figures(text)
            if f["text"] not in ALLOWED and (coarse(f) or not in_results(f, numbers))]


@pytest.fixture(scope="module")
def results() -> dict:
    return load_results()


@pytest.fixture(scope="module")
def readme() -> str:
    return (ROOT / "README.md").read_text()


def test_generated_blocks_are_what_the_results_render(readme, results):
    names = BLOCK.findall(readme)
    assert sorted(names) == sorted(README_BLOCKS), "every renderer has one block in README, every block a renderer"
    assert len(set(names)) == len(names)
    blocks = readme_blocks(results)
    if fill_readme(readme, blocks) != readme:
        stale = [n for n in names if f"<!-- measured:{n} -->\n{blocks[n]}\n<!-- /measured:{n} -->" not in readme]
        pytest.fail(f"README blocks {stale} are stale: run `python -m benchmarks.run --render`")


def test_every_figure_outside_the_blocks_is_in_the_results(readme, results):
    assert unsourced(prose(readme), results_numbers(results)) == []
    # The allow-list only holds what README still says (no stale exemptions).
    text = prose(readme)
    assert [a for a in ALLOWED if a not in [f["text"] for f in figures(text)]] == []


def test_an_invented_figure_is_rejected(results):
    numbers = results_numbers(results)
    rec = results["recovery"]["result"]["median"]["recovery_s"]
    assert unsourced(f"Warm recovery takes {rec:.2f} s ({rec:.4f} s).", numbers) == []
    # Invented, or stale at the precision quoted: rejected.
    assert unsourced(f"Warm recovery takes {rec + 0.0003:.4f} s.", numbers) == [f"{rec + 0.0003:.4f} s"]
    assert unsourced("airay is 7.3456x faster, at 3.14159 GB/s, over 123,457 samples.", numbers) == \
        ["7.3456x", "3.14159 GB/s", "123,457"]
    assert unsourced("Recovery took 18.777-90.333 s.", numbers) == ["18.777-90.333 s"]
    # Whole-unit figures prove nothing by matching: outside a generated block they are rejected.
    assert unsourced("Warm recovery is 14x faster; the run took 611 s; 60,000 rows.", numbers) == \
        ["14x", "611 s", "60,000"]
    # Versions, settings in code and plain counts are not figures.
    assert figures("torch 2.13.0, Python 3.10+, Ray 2.60, `--set max_steps=40`, 4 workers, ZeRO-2") == []
    # A stale generated block is caught too.
    readme = "x\n<!-- measured:recovery -->\nrecovery 0.74 s\n<!-- /measured:recovery -->\ny\n"
    assert fill_readme(readme, readme_blocks(results)) != readme


def test_figure_extraction():
    got = {f["text"]: f for f in figures("x1.14, 0.913, 1.13 s, 18-90 s, 2.5x, 60,000 rows, 6.5M params, "
                                         "0.01% of it, 99 MiB, 1.1e-05 relative")}
    assert list(got) == ["x1.14", "0.913", "1.13 s", "18-90 s", "2.5x", "60,000", "6.5M", "0.01%", "99 MiB",
                         "1.1e-05"]
    assert in_results(got["6.5M"], [6457856.0]) and not in_results(got["6.5M"], [6557856.0])
    assert in_results(got["0.01%"], [7.9e-05]) and in_results(got["99 MiB"], [103379276.0])
    assert in_results(got["18-90 s"], [18.4, 89.6]) and not in_results(got["18-90 s"], [18.4])


def test_measured_json_is_what_the_results_give(results):
    from airay import simulate

    assert json.loads(MEASURED.read_text()) == measured_defaults(results)
    assert simulate.MEASURED_WARM_RECOVERY_S == measured_defaults(results)["warm_recovery_s"]
    assert simulate.MEASURED_COLD_RESTART_S == measured_defaults(results)["cold_restart_s"]
    assert simulate.Costs().warm_recovery_s == simulate.MEASURED_WARM_RECOVERY_S
    assert (RESULTS / "recovery.json").exists()


def test_demo_section_keeps_the_command_and_its_output(tmp_path, monkeypatch):
    """`python -m benchmarks.run --only demo` stores what README's demo block renders (no run here)."""
    import benchmarks.run as bench

    def fake_run(cmd):
        assert cmd[1:5] == ["-m", "airay.cli", "run", "jobs/demo.yaml"] and cmd[5] == "--run-dir"
        Path(cmd[6], "result.json").parent.mkdir(parents=True)
        Path(cmd[6], "result.json").write_text(json.dumps({"goodput": 0.61}))
        return "".join(f"[airay] step {s}/130 | loss 5.0000 | world 4\n" for s in (5, 10, 15)) + \
            "[airay] step 15: chaos: kill_worker (rank 1)\n[airay] step 11/130 | loss 5.0000 | world 3\n" \
            "[airay] finished at step 130: goodput 0.61\n"

    monkeypatch.setattr(bench, "_run", fake_run)
    monkeypatch.setattr(bench, "machine", lambda: "m; versions")
    section = bench.run_section("demo", False, tmp_path)
    assert section["command"] == f"airay run jobs/demo.yaml --run-dir {tmp_path / 'demo'}"
    assert section["result"]["run_result"] == {"goodput": 0.61}
    text = "\n".join(bench.readme_demo({"demo": section}))
    assert ("```\n[airay] step 5/130 | loss 5.0000 | world 4\n...\n[airay] step 15/130 | loss 5.0000 | world 4\n"
            "[airay] step 15: chaos: kill_worker (rank 1)\n[airay] step 11/130 | loss 5.0000 | world 3\n"
            "[airay] finished at step 130: goodput 0.61\n```") in text
    assert f"`{section['command']}` (run on {section['date']}, m)" in text

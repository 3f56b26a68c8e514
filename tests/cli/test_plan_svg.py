"""`memstrata plan --svg FILE`: the plan drawn, read back as the XML it is. Each stratum's bar holds one segment
per category placed on it, each as wide as its bytes against the stratum's capacity; a stratum asked for more than
it has shows where its capacity ends."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from memstrata.plan.svg import BAR_W

SVG = "{http://www.w3.org/2000/svg}"


def _segments(svg: Path) -> dict[tuple[str, str], tuple[int, float]]:
    root = ET.parse(svg).getroot()
    return {(r.get("data-stratum"), r.get("data-category")): (int(r.get("data-bytes")), float(r.get("width")))
            for r in root.iter(f"{SVG}rect") if r.get("class") == "segment"}


def _texts(svg: Path) -> list[str]:
    return ["".join(t.itertext()) for t in ET.parse(svg).getroot().iter(f"{SVG}text")]


def test_the_svg_draws_every_placed_byte_against_its_strata_capacity(cli, tmp_path: Path) -> None:
    svg = tmp_path / "plan.svg"
    out = cli("plan", "examples/finetune.yaml", "--node", "examples/node-cxl.yaml", "--svg", str(svg), "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)  # the JSON still goes to stdout
    segments = _segments(svg)
    placed = {(a["stratum"], c["category"]): a["bytes"] for c in plan["categories"] for a in c["placement"]
              if a["bytes"]}
    assert {k: v[0] for k, v in segments.items()} == placed
    capacity = {s["stratum"]: s["capacity"] for s in plan["strata"]}
    for (stratum, _), (n, width) in segments.items():
        assert width == pytest.approx(max(BAR_W * n / capacity[stratum], 1.0), abs=0.01)
    texts = _texts(svg)
    assert "verdict: fits" in texts and "Adam moments (exp_avg, exp_avg_sq): 59.8 GiB" in texts
    assert "107.7 GiB of 460.8 GiB (23%)" in texts  # DRAM: the table's total against the node's capacity
    assert not any(r.get("class") == "capacity" for r in ET.parse(svg).getroot().iter(f"{SVG}line"))


def test_a_plan_that_does_not_fit_is_drawn_with_the_overflow_marked(cli, repo, tmp_path: Path) -> None:
    node = yaml.safe_load((repo / "examples" / "node-cxl.yaml").read_text())
    node["gpus"][0]["hbmBytes"] = "16Gi"  # less than the 32K-token working set needs
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump(node))
    svg = tmp_path / "plan.svg"
    out = cli("plan", "examples/finetune.yaml", "--node", str(small), "--svg", str(svg))
    assert out.returncode == 2 and "verdict: does not fit" in out.stdout
    texts = _texts(svg)
    assert "verdict: does not fit" in texts
    over = [t for t in texts if "asked of" in t and "over by" in t]
    assert over, texts
    lines = [ln for ln in ET.parse(svg).getroot().iter(f"{SVG}line") if ln.get("class") == "capacity"]
    assert len(lines) == len(over)


def test_svg_into_a_missing_directory_is_refused_naming_the_flag(cli, tmp_path: Path) -> None:
    out = cli("plan", "examples/finetune.yaml", "--node", "examples/node-cxl.yaml", "--svg",
              str(tmp_path / "no" / "plan.svg"))
    assert out.returncode == 2
    assert f"--svg {tmp_path / 'no' / 'plan.svg'}: cannot write it: No such file or directory" in out.stderr
    out = cli("plan", "examples/finetune.yaml", "--node", "examples/node-cxl.yaml", "--svg", str(tmp_path))
    assert out.returncode == 2 and f"--svg {tmp_path}: is a directory" in out.stderr


def test_the_readmes_picture_is_what_the_command_draws_today(cli, repo, tmp_path: Path) -> None:
    """examples/finetune-plan.svg, shown in the README, is regenerated whenever the planner changes its numbers:
    `memstrata plan examples/finetune.yaml --node examples/node-cxl.yaml --svg examples/finetune-plan.svg`."""
    svg = tmp_path / "now.svg"
    assert cli("plan", "examples/finetune.yaml", "--node", "examples/node-cxl.yaml", "--svg", str(svg)).returncode == 0
    assert svg.read_text() == (repo / "examples" / "finetune-plan.svg").read_text()

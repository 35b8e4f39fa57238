"""The alert rules and the dashboard in deploy/: valid for Prometheus, tested, and in step with
the metrics the code exports and with docs/operations.md.

`promtool` (Debian's `prometheus` package) checks the rule file and runs its unit tests
(deploy/prometheus/alerts_test.yml: each alert fires on the series that should raise it, and
stays quiet on those that should not). CI installs it; elsewhere these tests skip without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from web import metrics as web_metrics
from workers.runtime import metrics as fleet_metrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "prompt-broker.json"
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()

PROMTOOL = shutil.which("promtool")
REQUIRED = bool(os.environ.get("CI") or os.environ.get("PB_REQUIRE_REAL_REDIS"))
#: What a sample of each metric type may be called, after its family's name.
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum")}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if PROMTOOL is None:
        if REQUIRED:
            pytest.fail("promtool is not installed (apt-get install prometheus): CI must run this")
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return subprocess.run(
        [PROMTOOL, *args], check=False, capture_output=True, text=True, timeout=60
    )


def rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    panels = orjson.loads(DASHBOARD.read_bytes())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


def exported() -> set[str]:
    """Every series name the fleet's processes and the HTTP server can export."""
    names: set[str] = set()
    for registry in (fleet_metrics.REGISTRY, web_metrics.REGISTRY):
        for family in registry.collect():
            names.add(family.name)
            names.update(family.name + s for s in SUFFIXES.get(family.type, ()))
    return names


def named_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bprompt_broker_\w+", expr))


def test_promtool_checks_the_rules() -> None:
    run = promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"SUCCESS: {len(rules())} rules found" in run.stdout


def test_the_alerts_fire_when_they_should_and_only_then() -> None:
    run = promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert tested == {rule["alert"] for rule in rules()}  # every alert has its cases


def test_the_dashboard_queries_parse(tmp_path: Path) -> None:
    """Each panel's query, as a recording rule, passes promtool's PromQL parser."""
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    recorded = [{"record": f"prompt_broker:panel_{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp_path / "panels.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": recorded}]}))
    run = promtool("check", "rules", str(path))
    assert run.returncode == 0, run.stdout + run.stderr


def test_alerts_and_panels_use_only_metrics_that_exist() -> None:
    known = exported()
    used = set().union(*(named_metrics(r["expr"]) for r in rules()))
    used |= set().union(*(named_metrics(e) for e in dashboard_exprs()))
    assert "prompt_broker_oldest_unheld_prompt_age_seconds" in used
    unknown = sorted(used - known)
    assert not unknown, f"no process exports {unknown}"


def test_every_metric_is_on_the_dashboard() -> None:
    """Each metric family the code defines is drawn by some panel (or alerted on)."""
    used = set().union(*(named_metrics(e) for e in dashboard_exprs()))
    used |= set().union(*(named_metrics(r["expr"]) for r in rules()))
    families = {
        family.name
        for registry in (fleet_metrics.REGISTRY, web_metrics.REGISTRY)
        for family in registry.collect()
    }
    drawn = {f for f in families if any(u == f or u.startswith(f + "_") for u in used)}
    assert families - drawn == set(), f"on no panel: {sorted(families - drawn)}"


def test_operations_explains_every_alert() -> None:
    for rule in rules():
        assert f"`{rule['alert']}`" in OPERATIONS, f"{rule['alert']} not in docs/operations.md"

"""The production image, compose file and Kubernetes manifests, checked without a Docker engine.

What can be checked here: the files parse; every process they start is a real command with
arguments our CLI accepts; probes and healthchecks ask paths the processes serve; selectors
match; one image serves every service; and the agent CLIs install exactly as the Dockerfile's
own RUN lines say (run here, in a scratch folder). What cannot: that `docker build` succeeds on
the base images, and the image's runtime (the non-root user, the HEALTHCHECK) in a container.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.cli import COMMANDS
from workers.runtime.cli import RUNTIME

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
MANIFESTS = [
    doc
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
    for doc in yaml.safe_load_all(path.read_text())
    if doc
]
#: What each process serves for probes (workers/runtime/health.py; web/app.py).
OPS_PATHS = {"/livez", "/readyz", "/metrics"}
WEB_PATHS = {"/healthz", "/readyz"}


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    found = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def parses(argv: list[str]) -> None:
    """`argv` (after `prompt-broker`) is a command our CLI accepts, arguments and all."""
    assert argv and argv[0] in {**COMMANDS, **RUNTIME}, argv
    import argparse

    from broker.cli import global_args

    parser = argparse.ArgumentParser(prog="prompt-broker")
    global_args(parser)
    sub = parser.add_subparsers(dest="command")
    commands = {**COMMANDS, **RUNTIME}
    command = commands[argv[0]]
    command.arguments(sub.add_parser(argv[0]))
    parser.parse_args(argv)  # SystemExit on anything it does not take


def test_dockerfile_runs_as_non_root_with_healthcheck_and_agents() -> None:
    found = instructions()
    words = [w for w, _ in found]
    assert words.count("FROM") == 2, "a build stage for the agent CLIs, then the image"
    user = [rest for w, rest in found if w == "USER"]
    assert user and user[-1] not in ("root", "0")
    pip = [rest for w, rest in found if w == "RUN" and "pip install" in rest]
    assert pip and '".[claude]"' in pip[0], "the claude extra is installed"
    health = next(rest for w, rest in found if w == "HEALTHCHECK")
    cmd = yaml.safe_load(health.split("CMD", 1)[1])
    assert cmd[0] == "prompt-broker"
    parses(cmd[1:])
    entry = yaml.safe_load(next(rest for w, rest in found if w == "ENTRYPOINT"))
    assert entry == ["prompt-broker"]
    parses(yaml.safe_load(next(rest for w, rest in found if w == "CMD")))
    assert "PROMPT_BROKER_OPS_PORT=9464" in next(rest for w, rest in found if w == "ENV")


def test_compose_one_image_every_service_healthchecked() -> None:
    services: dict[str, Any] = COMPOSE["services"]
    ours = {name: s for name, s in services.items() if name != "redis"}
    assert {"replica", "audit", "web", "cli"} <= set(ours)
    assert len({s["image"] for s in ours.values()}) == 1, "one image for every service"
    assert [name for name, s in ours.items() if "build" in s] == ["replica"], "built once"
    for name, service in ours.items():
        parses(service.get("command", ["worker"]))
        check = service.get("healthcheck", {})
        if name == "cli":
            assert check.get("disable") is True
            continue
        test = check["test"]
        assert test[:2] == ["CMD", "prompt-broker"], name
        parses(test[2:])
        assert test[3] == {"replica": "worker"}.get(name, name if name != "web" else "serve")


def test_k8s_manifests_reference_real_commands_and_probes() -> None:
    kinds = [(d["kind"], d["metadata"]["name"]) for d in MANIFESTS]
    deployments = {d["metadata"]["name"]: d for d in MANIFESTS if d["kind"] == "Deployment"}
    assert set(deployments) == {
        "prompt-broker-replica",
        "prompt-broker-audit",
        "prompt-broker-web",
    }, kinds
    config = next(d for d in MANIFESTS if d["kind"] == "ConfigMap")
    images = set()
    for name, d in deployments.items():
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert d["spec"]["selector"]["matchLabels"].items() <= (
            d["spec"]["template"]["metadata"]["labels"].items()
        )
        [container] = spec["containers"]
        images.add(container["image"])
        assert "command" not in container, "the image's entrypoint runs prompt-broker"
        parses(container["args"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        served = WEB_PATHS if container["args"][0] == "serve" else OPS_PATHS
        for probe in ("readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] in served, (name, probe)
            assert get["port"] in ports, (name, probe)
        if container["args"][0] != "serve":
            assert ports["ops"] == int(config["data"]["PROMPT_BROKER_OPS_PORT"])
        for env in container.get("env", []):
            assert env["name"].startswith("PROMPT_BROKER_API_") or "valueFrom" in env
    assert len(images) == 1, "one image"
    for pdb in (d for d in MANIFESTS if d["kind"] == "PodDisruptionBudget"):
        wanted = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(
            wanted <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in deployments.values()
        ), pdb["metadata"]["name"]
    assert any(d["metadata"]["name"] == "prompt-broker-replica" for d in MANIFESTS if
               d["kind"] == "PodDisruptionBudget")  # fmt: skip
    # Every setting the ConfigMap sets is one the processes know.
    from broker import Settings

    known = {"PROMPT_BROKER_" + f.upper() for f in Settings.model_fields}
    for name in config["data"]:
        assert name in known or name.startswith("PROMPT_BROKER_OPS_"), name


@pytest.mark.slow
def test_codex_cli_installs_as_the_dockerfile_says(tmp_path: Path) -> None:
    """The agents stage's RUN line, run as it is on the lock file: the pinned Codex binary."""
    found = instructions()
    stage = found.index(next(i for i in found if i[0] == "FROM" and "AS agents" in i[1]))
    run = next(rest for w, rest in found[stage:] if w == "RUN")
    for name in ("package.json", "package-lock.json"):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    done = subprocess.run(
        ["sh", "-c", run],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=os.environ | {"npm_config_prefer_offline": "true"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    pinned = yaml.safe_load((ROOT / "package.json").read_text())["dependencies"]["@openai/codex"]
    assert pinned in done.stdout, done.stdout
    assert os.access(tmp_path / "out" / "codex", os.X_OK)


@pytest.mark.slow
def test_package_installs_with_the_claude_extra(tmp_path: Path) -> None:
    """The image's pip line in a fresh virtualenv: the CLI runs, the Claude Code CLI is there."""
    found = instructions()
    pip = next(rest for w, rest in found if w == "RUN" and "pip install" in rest)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    args = shlex.split(pip)
    assert args[:2] == ["pip", "install"]
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    health = subprocess.run(
        [str(venv / "bin" / "prompt-broker"), "health", "worker", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert health.returncode == 1 and "cannot connect" in health.stderr, health.stderr
    sdk = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import claude_agent_sdk, pathlib; "
            "p = pathlib.Path(claude_agent_sdk.__file__).parent / '_bundled' / 'claude'; "
            "print(p.is_file())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert sdk.stdout.strip() == "True", sdk.stderr

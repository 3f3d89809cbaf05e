"""Every shell command in README.md and docs/quickstart.md is exercised somewhere.

- `make X`: X is a Makefile target.
- `shoal ...`: parses with the real `shoal` parser (subcommand and flags exist, values valid).
- `curl`: the path is served by the engine (or the router in front of it) and the JSON body
  validates against the API's request schema; a `model` it names is served by an example.
- `helm install|upgrade|template|lint`: run here, offline (`install` as `--dry-run=client`),
  so chart, values and `--set` flags must all be accepted.
- anything else (`kubectl`, `kind`, `docker`, `helm uninstall`) needs a cluster or a daemon:
  it must appear verbatim in a script under e2e/, which runs against a real cluster; files
  it names (`-f`) must exist.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/quickstart.md"]
SHELL_FENCES = {"sh", "bash", "shell", "console"}
OFFLINE_HELM = {"install", "upgrade", "template", "lint"}
NEEDS_A_CLUSTER = {"kubectl", "kind", "docker", "helm"}


@dataclass(frozen=True)
class DocCommand:
    source: str  # file:line
    text: str  # as written, `$VARS` unexpanded (e2e scripts set the same variables)
    env: tuple[tuple[str, str], ...] = ()  # `export NAME=value` lines above it in the doc

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.expanded, comments=True)

    @property
    def expanded(self) -> str:
        values = dict(self.env)
        return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), self.text)

    @property
    def programs(self) -> list[str]:
        """Every program of a pipeline (`sed ... | kubectl apply -f -`)."""
        return [Path(shlex.split(part)[0]).name for part in self.expanded.split(" | ")]

    def __str__(self) -> str:
        return f"{self.source}: {self.text}"


def doc_commands(relative: str) -> list[DocCommand]:
    """Commands from shell-fenced blocks: continuations joined, comments and prompts dropped."""
    commands: list[DocCommand] = []
    fence: str | None = None
    pending, start = "", 0
    env: dict[str, str] = {}
    for number, line in enumerate((ROOT / relative).read_text().splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else (stripped[3:].strip() or "text")
            continue
        if fence not in SHELL_FENCES:
            continue
        if fence == "console":
            if not stripped.startswith("$ "):
                continue  # output
            stripped = stripped[2:]
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = (pending + stripped).strip()
        pending = ""
        if text.startswith("export "):
            name, _, value = text.removeprefix("export ").partition("=")
            env[name.strip()] = shlex.split(value)[0]
        elif text and not text.startswith("#"):
            for part in text.split(" && "):
                commands.append(DocCommand(f"{relative}:{start}", part.strip(),
                                           tuple(env.items())))
    assert fence is None, f"{relative}: unclosed code fence"
    return commands


ALL_COMMANDS = [c for doc in DOCS for c in doc_commands(doc)]


def of_program(*names: str) -> list[DocCommand]:
    """Commands any of whose programs is one of `names`."""
    return [c for c in ALL_COMMANDS if set(c.programs) & set(names)]


def _ids(commands: list[DocCommand]) -> list[str]:
    return [c.source for c in commands]


def test_docs_have_commands_and_every_one_has_a_checker() -> None:
    assert len(ALL_COMMANDS) >= 10
    known = {"make", "shoal", "curl"} | NEEDS_A_CLUSTER
    unknown = [str(c) for c in ALL_COMMANDS
               if c.programs[0] not in known and not set(c.programs) & NEEDS_A_CLUSTER]
    assert unknown == [], "no checker for these documented commands"


def test_readme_starts_with_make_serve_and_make_test() -> None:
    first_two = [c.text.split("#")[0].strip() for c in doc_commands("README.md")[:2]]
    assert first_two == ["make serve", "make test"]


# --- make, shoal ----------------------------------------------------------------------------


@pytest.mark.parametrize("command", of_program("make"), ids=_ids(of_program("make")))
def test_make_targets_exist(command: DocCommand) -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in command.argv[1:]:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), str(command)


@pytest.mark.parametrize("command", of_program("shoal"), ids=_ids(of_program("shoal")))
def test_shoal_commands_parse(command: DocCommand) -> None:
    from shoal.cli import build_parser

    try:
        args = build_parser().parse_args(command.argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{command} does not parse (exit {exc.code})")
    assert callable(args.func)


# --- curl -----------------------------------------------------------------------------------


def _served_paths() -> set[tuple[str, str]]:
    from shoal.runtime.api.app import build_app

    app = build_app(None)  # type: ignore[arg-type]  # routes only; no request is served
    return {(method, route.path) for route in app.routes
            for method in getattr(route, "methods", set()) or set()}


def _example_model_names() -> set[str]:
    from shoal.runtime.model_source import DEFAULT_SERVED_NAME

    names = {DEFAULT_SERVED_NAME}  # what `shoal serve` serves without --model
    for path in (ROOT / "examples").glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                names.add(doc["spec"]["model"].get("servedName"))
    return names


@pytest.mark.parametrize("command", of_program("curl"), ids=_ids(of_program("curl")))
def test_curl_requests_are_valid_against_the_api(command: DocCommand) -> None:
    from shoal.runtime.api import protocol

    argv = command.argv
    url = next(a for a in argv if a.startswith("http"))
    body = next((argv[i + 1] for i, a in enumerate(argv) if a in ("-d", "--data")), None)
    method = "POST" if body is not None else "GET"
    path = urlparse(url).path
    assert (method, path) in _served_paths(), f"{command}: no {method} {path} route"
    if body is None:
        return
    payload = json.loads(body)
    schema = {"/v1/completions": protocol.CompletionRequest,
              "/v1/chat/completions": protocol.ChatCompletionRequest}[path]
    schema.model_validate(payload)  # unknown fields and bad values raise
    if "model" in payload:
        assert payload["model"] in _example_model_names(), f"{command}: unknown model"


def test_router_forwards_the_documented_generation_paths() -> None:
    from shoal.runtime.router.proxy.app import FORWARDED_PATHS

    for command in of_program("curl"):
        path = urlparse(next(a for a in command.argv if a.startswith("http"))).path
        if path.startswith("/v1/") and path != "/v1/models":
            assert path in FORWARDED_PATHS, str(command)


# --- helm (offline) -------------------------------------------------------------------------


OFFLINE_HELM_COMMANDS = [c for c in of_program("helm") if c.argv[1] in OFFLINE_HELM]


@pytest.mark.parametrize("command", OFFLINE_HELM_COMMANDS, ids=_ids(OFFLINE_HELM_COMMANDS))
def test_helm_commands_run_offline(command: DocCommand, helm) -> None:
    args = command.argv[1:]
    if args[0] in ("install", "upgrade"):
        args.append("--dry-run=client")
    result = helm(*args)
    assert result.returncode == 0, f"{command}\n{result.stderr}"


# --- cluster commands: covered by e2e/ --------------------------------------------------------


def _e2e_lines() -> set[str]:
    lines = set()
    for path in sorted((ROOT / "e2e").rglob("*")):
        if path.is_file() and path.suffix in (".sh", ".bash", ".py", ".yaml", ""):
            text = path.read_text(errors="replace").replace("\\\n", " ")
            lines |= {" ".join(line.split()) for line in text.splitlines()}
    return lines


CLUSTER_COMMANDS = [c for c in of_program(*NEEDS_A_CLUSTER) if c not in OFFLINE_HELM_COMMANDS]


@pytest.mark.parametrize("command", CLUSTER_COMMANDS, ids=_ids(CLUSTER_COMMANDS))
def test_cluster_commands_are_run_by_e2e(command: DocCommand) -> None:
    wanted = " ".join(command.text.split())
    assert any(wanted in line for line in _e2e_lines()), (
        f"{command}\nis not run by any script in e2e/ (add it there, verbatim)")


@pytest.mark.parametrize("command", CLUSTER_COMMANDS, ids=_ids(CLUSTER_COMMANDS))
def test_files_named_by_cluster_commands_exist(command: DocCommand) -> None:
    argv = command.argv
    for i, arg in enumerate(argv[:-1]):
        if arg == "-f" and argv[i + 1] != "-":
            assert (ROOT / argv[i + 1]).is_file(), f"{command}: {argv[i + 1]} is missing"
    for file in re.findall(r"\b(examples/[\w./-]+)", command.text):
        assert (ROOT / file).is_file(), f"{command}: {file} is missing"
    if argv[:2] == ["docker", "build"]:
        assert argv[-1] == "." and (ROOT / argv[argv.index("-f") + 1]).is_file()


# --- what the README shows ------------------------------------------------------------------


def test_readme_kubectl_get_output_has_the_crd_columns() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "serving.shoal.dev_inferenceservices.yaml").read_text())
    # priority 0 only: the others appear with -o wide
    columns = ["NAME"] + [c["name"].upper()
                          for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]
                          if not c.get("priority")]
    readme = (ROOT / "README.md").read_text()
    header = next(line for line in readme.splitlines() if line.startswith("NAME "))
    assert header.split() == columns
    row = readme.splitlines()[readme.splitlines().index(header) + 1].split()
    assert len(row) == len(columns)


# --- the e2e scripts themselves -------------------------------------------------------------


E2E_SCRIPTS = sorted((ROOT / "e2e").glob("quickstart_*.sh"))


@pytest.mark.parametrize("script", E2E_SCRIPTS, ids=[p.name for p in E2E_SCRIPTS])
def test_e2e_script_is_valid_bash_and_skips_without_a_cluster(script: Path,
                                                              tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # An empty PATH but for bash itself: no docker, kind, kubectl or helm to find.
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    result = subprocess.run([str(tmp_path / "bin" / "bash"), str(script)], capture_output=True,
                            text=True, timeout=30,
                            env={"PATH": f"{tmp_path / 'bin'}", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("SKIP:"), result.stdout

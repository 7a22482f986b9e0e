"""compose.yaml and the Dockerfile, checked without a Docker engine.

The file is validated by the `compose-spec` package (the compose specification's schema, offline), then
checked for what the schema cannot know: every `depends_on` target exists, Redis persists with AOF, the
published ports and mounts match the flags, and each service's command line is one that `fleet`'s own
parser accepts, as the container would run it (ENTRYPOINT + command).

Also: package indexes are build arguments without a host default, and no project file names a package
registry host or an absolute path of the machine it was written on.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose

from fleet.cli import build_parser, settings_from_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"

# service -> the `fleet` subcommand its container must run
FLEET_SERVICES = {"gateway": "gateway", "worker": "worker", "worker-cpu": "worker", "jobs": "jobs-worker"}
DOTENV = ROOT / ".env"


# ── helpers ──────────────────────────────────────────────────────────────────


_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)(?:(:?[-?])([^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """`${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?message}` and `$$` as Compose resolves them
    (in an environment without the variables by default, as on a fresh host)."""
    env = env or {}

    def value(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3) or ""
        current = env.get(name)
        unset = current is None or (op is not None and op.startswith(":") and current == "")
        if op is not None and op.endswith("?") and unset:
            raise ValueError(f"{name}: {arg}")
        return arg if unset and op is not None and op.endswith("-") else (current or "")

    return _VARIABLE.sub(value, text)


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(interpolate(COMPOSE_FILE.read_text()))
    assert isinstance(data, dict), "compose.yaml is not a mapping"
    return data


def validate_compose_text(text: str) -> None:
    """Raise ValueError when `text` (interpolated, its YAML merge keys resolved, as Compose reads it) is not
    a valid compose file. (The validator reads `<<` as a key, so it gets the resolved file: line numbers in
    its messages are that file's.)"""
    compose = PyCompose.from_yaml(yaml.safe_dump(yaml.safe_load(interpolate(text)), sort_keys=False))
    compose.validate()
    compose.validate_volumes()
    compose.validate_networks()
    compose.to_spec()  # the pydantic model of the full specification


def missing_depends_on(services: dict[str, Any]) -> list[str]:
    """`service -> target` for every depends_on entry naming no service in the file."""
    missing = []
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        targets = list(depends_on) if isinstance(depends_on, (dict, list)) else []
        missing += [f"{name} -> {target}" for target in targets if target not in services]
    return missing


def join_continuations(text: str) -> list[str]:
    """Dockerfile instructions, one per entry, with `\\` continuations joined and comments dropped."""
    instructions: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        instructions.append(current)
        current = ""
    if current:
        instructions.append(current)
    return instructions


def dockerfile_entrypoint(text: str) -> list[str]:
    """The effective ENTRYPOINT (the last one) in exec form; fails on the shell form."""
    entrypoints = [i for i in join_continuations(text) if re.match(r"(?i)^ENTRYPOINT\s", i)]
    assert entrypoints, "Dockerfile has no ENTRYPOINT"
    body = entrypoints[-1].split(None, 1)[1].strip()
    try:
        argv = json.loads(body)
    except json.JSONDecodeError:
        pytest.fail(f"ENTRYPOINT must use the exec (JSON) form so signals reach fleet, got: {body}")
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), body
    return argv


def container_argv(entrypoint: list[str], command: Any) -> list[str]:
    """The arguments `fleet` receives: ENTRYPOINT ["fleet"] + the service's command list."""
    assert entrypoint == ["fleet"], f"expected ENTRYPOINT [\"fleet\"], got {entrypoint}"
    assert isinstance(command, list) and all(isinstance(a, str) for a in command), (
        f"command must be a list of strings (exec form), got {command!r}"
    )
    return list(command)


def parse_fleet_argv(argv: list[str], expected_subcommand: str) -> argparse.Namespace:
    """Parse argv with the real `fleet` parser; AssertionError with argparse's message on failure."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(
            f"`fleet {' '.join(argv)}` is rejected by fleet.cli.build_parser() "
            f"(exit {exc.code}): {stderr.getvalue().strip()}"
        ) from None
    assert args.command == expected_subcommand, (
        f"`fleet {' '.join(argv)}` runs subcommand {args.command!r}, expected {expected_subcommand!r}"
    )
    return args


def published_ports(service: dict[str, Any]) -> set[tuple[int, int]]:
    """(published, target) pairs from short ("[ip:]8000:8000[/tcp]") or long port syntax."""
    pairs = set()
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            pairs.add((int(port["published"]), int(port["target"])))
            continue
        spec = str(port).split("/")[0]
        parts = spec.split(":")
        assert len(parts) >= 2, f"port {port!r} publishes no host port"
        pairs.add((int(parts[-2]), int(parts[-1])))
    return pairs


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read_only) from short ("src:dst[:ro]") or long volume syntax."""
    result = {}
    for volume in service.get("volumes") or []:
        if isinstance(volume, dict):
            result[volume["target"]] = (volume.get("source", ""), bool(volume.get("read_only")))
            continue
        parts = str(volume).split(":")
        source, target = parts[0], parts[1]
        options = parts[2].split(",") if len(parts) > 2 else []
        result[target] = (source, "ro" in options)
    return result


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {key: str(value) for key, value in env.items()}


# ── fixtures ─────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    services = compose.get("services")
    assert isinstance(services, dict) and services, "compose.yaml defines no services"
    return services


@pytest.fixture(scope="module")
def entrypoint() -> list[str]:
    return dockerfile_entrypoint(DOCKERFILE.read_text())


# ── the file as a whole ──────────────────────────────────────────────────────


def test_compose_file_validates_against_the_compose_spec() -> None:
    try:
        validate_compose_text(COMPOSE_FILE.read_text())
    except ValueError as exc:
        pytest.fail(f"compose.yaml is not a valid compose file: {exc}")


def test_the_validator_rejects_an_invalid_file() -> None:
    broken = COMPOSE_FILE.read_text().replace("restart: unless-stopped", "restart: sometimes", 1)
    with pytest.raises(ValueError, match="restart"):
        validate_compose_text(broken)


def test_project_is_named_fleet_by_dotenv_for_compose_v1_and_v2(compose: dict[str, Any]) -> None:
    # Compose v1 (docker-compose 1.29, Debian's) rejects a top-level `name:`; both read .env.
    assert "name" not in compose
    dotenv = dict(line.split("=", 1) for line in DOTENV.read_text().splitlines() if line and not line.startswith("#"))
    assert dotenv["COMPOSE_PROJECT_NAME"] == "fleet"
    assert dotenv["COMPOSE_PROFILES"] == "gpu"  # plain `docker compose up` starts the GPU workers


def test_interpolation_resolves_as_compose_does() -> None:
    text = "a: ${A:-x} b: ${B-y} c: ${C} d: $$D"
    assert interpolate(text) == "a: x b: y c:  d: $D"
    assert interpolate(text, {"A": "", "B": "", "C": "3"}) == "a: x b:  c: 3 d: $D"
    with pytest.raises(ValueError, match="needed"):
        interpolate("${E:?needed}")


def test_published_ports_default_to_every_interface_and_move_with_the_environment() -> None:
    text = COMPOSE_FILE.read_text()
    moved = yaml.safe_load(interpolate(text, {"FLEET_PUBLISH_ADDRESS": "127.0.0.1", "FLEET_HTTP_PORT": "18000"}))
    assert "127.0.0.1:18000:8000" in moved["services"]["gateway"]["ports"]
    assert "0.0.0.0:8000:8000" in load_compose()["services"]["gateway"]["ports"]


def test_every_depends_on_target_is_a_service(services: dict[str, Any]) -> None:
    assert missing_depends_on(services) == []


def test_depends_on_check_catches_a_missing_service(services: dict[str, Any]) -> None:
    broken = {**services, "gateway": {**services["gateway"], "depends_on": {"valkey": {}}}}
    assert missing_depends_on(broken) == ["gateway -> valkey"]


def test_named_volumes_are_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in services.items():
        for target, (source, _) in mounts(service).items():
            if source and not source.startswith((".", "/", "~")):
                assert source in declared, f"{name}: volume {source!r} for {target} is not declared"


# ── redis ────────────────────────────────────────────────────────────────────


def test_redis_persists_with_aof_and_is_healthchecked(services: dict[str, Any]) -> None:
    redis = services["redis"]
    assert re.match(r"(valkey/valkey|redis):", redis["image"]), redis["image"]
    command = redis["command"]
    argv = command if isinstance(command, list) else command.split()
    assert argv[argv.index("--appendonly") + 1] == "yes"
    # Written before each reply: a killed Redis loses nothing it acknowledged (fleet/redis_server.py).
    assert argv[argv.index("--appendfsync") + 1] == "no"
    assert "/data" in mounts(redis), "redis data (the AOF) must live on a volume at /data"
    test = redis["healthcheck"]["test"]
    assert any(cli in test for cli in ("valkey-cli", "redis-cli")) and "ping" in test, test


def test_fleet_services_wait_for_a_healthy_redis(services: dict[str, Any]) -> None:
    for name in FLEET_SERVICES:
        depends_on = services[name]["depends_on"]
        assert depends_on["redis"]["condition"] == "service_healthy", name
        url = environment(services[name])["REDIS_URL"]
        host = re.match(r"redis://([^:/]+)", url)
        assert host and host.group(1) in services, f"{name}: REDIS_URL {url} names no service"


# ── the Dockerfile and the command lines ─────────────────────────────────────


def test_dockerfile_entrypoint_is_fleet(entrypoint: list[str]) -> None:
    assert entrypoint == ["fleet"]


def test_dockerfile_is_multi_stage_non_root_on_python_slim_and_healthchecked() -> None:
    text = DOCKERFILE.read_text()
    instructions = join_continuations(text)
    assert re.search(r"(?m)^ARG BASE_IMAGE=python:3\.11-slim$", text)  # before the first FROM: global
    froms = [i for i in instructions if re.match(r"(?i)^FROM\s", i)]
    assert [f.split()[1] for f in froms] == ["${BASE_IMAGE}", "${BASE_IMAGE}"] and froms[0].endswith(" AS build")
    runtime = instructions[instructions.index(froms[-1]):]
    # The runtime stage takes only the build stage's virtual environment: no source tree, no pip cache.
    assert [i for i in runtime if re.match(r"(?i)^COPY\s", i)] == ["COPY --from=build /opt/fleet /opt/fleet"]
    users = [i.split()[1] for i in runtime if re.match(r"(?i)^USER\s", i)]
    assert users and users[-1] not in ("root", "0"), "the image must not run as root"
    health = [i for i in runtime if re.match(r"(?i)^HEALTHCHECK\s", i)]
    assert len(health) == 1 and health[0].endswith('CMD ["python", "-m", "fleet.healthcheck"]')


def test_project_installs_the_fleet_script() -> None:
    pyproject = ROOT / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("pyproject.toml not written yet; the image's ENTRYPOINT needs its `fleet` script")
    scripts = tomllib.loads(pyproject.read_text()).get("project", {}).get("scripts", {})
    assert scripts.get("fleet", "").startswith("fleet.cli:"), (
        "pyproject.toml must declare [project.scripts] fleet = \"fleet.cli:main\" (ENTRYPOINT [\"fleet\"])"
    )


@pytest.mark.parametrize(("service", "subcommand"), sorted(FLEET_SERVICES.items()))
def test_service_command_is_accepted_by_the_fleet_cli(
    services: dict[str, Any], entrypoint: list[str], service: str, subcommand: str
) -> None:
    argv = container_argv(entrypoint, services[service]["command"])
    args = parse_fleet_argv(argv, subcommand)
    assert args.model_repository == [Path("/models")]


def test_a_bogus_flag_fails_the_command_check(services: dict[str, Any], entrypoint: list[str]) -> None:
    argv = container_argv(entrypoint, services["gateway"]["command"]) + ["--bogus-flag", "1"]
    with pytest.raises(AssertionError, match="--bogus-flag"):
        parse_fleet_argv(argv, "gateway")


def test_a_wrong_subcommand_fails_the_command_check(services: dict[str, Any], entrypoint: list[str]) -> None:
    argv = container_argv(entrypoint, services["worker"]["command"])
    with pytest.raises(AssertionError, match="expected 'gateway'"):
        parse_fleet_argv(argv, "gateway")


def test_a_shell_form_command_fails_the_command_check(entrypoint: list[str]) -> None:
    with pytest.raises(AssertionError, match="exec form"):
        container_argv(entrypoint, "gateway --http-port 8000")


@pytest.mark.parametrize("service", sorted(FLEET_SERVICES))
def test_settings_resolve_as_in_the_container(
    services: dict[str, Any], entrypoint: list[str], service: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Settings built from the container's environment and flags point at the compose Redis."""
    for key in list(os.environ):
        if key.startswith("FLEET_") or key == "REDIS_URL":
            monkeypatch.delenv(key)
    for key, value in environment(services[service]).items():
        monkeypatch.setenv(key, value)
    args = parse_fleet_argv(container_argv(entrypoint, services[service]["command"]), FLEET_SERVICES[service])
    settings = settings_from_args(args)
    assert settings.redis_url == "redis://redis:6379/0"
    assert settings.model_repositories == (Path("/models"),)


# ── gateway ──────────────────────────────────────────────────────────────────


def test_gateway_publishes_its_http_and_metrics_ports(services: dict[str, Any], entrypoint: list[str]) -> None:
    gateway = services["gateway"]
    args = parse_fleet_argv(container_argv(entrypoint, gateway["command"]), "gateway")
    assert (args.http_port, args.metrics_port) == (8000, 8002)
    assert {(8000, 8000), (8002, 8002)} <= published_ports(gateway)
    # the default bind address (127.0.0.1) would be unreachable through a published port
    assert args.http_address == "0.0.0.0"


def test_gateway_publishes_its_grpc_port(services: dict[str, Any], entrypoint: list[str]) -> None:
    gateway = services["gateway"]
    settings = settings_from_args(parse_fleet_argv(container_argv(entrypoint, gateway["command"]), "gateway"))
    assert settings.allow_grpc and settings.grpc_port == 8001
    assert (8001, 8001) in published_ports(gateway)
    assert settings.grpc_host == "0.0.0.0"  # 127.0.0.1 would be unreachable through the published port


def test_gateway_processes_follow_fleet_gateways(entrypoint: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEET_GATEWAYS sets how many gateway processes the gateway container runs on its ports: one on a
    fresh host, G when compose is started with FLEET_GATEWAYS=G."""
    for env, expected in (({}, 1), ({"FLEET_GATEWAYS": "3"}, 3)):
        gateway = yaml.safe_load(interpolate(COMPOSE_FILE.read_text(), env))["services"]["gateway"]
        for key in list(os.environ):
            if key.startswith("FLEET_"):
                monkeypatch.delenv(key)
        for key, value in environment(gateway).items():
            monkeypatch.setenv(key, value)
        settings = settings_from_args(parse_fleet_argv(container_argv(entrypoint, gateway["command"]), "gateway"))
        assert settings.gateways == expected and settings.redis_url == "redis://redis:6379/0"


def test_gateway_mounts_the_repository_read_only_and_is_healthchecked(services: dict[str, Any]) -> None:
    gateway = services["gateway"]
    assert mounts(gateway)["/models"] == ("./model_repository", True)
    assert gateway["healthcheck"]["test"] == ["CMD", "python", "-m", "fleet.healthcheck"]  # /v2/health/live on its port
    assert gateway["restart"] == "unless-stopped"
    assert "stop_grace_period" in gateway


# ── jobs ─────────────────────────────────────────────────────────────────────


def test_gateway_and_job_workers_share_the_jobs_volume(services: dict[str, Any], entrypoint: list[str]) -> None:
    for name in ("gateway", "jobs"):
        args = parse_fleet_argv(container_argv(entrypoint, services[name]["command"]), FLEET_SERVICES[name])
        assert args.jobs_dir == Path("/jobs")
        assert mounts(services[name])["/jobs"] == ("jobs-data", False)


# ── worker ───────────────────────────────────────────────────────────────────


def test_worker_reserves_a_gpu_and_uses_it(services: dict[str, Any], entrypoint: list[str]) -> None:
    worker = services["worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices), devices
    assert worker["deploy"]["replicas"] >= 1
    args = parse_fleet_argv(container_argv(entrypoint, worker["command"]), "worker")
    assert args.device.startswith("cuda:")
    assert worker["profiles"] == ["gpu"] and worker["image"] == "fleet:gpu"


def test_the_cpu_worker_pool_is_a_profile_on_the_cpu_image(services: dict[str, Any], entrypoint: list[str]) -> None:
    worker = services["worker-cpu"]
    assert worker["profiles"] == ["cpu"] and worker["image"] == services["gateway"]["image"] == "fleet:cpu"
    assert "deploy" not in worker  # no GPU reservation
    assert parse_fleet_argv(container_argv(entrypoint, worker["command"]), "worker").device == "cpu"


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_worker_mounts_the_repository_and_drains_on_stop(services: dict[str, Any], name: str) -> None:
    worker = services[name]
    source, _ = mounts(worker)["/models"]
    assert source == "./model_repository"
    assert worker["stop_grace_period"] == "30s"
    assert worker["healthcheck"]["test"] == ["CMD", "python", "-m", "fleet.healthcheck"]
    assert environment(worker)["REDIS_URL"] == "redis://redis:6379/0"


def test_prometheus_scrapes_the_gateway_metrics_port(services: dict[str, Any], entrypoint: list[str]) -> None:
    config_mount = mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"]
    assert config_mount == ("./docs/deploy/prometheus.yml", True)
    config = yaml.safe_load((ROOT / config_mount[0]).read_text())
    targets = {c["job_name"]: c["static_configs"][0]["targets"] for c in config["scrape_configs"]}
    metrics_port = parse_fleet_argv(container_argv(entrypoint, services["gateway"]["command"]), "gateway").metrics_port
    assert targets["fleet"] == [f"gateway:{metrics_port}"]
    # Redis through its exporter, which reads the same Redis the fleet services use.
    assert targets["redis"] == ["redis-exporter:9121"]
    assert environment(services["redis-exporter"])["REDIS_ADDR"] == "redis://redis:6379"
    assert environment(services["gateway"])["REDIS_URL"].startswith("redis://redis:6379")


# ── package indexes and machine paths ────────────────────────────────────────

# Where packages (and images, and model weights) are downloaded from: the deployer picks these, so the
# project names none. A documentation link to one of these hosts would be flagged too; none is needed.
# Escaped as the pattern takes them; the examples below unescape them, so this file names none as text.
HOST_PATTERNS = (
    r"pypi\.org", r"pythonhosted\.org", r"pypi\.python\.org", r"download\.pytorch\.org", r"anaconda\.org",
    r"anaconda\.com", r"registry\.npmjs\.org", r"pypi\.nvidia\.com", r"ngc\.nvidia\.com", r"nvcr\.io", r"ghcr\.io",
    r"quay\.io", r"docker\.io", r"huggingface\.co", r"crates\.io", r"rubygems\.org", r"proxy\.golang\.org",
)
REGISTRY_HOSTS = re.compile(r"(?<![\w-])(?:[\w-]+\.)*(?:" + "|".join(HOST_PATTERNS) + r")\b", re.IGNORECASE)
# Absolute paths of a particular machine (the checkout, a home directory, /opt installs); the project
# refers to its neighbours relative to the checkout (`../shared/...`).
MACHINE_PATHS = re.compile(r"(?<![\w.~])/(?:work|root|home|opt|Users)/")
# (file, exact text) pairs that match but are not this machine's: the image's own user's home and its
# virtual environment.
# And Debian's package of the Docker engine, whose name is the registry's host name.
ALLOWED = {("Dockerfile", "/home/fleet"), ("Dockerfile", "/opt/fleet"),
           ("tests/compose/stack.py", "docker.io"), (".ci/run", "docker.io")}


def offending_lines(name: str, text: str) -> list[str]:
    """`name:line: text` for each line naming a registry host or a machine path (ALLOWED aside)."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        hits = [m.group(0) for m in REGISTRY_HOSTS.finditer(line)]
        hits += [line[m.start():].split()[0] for m in MACHINE_PATHS.finditer(line)]
        if any(not any(name == file and hit.startswith(allowed) for file, allowed in ALLOWED) for hit in hits):
            found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def project_files() -> list[str]:
    """Tracked files plus new ones not ignored (git ls-files), that exist now; skips without git."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no file list")
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def test_no_project_file_names_a_registry_host_or_a_machine_path() -> None:
    this_file = Path(__file__).resolve().relative_to(ROOT).as_posix()  # it spells the patterns out
    found = []
    for name in project_files():
        if name == this_file:
            continue
        data = (ROOT / name).read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (an ONNX model, say)
        found += offending_lines(name, data.decode(errors="replace"))
    assert found == [], "\n".join(found)


def _host(pattern: str) -> str:
    return pattern.replace("\\", "")


@pytest.mark.parametrize("line", [
    # Built from the check's own list (each host, as a URL and as a bare name in text) so that this file
    # names no host or machine path itself, nor writes an index URL.
    *(f"wheels from https://{_host(p)}/x" for p in HOST_PATTERNS),
    f"see {_host(HOST_PATTERNS[0])} for it",
    "K=${K:-/" + "work/shared/anchors/triton}",
    'ANCHOR = Path("/root/anchors")',
    "see /home/alice/notes",
])
def test_the_check_catches_hosts_and_paths(line: str) -> None:
    assert offending_lines("x", line) != []


@pytest.mark.parametrize("line", [
    "K=${K:-$ROOT/../shared/anchors/triton}",
    "https://github.com/kubeflow/kfserving/blob/master/docs/predict-api/v2/required_api.md",
    "bench/model_repository/double/",
    "FLEET_JOB_INPUT_DIRS='[\"/data/in\"]'",
])
def test_the_check_lets_relative_paths_and_other_hosts_pass(line: str) -> None:
    assert offending_lines("x", line) == []


def test_the_image_user_home_is_allowed_only_in_the_dockerfile() -> None:
    line = "WORKDIR /home/fleet"
    assert offending_lines("Dockerfile", line) == []
    assert offending_lines("README.md", line) != []


def dockerfile_args() -> dict[str, str | None]:
    """ARG name -> default (None: no default)."""
    args: dict[str, str | None] = {}
    for instruction in join_continuations(DOCKERFILE.read_text()):
        m = re.match(r"(?i)^ARG\s+(\w+)(?:=(.*))?$", instruction)
        if m:
            args[m.group(1)] = m.group(2)
    return args


def test_index_urls_are_build_arguments_without_a_default() -> None:
    args = dockerfile_args()
    assert args.get("TORCH_INDEX_URL") == "" and args.get("INDEX_URL") == "", args
    assert args.get("TORCH_VARIANT") == "cpu", "the default image must be the CPU one"
    runs = [i for i in join_continuations(DOCKERFILE.read_text()) if re.match(r"(?i)^RUN\s", i)]
    # Each pip install takes an index only when one is given (empty: pip's own default), never a host.
    for run in runs:
        optional = re.findall(r'\$\{(\w+):\+--index-url "\$\{(\w+)\}"\}', run)
        assert run.count("--index-url") == len(optional), run
        assert all(a == b and args.get(a) == "" for a, b in optional), run
        assert "://" not in run, run
    # The torch it installed is checked against the variant: a CPU image never ships a CUDA torch.
    assert any("torch.version.cuda" in run and "TORCH_VARIANT" in run for run in runs)


def test_compose_passes_index_urls_from_the_environment() -> None:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]  # as written, not interpolated
    for name, variant, torch_var in (("gateway", "cpu", "TORCH_CPU_INDEX_URL"),
                                     ("worker", "cuda", "TORCH_CUDA_INDEX_URL")):
        args = services[name]["build"]["args"]
        assert args["TORCH_VARIANT"] == variant, name
        assert args["TORCH_INDEX_URL"] == f"${{{torch_var}:-}}", name
        assert args["INDEX_URL"] == "${INDEX_URL:-}", name

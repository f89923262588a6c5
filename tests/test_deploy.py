"""deploy/: the Prometheus alert rules (promtool check and unit tests) and scrape config, the Grafana
dashboard, and that every metric either names is one a live server exports; a slow test runs a real
Prometheus against a live server; the Kubernetes manifest's shutdown budget. promtool and prometheus are Debian's `prometheus` package (.ci/run installs it); without
them those tests skip and say so."""

import copy
import json
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import start_default_model_server
from tinyserve.engine.memory.process_memory import DeviceMemory
from tinyserve.server.observability.memory_stats import MemorySnapshot
from tinyserve.server.observability.metrics import MetricSet

DEPLOY = Path(__file__).parent.parent / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
K8S = DEPLOY / "k8s" / "tinyserve.yaml"
COMPOSE = DEPLOY / "docker-compose.yml"
ABORT_GRACE_S, ENGINE_JOIN_TIMEOUT_S = 2.0, 5.0  # what tinyserve takes after --shutdown-timeout (server/registry/model_slot.py)
DASHBOARD = DEPLOY / "grafana" / "tinyserve.json"
CUDA_ONLY = {"tinyserve:device_memory_allocated_bytes", "tinyserve:device_memory_reserved_bytes",
             "tinyserve:device_memory_total_bytes"}
_NAME = re.compile(r"\btinyserve:[A-Za-z0-9_:]+")


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package prometheus: apt-get install prometheus; .ci/run does)")
    return path


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_alert_rules_pass_promtool_check():
    result = subprocess.run([_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_prometheus_config_passes_promtool_check():
    result = subprocess.run([_tool("promtool"), "check", "config", str(PROMETHEUS_CONFIG)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid prometheus config file syntax" in result.stdout and "SUCCESS: 11 rules found" in result.stdout


def test_k8s_probes_and_grace_period_cover_the_drain():
    from tinyserve.server.registry import model_slot

    assert (model_slot.ABORT_GRACE_S, model_slot.ENGINE_JOIN_TIMEOUT_S) == (ABORT_GRACE_S, ENGINE_JOIN_TIMEOUT_S)
    deployment = next(d for d in yaml.safe_load_all(K8S.read_text()) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    shutdown_timeout = float(args[args.index("--shutdown-timeout") + 1])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = float(pre_stop[1]) + shutdown_timeout + ABORT_GRACE_S + ENGINE_JOIN_TIMEOUT_S
    assert needed <= pod["terminationGracePeriodSeconds"] <= needed + 10
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", probe
    liveness = container["livenessProbe"]
    # a draining server says 503: liveness must not kill it before the drain ends
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > shutdown_timeout


def test_compose_grace_period_covers_the_drain_and_prometheus_scrapes_its_service():
    compose = yaml.safe_load(COMPOSE.read_text())
    service = compose["services"]["tinyserve"]
    args = service["command"]
    shutdown_timeout = float(args[args.index("--shutdown-timeout") + 1])
    grace = float(service["stop_grace_period"].removesuffix("s"))
    assert shutdown_timeout + ABORT_GRACE_S + ENGINE_JOIN_TIMEOUT_S <= grace <= shutdown_timeout + 20
    assert "/health" in " ".join(service["healthcheck"]["test"])
    scrape = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"][0]
    assert scrape["job_name"] == "tinyserve" and scrape["static_configs"][0]["targets"] == ["tinyserve:8000"]
    mounts = " ".join(compose["services"]["prometheus"]["volumes"] + compose["services"]["grafana"]["volumes"])
    for path in ("prometheus/prometheus.yml", "prometheus/alerts.yml", "grafana/tinyserve.json", "grafana/provisioning"):
        assert f"./{path}:" in mounts and (DEPLOY / path).exists(), path


def test_each_alert_fires_on_its_hot_series_and_not_on_its_calm_one(tmp_path):
    promtool = _tool("promtool")
    tests = yaml.safe_load(RULE_TESTS.read_text())
    tested = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"] if case["exp_alerts"]}
    assert tested == {rule["alert"] for rule in _rules()}, "every alert needs a firing case"
    shutil.copy(RULES, tmp_path / RULES.name)

    def run(doc) -> subprocess.CompletedProcess:
        path = tmp_path / "case.yml"
        path.write_text(yaml.safe_dump(doc))
        return subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, cwd=tmp_path)

    result = run(tests)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr
    # the same tests with each calm series given its hot twin's values: now the alert also fires on
    # the calm one, which the test does not expect, so promtool must fail it (each test in turn)
    for i, test in enumerate(tests["tests"]):
        hot = {s["series"]: s["values"] for s in test["input_series"] if "hot" in s["series"]}
        planted = copy.deepcopy(tests)
        planted["tests"] = [copy.deepcopy(test)]
        for series in planted["tests"][0]["input_series"]:
            twin = series["series"].replace("calm", "hot")
            if "calm" in series["series"] and twin in hot:
                series["values"] = hot[twin]
        result = run(planted)
        alert = test["alert_rule_test"][0]["alertname"]
        assert result.returncode != 0 and "calm" in result.stdout + result.stderr, f"{alert}: {result.stdout}"


def test_dashboard_is_grafana_json_over_our_series():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(set(titles)) == len(titles) and len({p["id"] for p in dashboard["panels"]}) == len(titles)
    exprs = " ".join(_dashboard_exprs())
    for quantile in ("0.5", "0.95", "0.99"):
        for metric in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
            assert f"histogram_quantile({quantile}, sum by (model_name, le) (rate(tinyserve:{metric}_bucket" in exprs


@pytest.fixture(scope="module")
def server(smollm2_loaded):
    srv = start_default_model_server(smollm2_loaded, max_queue=2)
    yield srv
    srv.stop()


def _exported_names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^(tinyserve:[A-Za-z0-9_:]+)[{ ]", text, re.M)}


def test_every_metric_in_the_dashboard_and_rules_is_exported(server):
    """On a fresh server, before any request: the labelled counters are there at 0 for every known label
    set, so the dashboard and the alert rules read 0, not "no data"."""
    text = httpx.get(server.base_url + "/metrics").text
    assert 'tinyserve:request_success_total{api="http",finished_reason="error",model_name="smollm2-135m"} 0.0' in text
    for labels in ('{api="grpc",model_name="smollm2-135m",reason="overloaded"} 0.0',
                   '{api="http",model_name="smollm2-135m",reason="too_many_samples"} 0.0'):
        assert "tinyserve:request_rejected_total" + labels in text, labels
    assert 'tinyserve:model_unloads_total{model_name="smollm2-135m",reason="evicted"} 0.0' in text
    exported = _exported_names(text)
    used = {name for expr in _dashboard_exprs() + [rule["expr"] for rule in _rules()] for name in _NAME.findall(expr)}
    assert len(used) > 25
    missing = used - exported
    assert missing <= CUDA_ONLY, f"not exported: {sorted(missing - CUDA_ONLY)}"
    # the CUDA-only ones: exported when there is a device
    device = DeviceMemory("cuda:0", allocated_bytes=1 << 30, reserved_bytes=2 << 30, total_bytes=80 << 30)
    metric_set = MetricSet(get_memory=lambda: MemorySnapshot(1, 2, [device], []))
    text = metric_set.render().decode()
    for name in CUDA_ONLY:
        assert f'{name}{{device="cuda:0"}}' in text, name
    assert 'tinyserve:device_memory_total_bytes{device="cuda:0"} 8.589934592e+10' in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_real_prometheus_scrapes_a_live_server_and_answers_a_dashboard_query(server, tmp_path):
    """Prometheus scrapes the server every second for ~30 s while requests run; the dashboard's
    generated-tokens/s query (its $__rate_interval and $model filled in) then answers a positive number."""
    prometheus = _tool("prometheus")
    target = server.base_url.removeprefix("http://")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "tinyserve", "static_configs": [{"targets": [target]}]}]}))
    port = _free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            httpx.post(server.base_url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 16})
        (expr,) = [e for e in _dashboard_exprs() if e.startswith("sum by (model_name) (rate(tinyserve:generation")]
        query = expr.replace("$__rate_interval", "20s").replace("$model", ".*")
        result = httpx.get(f"{api}/query", params={"query": query}).json()
        assert result["status"] == "success", result
        (sample,) = result["data"]["result"]
        assert sample["metric"] == {"model_name": "smollm2-135m"}
        assert float(sample["value"][1]) > 0
        up = httpx.get(f"{api}/query", params={"query": 'up{job="tinyserve"}'}).json()["data"]["result"]
        assert [s["value"][1] for s in up] == ["1"]
        print(f"\nPrometheus: generated tokens/s over 20 s = {float(sample['value'][1]):.1f}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


DOCKERFILE, ENTRYPOINT = DEPLOY / "Dockerfile", DEPLOY / "entrypoint.sh"
SECRET = "/run/secrets/tinyserve_api_key"


def test_the_image_installs_a_compiler_and_builds_no_kernel_at_build_time():
    instructions = [line for line in DOCKERFILE.read_text().splitlines() if line and not line.startswith("#")]
    text = "\n".join(instructions)
    assert re.search(r"apt-get install [^\n]*\bg\+\+", text)  # our kernels compile where the image runs
    assert "cpu_kernels" not in text  # built on the build machine's CPU (-march=native) they could SIGILL elsewhere
    (entrypoint,) = [line for line in instructions if line.startswith("ENTRYPOINT")]
    (program,) = json.loads(entrypoint.removeprefix("ENTRYPOINT"))
    assert f"COPY deploy/entrypoint.sh /usr/local/bin/{program}" in text
    assert "VOLUME /cache" in text
    assert "0.0.0.0" not in text  # the address comes with the key, in the entrypoint


def _stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("kernels_build", ["ok", "fails"])
def test_the_entrypoint_builds_the_kernels_per_cpu_then_serves_with_the_key_file(tmp_path, kernels_build):
    """deploy/entrypoint.sh with `python` and `tinyserve` stubbed: the kernels first, into a cache folder named
    by the CPU; then exec tinyserve on every address with the secret as --api-key-file and the given args."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    _stub(bin_dir, "python", f'echo "python $* TORCH_EXTENSIONS_DIR=$TORCH_EXTENSIONS_DIR" >> {log}\n'
                             f'exit {0 if kernels_build == "ok" else 1}\n')
    _stub(bin_dir, "tinyserve", f'echo "tinyserve $*" >> {log}\n')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "TINYSERVE_KERNEL_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(["sh", str(ENTRYPOINT), "--shutdown-timeout", "30"], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    build, serve = log.read_text().splitlines()
    match = re.fullmatch(rf"python -m tinyserve.layers.kernels.cpu_kernels TORCH_EXTENSIONS_DIR={tmp_path}/cache/"
                         r"torch_extensions/cpu-([0-9a-f]{16})", build)
    assert match, build
    assert serve == f"tinyserve serve --host 0.0.0.0 --port 8000 --api-key-file {SECRET} --shutdown-timeout 30"
    assert ("torch ops" in result.stderr) == (kernels_build == "fails")  # a failed build still serves, slower


def test_the_image_refuses_to_start_without_its_key(tmp_path, capsys):
    """What the entrypoint runs, with the secret missing or empty: exit 1 before any model loads."""
    from tinyserve.cli import main

    empty = tmp_path / "key"
    empty.write_text("\n")
    for path, message in ((tmp_path / "missing", "does not exist"), (empty, "is empty")):
        assert main(["serve", "--host", "0.0.0.0", "--port", "8000", "--api-key-file", str(path)]) == 1
        assert message in capsys.readouterr().err


def test_compose_and_k8s_hand_the_key_as_a_secret_file_and_keep_a_kernel_cache():
    compose = yaml.safe_load(COMPOSE.read_text())
    service = compose["services"]["tinyserve"]
    assert service["secrets"] == ["tinyserve_api_key"] and SECRET.endswith("/" + service["secrets"][0])
    assert compose["secrets"]["tinyserve_api_key"]["file"] == "./api_key.txt"
    assert "deploy/api_key.txt" in (DEPLOY.parent / ".gitignore").read_text().splitlines()
    assert "kernel-cache:/cache" in service["volumes"] and "kernel-cache" in compose["volumes"]
    deployment = next(d for d in yaml.safe_load_all(K8S.read_text()) if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts == {"api-key": "/run/secrets", "kernel-cache": "/cache"}
    assert volumes["api-key"]["secret"]["items"] == [{"key": "api-key", "path": SECRET.rsplit("/", 1)[1]}]
    assert "env" not in container  # no key in the environment: a file alone

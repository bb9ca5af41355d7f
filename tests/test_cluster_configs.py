"""cluster_configs/*.yaml pass Ray's own cluster-launcher validation (the autoscaler's schema in
the installed ray package, after filling in the provider's defaults as `ray up` does), keep the
dashboard off the internet and hold no secrets."""

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "cluster_configs").glob("*.yaml"))
SECRET_KEY = re.compile(r"secret|password|passwd|token|access_key|private_key|credential|api_key", re.IGNORECASE)
SECRET_VALUE = re.compile(r"AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}|-----BEGIN|ghp_[A-Za-z0-9]{20,}|xox[bp]-")
WORLD = ("0.0.0.0/0", "::/0")


def load(path):
    return yaml.safe_load(path.read_text())


def walk(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield f"{path}.{k}", k, v
            yield from walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}[{i}]")


def test_the_three_kinds_are_there():
    assert {p.name for p in CONFIGS} == {"aws-gpu.yaml", "aws-gpu-spot.yaml", "aws-cpu-small.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_valid_for_ray_up(path):
    config = prepare_config(load(path))
    validate_config(config)  # raises on any schema or consistency error
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    assert workers and all(v["min_workers"] < v["max_workers"] for v in workers.values())  # it autoscales
    assert sum(v["min_workers"] for v in workers.values()) <= config["max_workers"]
    # the head trains nothing: its CPUs are not offered, so every airay worker lands on a worker node
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}
    assert "--num-cpus=0" in " ".join(config["head_start_ray_commands"])


def test_validation_is_real():
    config = prepare_config(load(ROOT / "cluster_configs" / "aws-gpu.yaml"))
    broken = copy.deepcopy(config)
    broken["available_node_types"]["gpu_worker"]["min_wrokers"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)
    broken = copy.deepcopy(config)
    broken["head_node_type"] = "nope"
    with pytest.raises(ValueError, match="head_node_type"):
        validate_config(broken)


def test_gpu_configs_have_8_gpu_workers_and_spot_uses_the_spot_market():
    gpu = prepare_config(load(ROOT / "cluster_configs" / "aws-gpu.yaml"))
    assert gpu["available_node_types"]["gpu_worker"]["resources"]["GPU"] == 8
    spot = prepare_config(load(ROOT / "cluster_configs" / "aws-gpu-spot.yaml"))
    types = spot["available_node_types"]
    assert types["gpu_spot"]["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert types["gpu_spot"]["resources"]["GPU"] == 8 and types["gpu_spot"]["min_workers"] == 0
    assert "InstanceMarketOptions" not in types["gpu_ondemand"]["node_config"] and types["gpu_ondemand"]["min_workers"] >= 1


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_dashboard_not_exposed_and_no_secrets(path):
    raw = load(path)
    config = prepare_config(raw)  # what `ray up` runs, Ray's defaults included
    head_start = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in head_start
    for rule in config["provider"].get("security_group", {}).get("IpPermissions", []):
        ranges = [r.get("CidrIp") for r in rule.get("IpRanges", [])] + [r.get("CidrIpv6") for r in rule.get("Ipv6Ranges", [])]
        opens_dashboard = rule.get("FromPort", 0) <= 8265 <= rule.get("ToPort", 65535)
        assert not (opens_dashboard and any(r in WORLD for r in ranges)), rule
    for where, key, value in walk(raw):
        assert not SECRET_KEY.search(str(key)), where
        assert not (isinstance(value, str) and SECRET_VALUE.search(value)), where
    assert "ssh_private_key" not in raw.get("auth", {}) and "KeyName" not in path.read_text()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_install_lines_pin_the_tested_versions(path):
    """Every node installs the Ray, DeepSpeed and torch versions pyproject.toml names as tested."""
    import tomllib

    from packaging.requirements import Requirement

    deps = {Requirement(d).name: Requirement(d) for d in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    pins = dict(re.findall(r'"([a-z]+)(?:\[[a-z,]+\])?==([0-9.]+)"', " ".join(load(path)["setup_commands"])))
    for name in ("ray", "deepspeed", "torch"):
        assert name in pins, f"{path.name} does not pin {name}"
        assert deps[name].specifier.contains(pins[name]), (name, pins[name], str(deps[name].specifier))


def airay_commands(text: str) -> list[tuple[str, list[str]]]:
    """(job spec, --set overrides) of each `airay run|submit jobs/X.yaml ...` command in a text
    (not the `$ airay ...` lines that show a bad spec's error)."""
    out = []
    for line in text.splitlines():
        m = re.search(r"airay (?:run|submit) (jobs/\S+\.yaml)(.*)", line)
        if m and not line.lstrip().startswith("$"):
            out.append((m.group(1), re.findall(r"--set (\S+=\S+)", m.group(2))))
    return out


def test_the_documented_cluster_commands_pass_validation():
    """README's and the cluster configs' commands, as written, give a valid job: any world size
    up to max_workers trains on the exact global batch, whole 8-GPU nodes on request."""
    from airay import JobConfig

    commands = {p.name: airay_commands(p.read_text()) for p in [ROOT / "README.md", *CONFIGS]}
    assert any("scaling.max_workers=16" in c[1] for c in commands["README.md"])
    for name, found in commands.items():
        assert found, name
        for spec, overrides in found:
            assert JobConfig.from_yaml(ROOT / spec, overrides).scaling.world_sizes, (name, spec, overrides)
    (spec, overrides), = commands["aws-gpu.yaml"]
    assert JobConfig.from_yaml(ROOT / spec, overrides).scaling.world_sizes == [8, 16, 24, 32, 40, 48, 56, 64]

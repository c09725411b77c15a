"""Config: defaults, refusals that name the file and the key path, --check-config."""

from __future__ import annotations

import re
import subprocess
import sys

import msgspec
import pytest
import yaml

from config import ConfigError, load_config
from config.schema import Config
from tests.helpers import ROOT


def test_no_file_and_empty_file_are_the_defaults(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    for cfg in (load_config(None), load_config(empty)):
        assert cfg.frontend.bind == ("tcp://127.0.0.1:5555",)
        assert cfg.limits.max_batch == 32
        assert cfg.compositing.resolved_workers() >= 1


def test_default_yaml_is_exactly_the_schema_defaults_and_documents_every_key():
    path = ROOT / "config" / "default.yaml"
    from_file = msgspec.to_builtins(load_config(path))
    defaults = msgspec.to_builtins(Config())
    from_file.pop("base_dir"), defaults.pop("base_dir")
    assert from_file == defaults
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\s*[a-z_]+:\s*\S", line):  # a leaf key (sections only hold keys)
            above = lines[i - 1].strip() if i else ""
            key = line.split(":")[0].strip()
            # A key is documented by a comment right above it, or shares one with its sibling above.
            assert above.startswith("#") or re.match(r"^[a-z_]+:\s*\S", above), \
                f"config/default.yaml: key {key!r} (line {i + 1}) has no comment"


@pytest.mark.parametrize("text, message", [
    ("inference:\n  workers_per_device: two\n",
     "inference.workers_per_device: expected an integer >= 1, got 'two'"),
    ("inference:\n  eviction: lfx\n", "inference.eviction: expected one of 'lfu', 'lru', got 'lfx'"),
    ("inference:\n  precision: fp8\n", "inference.precision: expected one of 'fp16', 'fp32', got 'fp8'"),
    ("limits:\n  max_batch: 0\n", "limits.max_batch: expected an integer >= 1 and <= 256, got 0"),
    ("limits:\n  max_bach: 4\n", "limits.max_bach: unknown key"),
    ("frontend:\n  bind: [5555]\n", "frontend.bind.0: expected a string matching"),
    ("inference:\n  devices: [0, gpu]\n", "inference.devices.1: expected an integer >= 0, got 'gpu'"),
    ("models:\n  ../x: {onnx: a, frames: b, crop_rects: c}\n", "models: key '../x' is not valid"),
    ("models:\n  alice: {onnx: a}\n", "models.alice.frames: required key is missing"),
    ("models:\n  alice: 5\n", "models.alice: expected a string or a mapping, got 5"),
    ("output:\n  quality: 101\n", "output.quality: expected an integer >= 1 and <= 100, got 101"),
    ("- just\n- a list\n", "expected a mapping at the top level"),
    ("inference: {devices: [0\n", "not valid YAML"),
    ('models:\n  "a\\n": {onnx: a, frames: b, crop_rects: c}\n', "models: key 'a\\n' is not valid"),
    ('shm:\n  prefix: "ls\\n"\n', "shm.prefix: expected a string matching"),
    ("bridge:\n  hosts: [{endpoint: 'tcp://gpu:5570', server_key: gpu.key}]\n",
     "bridge.client_secret_key: required when bridge.hosts is set"),
    ("bridge:\n  hosts: [{endpoint: 'tcp://gpu:5570'}]\n  client_secret_key: e.key_secret\n",
     "bridge.hosts.0.server_key: required"),
    ("bridge:\n  hosts: [{endpoint: 'tcp://gpu:5570', dns: gpu, server_key: g.key}]\n  client_secret_key: e.key_secret\n",
     "bridge.hosts.0: give either endpoint"),
    ("bridge:\n  hosts: [{server_key: g.key}]\n  client_secret_key: e.key_secret\n", "bridge.hosts.0: give either endpoint"),
    ("base_dir: /etc\n", "base_dir: unknown key"),
])
def test_bad_config_is_refused_with_file_and_key_path(tmp_path, text, message):
    path = tmp_path / "my.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    path = tmp_path / "sub" / "c.yaml"
    path.parent.mkdir()
    path.write_text(yaml.safe_dump({"models_dir": "models"}))
    from config import resolve_path
    cfg = load_config(path)
    assert resolve_path(cfg, cfg.models_dir) == tmp_path / "sub" / "models"


def test_check_config_cli(tmp_path):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("limits: {max_batch: 8}\n")
    bad.write_text("inference:\n  workers_per_device: two\n")
    ok = subprocess.run([sys.executable, "-m", "supervisor", "--check-config", str(good)], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "ok" in ok.stdout
    no = subprocess.run([sys.executable, "-m", "supervisor", "--check-config", str(bad)], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
    assert no.returncode == 2
    assert f"{bad}: inference.workers_per_device: expected an integer >= 1, got 'two'" in no.stderr
    missing = subprocess.run([sys.executable, "-m", "supervisor", "--config", str(tmp_path / "nope.yaml")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "cannot read the config file" in missing.stderr


def test_models_entries_as_a_directory_or_explicit_paths(tmp_path):
    from config.assets import list_model_ids, model_paths
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"models": {
        "bob": "avatars/bob",
        "alice": {"onnx": "a/unet.onnx", "frames": "a/frames", "crop_rects": "a/rects.json", "frame_order": "loop"}}}))
    cfg = load_config(path)
    assert list_model_ids(cfg) == ["alice", "bob"]
    bob = model_paths(cfg, "bob")
    assert (bob.onnx, bob.frames, bob.crop_rects) == (tmp_path / "avatars/bob/model.onnx", tmp_path / "avatars/bob/frames",
                                                      tmp_path / "avatars/bob/crop_rects.json")
    alice = model_paths(cfg, "alice")
    assert (alice.onnx, alice.frame_order) == (tmp_path / "a/unet.onnx", "loop")
    assert model_paths(cfg, "../etc") is None and model_paths(cfg, "nobody") is None


def test_keys_are_private_from_creation_and_never_overwritten(tmp_path):
    run = lambda: subprocess.run([sys.executable, "-m", "supervisor", "keys", str(tmp_path), "edge"],  # noqa: E731
                                 cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run().returncode == 0
    secret, public = tmp_path / "edge.key_secret", tmp_path / "edge.key"
    assert secret.stat().st_mode & 0o777 == 0o600 and public.stat().st_mode & 0o777 == 0o644
    before = secret.read_bytes()
    again = run()
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr
    assert secret.read_bytes() == before


def test_a_plaintext_bridge_must_be_asked_for_by_name(tmp_path):
    path = tmp_path / "plain.yaml"
    path.write_text("bridge:\n  hosts: [{endpoint: 'tcp://gpu:5570'}]\n  insecure_plaintext: true\n")
    assert load_config(path).bridge.insecure_plaintext


def test_a_retired_key_still_loads_with_a_warning_saying_why_it_is_ignored(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("inference:\n  tensorrt: true\n  batch_memory_bytes: 1000000\n  eviction: lfu\n")
    with caplog.at_level("WARNING", logger="config.loader"):
        config = load_config(path)
    assert config.inference.eviction == "lfu"
    text = caplog.text
    assert "inference.tensorrt is retired and ignored" in text and "never measured" in text
    assert "inference.batch_memory_bytes is retired and ignored" in text and "one frame" in text
    path.write_text("inference:\n  tensorrt: [not, a, bool]\n  eviction: sometimes\n")
    with pytest.raises(ConfigError, match="inference.eviction"):   # (the others are still checked)
        load_config(path)

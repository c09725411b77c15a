"""The start-up check of the server's generic top-level names (supervisor/ownership.py) reads only what
it needs of the installed distributions, and finds what importlib.metadata.packages_distributions
finds: in this environment for every name, and for another project's distribution that claims one of
ours, by its top_level.txt or only by the files its RECORD lists. (tests/test_packages.py installs such
a distribution for real and starts the server beside it.)"""

from __future__ import annotations

from importlib import metadata

from supervisor.ownership import NAMES, check_own_packages, owners


def _fake_distribution(site, name: str, files: list[str], top_level: str | None = None) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    # NOTE: a long description after the headers, as real METADATA has; its lines must not be read as headers
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n\nName: not-this\n")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in [*files, f"{info.name}/RECORD"]))
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level)


def test_owners_of_every_name_are_those_importlib_metadata_finds():
    everything = metadata.packages_distributions()
    assert {k: sorted(v) for k, v in owners(tuple(everything)).items()} == \
        {k: sorted(v) for k, v in everything.items()}


def test_another_distribution_that_installs_one_of_our_names_is_named(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "Other_Config", ["config/__init__.py", "config/x.py", "otherpkg/config.txt"])
    _fake_distribution(tmp_path, "shm-tools", ["shm_tools/__init__.py"], top_level="shm\n")
    _fake_distribution(tmp_path, "unrelated", ["unrelated/config.py", "unrelated/shm/__init__.py"])
    monkeypatch.syspath_prepend(str(tmp_path))
    found = owners()
    assert "Other_Config" in found["config"] and "shm-tools" in found["shm"]
    assert not any("unrelated" in names or "not-this" in names for names in found.values())
    assert {k: sorted(v) for k, v in found.items()} == \
        {k: sorted(v) for k, v in metadata.packages_distributions().items() if k in NAMES}
    message = check_own_packages()
    assert "`config` is also installed by the distribution Other_Config" in message
    assert "`shm` is also installed by the distribution shm-tools" in message

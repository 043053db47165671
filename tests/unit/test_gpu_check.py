"""benchmarks/gpu_check.py, the GPU check of a one-stage pipeline, as a dry run on the CPU: every part runs (with the
GPU-only ones skipped) and passes, so that the script a GPU user runs cannot rot."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_passes_as_a_dry_run_on_the_cpu(capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--dry-run"]) == 0
    verdicts = {line.split()[1]: line.split()[0] for line in capsys.readouterr().out.splitlines() if " " in line
                and line.split()[0] in ("PASS", "FAIL", "SKIP")}  # fmt: skip
    assert set(verdicts) == set(gpu_check.PARTS)
    assert verdicts == {part: "SKIP" if part == "syncs" else "PASS" for part in gpu_check.PARTS}

"""numba.cuda checked before a CUDA launch (numba_kernels/cuda_check.py), without a GPU.

On a GPU with numpy 2.5 every run with a numba-kernel compressor failed at rank 0's first
step: numba-cuda 0.30 registers `np.row_stack`, which numpy 2.5 removed. CI's Python 3.11
has numpy 2.4, where `row_stack` exists, so these tests delete it to play numpy 2.5."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import write_spec

WITHOUT_ROW_STACK = "import numpy; del numpy.row_stack\n"
# A machine with 4 GPUs, as far as dsgd's device plan can tell (the launch is refused first).
FOUR_GPUS = ("import torch; torch.cuda.is_available = lambda: True; "
             "torch.cuda.device_count = lambda: 4\n")


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300)


def test_the_installed_numpy_loads_numba_cudas_typing_registries():
    """The chain that failed on numpy 2.5, under the numpy installed here."""
    result = _python("from numba_kernels.cuda_check import problem; print(problem(launch=False))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"


def test_without_row_stack_dsgd_names_the_versions_and_the_fix():
    result = _python(WITHOUT_ROW_STACK + "from numba_kernels.cuda_check import problem\n"
                                         "print(problem(launch=False))")
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert message.startswith("numba.cuda cannot compile dsgd's CUDA kernels here (numba ")
    assert "numba-cuda " in message and "numpy " in message
    assert "no attribute 'row_stack'" in message
    assert message.endswith("pip install 'numpy<2.5' (or reinstall with pip install "
                            "'dsgd[cuda]', which pins it)")


def test_a_cuda_run_with_kernel_compressors_is_refused_before_anything_is_written(tmp_path):
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 2, epochs: 1, steps_per_epoch: 2}
        experiments:
          - {name: quantized, aggregator: {name: allreduce, compressor: qsgd}}
    """)
    code = WITHOUT_ROW_STACK + FOUR_GPUS + textwrap.dedent("""
        import sys
        from dsgd_cli.cli import main
        sys.argv = ["dsgd", *sys.argv[1:]]
        main()
    """)
    result = _python(code, "run", str(spec), "--db", str(tmp_path / "r.db"))
    assert result.returncode == 2, result.stderr
    message = result.stderr.strip()
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith("dsgd: error: numba.cuda cannot compile dsgd's CUDA kernels here")
    assert "row_stack" in message
    assert not (tmp_path / "r.db").exists()


def test_a_cuda_run_without_kernels_is_not_held_up_by_them(tmp_path):
    """allreduce without a compressor calls no numba kernel: its dry run plans a CUDA launch
    and the check does not apply."""
    spec = write_spec(tmp_path, """
        defaults: {task: logreg, workers: 2, epochs: 1, steps_per_epoch: 2}
        experiments:
          - {name: plain}
    """)
    code = WITHOUT_ROW_STACK + FOUR_GPUS + textwrap.dedent("""
        import sys
        from dsgd_cli.launch.launcher import cuda_kernels_problem, plan_launches
        from dsgd_cli.spec.experiments import load_spec
        launches = plan_launches(load_spec(sys.argv[1]))
        print(launches[0].device.kind, cuda_kernels_problem(launches))
    """)
    result = _python(code, str(spec))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "cuda None"


@pytest.mark.slow  # the same kernels run under the simulator in test_kernels_cudasim
def test_the_probe_kernel_runs_under_the_simulator():
    result = subprocess.run(
        [sys.executable, "-c", "from numba_kernels.cuda_check import problem; print(problem())"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "NUMBA_ENABLE_CUDASIM": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "None"

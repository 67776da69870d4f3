"""Test setup for k3export.ops: run the Triton kernels with the CPU interpreter.

TRITON_INTERPRET must be in the environment before `triton` is first imported, so it is set
here at import time (pytest imports conftest files before the test modules). A session-level
check fails loudly if triton was already imported without it.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def _interpreter_active() -> bool:
    try:
        import triton.knobs as knobs  # triton >= 3.4
    except Exception:  # pragma: no cover
        return os.environ.get("TRITON_INTERPRET") == "1"
    return bool(getattr(getattr(knobs, "runtime", None), "interpret", False)) or os.environ.get(
        "TRITON_INTERPRET"
    ) == "1"


@pytest.fixture(scope="session")
def triton_interpreter():
    """Skip when triton is missing; fail when the interpreter is not in effect on a CPU-only box."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available() and not _interpreter_active():
        pytest.fail("TRITON_INTERPRET=1 did not take effect (triton imported before tests/ops/conftest.py?)")
    return True


@pytest.fixture
def device() -> str:
    """Kernels are tested on CPU tensors under the interpreter (CUDA when a GPU is present and
    the interpreter is off)."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"
    return "cpu"

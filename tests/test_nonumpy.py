"""Without numpy, torch's import warns "Failed to initialize NumPy"; the CLI must not show it. numpy is
made unimportable in a subprocess, as on a machine where it is not installed (it is not a kernelpack dependency)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "data" / "tiny-cpu.kpack"
NO_NUMPY = "import sys; sys.modules['numpy'] = None\n"  # `import numpy` now raises ImportError
WARNING = "Failed to initialize NumPy"


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", NO_NUMPY + code, *args], capture_output=True, text=True, check=False)


def test_cli_hides_torchs_numpy_warning(tmp_path: Path) -> None:
    bare = _run("import torch")
    assert bare.returncode == 0 and WARNING in bare.stderr, bare.stderr  # torch does warn here: the case is real
    # install imports torch in this process (it probes the build key), after the CLI set its warning filters
    r = _run(
        "from kernelpack.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "assert 'torch' in sys.modules and sys.modules['numpy'] is None\n"
        "sys.exit(status)\n",
        "install",
        str(FIXTURE),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--allow-mismatch",
    )
    assert r.returncode == 0, r.stderr
    assert "installed " in r.stdout
    assert WARNING not in r.stderr and "NumPy" not in r.stderr, r.stderr

"""``lazytrain ARGS`` run through its entry point in this process, for the refusals and plans that need no fresh
interpreter: each test file keeps its console-script runs as processes for the exit statuses themselves, and the
rest skip the ~5 s of imports a process pays."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from pathlib import Path
from unittest import mock

from lightning_lazytrain.sft.cli import main


def lazytrain_in_process(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """What ``subprocess.run(["lazytrain", *args], cwd=cwd, env=os.environ | env)`` would return: main's exit
    status (its return value or its SystemExit's), stdout and stderr; the environment and the working directory
    are restored afterwards (main sets PYTORCH_CUDA_ALLOC_CONF)."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    with mock.patch.dict(os.environ, env or {}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        os.chdir(cwd)
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code
        finally:
            os.chdir(here)
    return subprocess.CompletedProcess(["lazytrain", *args], code, out.getvalue(), err.getvalue())

"""Nothing lost: one run owns its dump folder.

    python -m pytest -q -m integration tests/integration/test_run_safety.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.helpers import DEBUG_CONFIG, REPO, assert_user_error
from torchmoe.launch import run_train

pytestmark = pytest.mark.integration

TINY = ["--config", DEBUG_CONFIG, "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "1", "--checkpoint.enable", "true"]

# A process that holds a dump folder the way a run does, until killed.
_HOLDER = """
import sys, time
from pathlib import Path
from torchmoe.components.run_lock import lock_dump_folder
lock = lock_dump_folder(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process holding `tmp_path / "run"` (killed with -9 at the end, like a lost job)."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path / "run")], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "locked"
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_second_run_on_a_held_dump_folder_is_refused(holder, tmp_path, nproc):
    proc = run_train(TINY, dump_folder=tmp_path / "run", nproc=nproc, timeout=120, expect=None)
    assert f"pid {holder.pid} on " in proc.stderr and "in use by another run" in proc.stderr
    assert not (tmp_path / "run" / "checkpoint").exists()  # refused before writing anything
    if nproc == 1:
        assert_user_error(proc, 'job.dump_folder = "', "fix: wait for it to end")
    else:  # every rank learns it from rank 0 and exits 2 (torchrun itself then exits 1)
        assert proc.stderr.count("exitcode  : 2") == 2, proc.stderr[-3000:]


def test_a_killed_holder_leaves_no_stuck_lock(holder, tmp_path):
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    run_train(TINY, dump_folder=tmp_path / "run", timeout=120)  # the kernel dropped the lock
    assert (tmp_path / "run" / "checkpoint" / "step-1" / ".complete").is_file()


def test_another_flavor_on_a_runs_checkpoints_names_the_flavor(tmp_path):
    """The run's checkpoints are valid: the message points at the flavor, never at deleting them."""
    run_train(TINY, dump_folder=tmp_path, timeout=120)
    proc = run_train([*TINY, "--model.flavor", "bench256", "--training.steps", "2"], dump_folder=tmp_path,
                     timeout=120, expect=None)
    # README promises the flavor that fits: the flavor the checkpoints' shapes are of.
    assert_user_error(proc, 'model.flavor = "bench256": does not match the run\'s checkpoints: this model\'s '
                      "tok_embeddings.weight is (2048, 256), the checkpoint holds it as (512, 128)\n"
                      "  fix: pass --model.flavor tiny; or give this run its own job.dump_folder\n")
    assert "delete" not in proc.stderr
    assert (tmp_path / "checkpoint" / "step-1" / ".complete").is_file()

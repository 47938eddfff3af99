"""Subprocesses opsd starts end with it (opsd.procs): signals forwarded, the child waited for, its exit
status passed on, nothing left behind. `opsd serve` is driven here with a stand-in for vLLM's API
server (``--python``), which starts a child of its own as vLLM starts its engine core;
tests/rollout/test_vllm_serve.py does the same with the real one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from process_tree import gone, wait_for_file

from opsd.procs import exit_status, run_owned

# A stand-in for `python -m vllm.entrypoints.openai.api_server ...`: starts a grandchild (vLLM's engine
# core), writes both pids, and on SIGTERM or SIGINT writes the signal's name and exits with status 3.
SERVER = """\
import os, signal, subprocess, sys, time
out = os.environ["STAND_IN_DIR"]
core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def stop(signum, frame):
    open(os.path.join(out, "signal"), "w").write(signal.Signals(signum).name)
    core.terminate()
    core.wait()
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
open(os.path.join(out, "pids.tmp"), "w").write(f"{os.getpid()} {core.pid}")
os.replace(os.path.join(out, "pids.tmp"), os.path.join(out, "pids"))
time.sleep(600)
"""


@pytest.fixture
def stand_in(tmp_path):
    """A fake interpreter for `opsd serve --python`: whatever arguments, it runs SERVER."""
    script = tmp_path / "python-stand-in"
    script.write_text(f"#!{sys.executable}\n{SERVER}")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_opsd_serve_forwards_the_signal_waits_and_exits_with_the_servers_status(
    sig, tmp_path, stand_in, tiny_model, tiny_tokenizer
):
    model = tmp_path / "model"
    tiny_model.save_pretrained(model)
    tiny_tokenizer.save_pretrained(model)
    env = dict(os.environ, STAND_IN_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "opsd", "serve", str(model), "--python", str(stand_in), "--dtype", "float32"]
    serve = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        server, core = map(int, wait_for_file(tmp_path / "pids", serve).split())
        assert os.getpgid(server) != os.getpgid(serve.pid)  # its own group: a terminal's ^C reaches it once
        serve.send_signal(sig)
        _, err = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    assert (tmp_path / "signal").read_text() == sig.name, err
    assert serve.returncode == 3, err  # the server's own status
    assert gone(server, core)


def test_what_a_child_leaves_in_its_group_is_swept(tmp_path):
    """A child that exits without ending its own child (an engine core its parent did not reap):
    nothing of it outlives run_owned."""
    code = (
        "import subprocess, sys; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid)); sys.exit(5)"
    )
    done = run_owned([sys.executable, "-c", code])
    assert done.status == 5 and not done.timed_out
    assert gone(int((tmp_path / "pid").read_text()))


def test_a_child_past_its_timeout_is_ended_and_its_output_kept():
    done = run_owned(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(600)"],
        timeout_s=2,
        capture=True,
    )
    assert done.timed_out and done.stdout == "started\n"
    assert done.status == 128 + signal.SIGTERM


def test_exit_status_is_a_shells():
    assert [exit_status(c) for c in (0, 3, -signal.SIGTERM, -signal.SIGKILL)] == [0, 3, 143, 137]

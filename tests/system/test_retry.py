"""Retries: real child processes that crash, get killed, or fail finally."""

import signal
import subprocess
import sys
import textwrap

import pytest

from jaxckpt import ConfigError
from jaxckpt.retry import RetryPolicy, run_command, run_with_retries

CHILD = textwrap.dedent("""
    import os, signal, sys
    attempt = int(os.environ["JAXCKPT_RETRY_ATTEMPT"])
    with open(sys.argv[1], "a") as log:
        log.write(f"{attempt}\\n")
    plan = sys.argv[2].split(",")          # what each attempt does
    action = plan[min(attempt, len(plan) - 1)]
    if action == "ok":
        sys.exit(0)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(int(action))
""")

FAST = dict(backoff_s=0.0, max_backoff_s=0.0)


def run_child(tmp_path, plan, retries):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = tmp_path / "attempts.log"
    code = run_command([sys.executable, str(script), str(log), plan],
                       RetryPolicy(retries=retries, **FAST))
    attempts = [int(x) for x in log.read_text().split()] if log.exists() else []
    return code, attempts


def test_crash_then_kill_then_success_is_retried(tmp_path):
    assert run_child(tmp_path, "1,kill,ok", retries=3) == (0, [0, 1, 2])


def test_retries_are_bounded_and_last_status_returned(tmp_path):
    assert run_child(tmp_path, "1,1,1,1,ok", retries=2) == (1, [0, 1, 2])


def test_sigkill_status_uses_shell_convention(tmp_path):
    assert run_child(tmp_path, "kill", retries=0) == (128 + signal.SIGKILL, [0])


@pytest.mark.parametrize("plan", ["term,ok", "143,ok"])
def test_a_child_ended_by_sigterm_is_a_stop_on_request_not_retried(tmp_path, plan):
    # A scheduler or node agent stopping the job, or a manager ending the process after its
    # preemption checkpoint (on_preemption="exit"): restarting it would defeat the stop.
    assert run_child(tmp_path, plan, retries=3) == (128 + signal.SIGTERM, [0])


@pytest.mark.parametrize("final", ["2", "78", "130"])
def test_final_exit_codes_are_not_retried(tmp_path, final):
    assert run_child(tmp_path, f"{final},ok", retries=5) == (int(final), [0])


def test_backoff_doubles_up_to_the_cap():
    policy = RetryPolicy(retries=9, backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay(i) for i in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_cli_run_passes_the_command_through(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = tmp_path / "attempts.log"
    out = subprocess.run([sys.executable, "-m", "jaxckpt.tools.cli", "run", "--retries", "2",
                          "--backoff", "0", "--", sys.executable, str(script), str(log), "1,ok"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert log.read_text().split() == ["0", "1"]


def test_in_process_retries_resume_and_stop_on_final_errors():
    calls = []

    def flaky(attempt):
        calls.append(attempt)
        if attempt < 2:
            raise OSError("node lost")
        return "done"

    assert run_with_retries(flaky, RetryPolicy(retries=3, **FAST)) == "done"
    assert calls == [0, 1, 2]

    def misconfigured(attempt):
        calls.append(("bad", attempt))
        raise ConfigError("Every.steps must be positive")

    with pytest.raises(ConfigError):
        run_with_retries(misconfigured, RetryPolicy(retries=3, **FAST))
    assert calls[-1] == ("bad", 0)

    with pytest.raises(OSError):
        run_with_retries(lambda a: (_ for _ in ()).throw(OSError("x")),
                         RetryPolicy(retries=1, **FAST))


def test_bad_policy_names_the_field():
    with pytest.raises(ConfigError, match="RetryPolicy.retries"):
        RetryPolicy(retries=-1)
    with pytest.raises(ConfigError, match="needs a command"):
        run_command([])

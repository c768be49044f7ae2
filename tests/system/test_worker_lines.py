"""The workers' stdout protocol survives native code writing to descriptor 1 mid-line.

gloo prints its "[Gloo] Rank ... is connected ..." lines in several writes from C++; when a
worker's ``DONE`` landed between two of them the harness read "[Gloo] Rank DONE" and failed a
kill trial that had passed (CI after session 10). Here a real subprocess writes half a line
to descriptor 1 through libc, emits its protocol lines, then finishes the half line.
"""

from __future__ import annotations

import sys
import textwrap

from support.harness import Worker, repo_env, run_all
from support.paths import REPO

SCRIPT = textwrap.dedent("""\
    import ctypes, sys
    sys.path.insert(0, {support!r})
    from worker_lines import claim_stdout, emit
    {claim}
    libc = ctypes.CDLL(None)
    libc.write(1, b"[native] half ", 14)
    emit("STEP 1")
    print("RESULT 2", flush=True)
    libc.write(1, b"a line\\n", 7)
    emit("DONE")
""")


def run_script(tmp_path, claim: bool) -> tuple[list[str], str]:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT.format(support=str(REPO / "tests" / "support"),
                                    claim="claim_stdout()" if claim else "pass"))
    worker = Worker([sys.executable, str(script)], env=repo_env(), timeout_s=60)
    codes, _ = run_all([worker])
    assert codes == [0], worker.stderr()
    return worker.lines, worker.stderr()


def test_native_writes_to_stdout_cannot_split_a_protocol_line(tmp_path):
    lines, stderr = run_script(tmp_path, claim=True)
    assert lines == ["STEP 1", "RESULT 2", "DONE"]
    assert "[native] half a line" in stderr


def test_without_the_claim_the_same_script_splits_a_line(tmp_path):
    # The failure the claim prevents, reproduced: proves the test above can fail.
    lines, _ = run_script(tmp_path, claim=False)
    assert "STEP 1" not in lines and "[native] half STEP 1" in lines

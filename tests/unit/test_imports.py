"""The pure layer must not drag in jax, orbax or torch: checked in fresh interpreters."""

import json
import subprocess
import sys

import pytest

HEAVY = ("jax", "jaxlib", "orbax", "torch", "flax", "optax", "tensorstore")


def imported_after(statement: str) -> list[str]:
    code = (f"import sys, json\n{statement}\n"
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}}"
            f" & set({list(HEAVY)!r}))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    [
        "import jaxckpt",
        "import jaxckpt.core.policy, jaxckpt.commit.store, jaxckpt.manager.driver_state, "
        "jaxckpt.manager.manager, jaxckpt.core.codec",
        "import jaxckpt.core.layout, jaxckpt.core.manifest, jaxckpt.storage.base, "
        "jaxckpt.storage.posix, jaxckpt.commit.ownership, jaxckpt.commit.deferred_checks",
        "import jaxckpt.core.tree_record, jaxckpt.manager.save, jaxckpt.manager.restore, "
        "jaxckpt.manager.background",
        "import jaxckpt.config, jaxckpt.backends.base, jaxckpt.errors, jaxckpt.retry, "
        "jaxckpt.compat",
        "from jaxckpt import CheckpointManager, RecoverConfig, Every, StepInfo",
        "from jaxckpt import import_orbax; import jaxckpt.backends.orbax.import_orbax",
    ],
)
def test_pure_layer_imports_no_framework(statement):
    assert imported_after(statement) == []


def test_cli_module_imports_no_framework():
    assert imported_after("import jaxckpt.tools.cli") == []

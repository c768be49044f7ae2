"""``python -m jaxckpt.tools.gpu_check``: see the package docstring.

The guard matters: DCP's checkpoint process (DcpBackend's default with CUDA) starts by
importing the main module again.

Must not import at module level: jax, orbax, torch.
"""

from __future__ import annotations

import sys

from .runner import main

if __name__ == "__main__":
    sys.exit(main())

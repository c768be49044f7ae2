"""jaxckpt.tools: the command-line layer on top of both packages.

Owns: the ``jaxckpt`` command (``cli``), the runnable demo and its training worker
(``demo``), the benchmark (``bench``) and the Hugging Face export/import commands
(``hf_cli``). Tools may import jaxckpt and torch_bridge, through their public names only.

Edges point inward: no library module (jaxckpt outside this subpackage, torch_bridge) ever
imports jaxckpt.tools. Importing this package imports nothing else.
"""

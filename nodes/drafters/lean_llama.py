"""Moved to `nodes.backends.lean_llama` (issue 44: the lean forward is a backend).

Kept only for `nodes/backends/quant_forward.py`'s lazy import until that line names the new
module; nothing else imports this path.
"""

from nodes.backends.lean_llama import *  # noqa: F401,F403
from nodes.backends.lean_llama import lean_supported  # noqa: F401

"""On a test server's PYTHONPATH (``tests/scripts/amx_mla.py``'s ``SERVER_ENV``): every process of that server
honours ``--attention-backend AMX_MLA`` on a CPU without AMX tiles."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import amx_mla  # noqa: E402

sys.path.pop(0)
amx_mla.install()

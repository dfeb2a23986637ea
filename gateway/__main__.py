"""``python -m gateway`` is ``llm-gateway``."""

import sys

from gateway.cli import main

sys.exit(main())

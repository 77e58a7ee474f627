"""Entry point of ``python -m relax_agent.models`` (see :func:`relax_agent.models.cli.main`)."""

import sys

from relax_agent.models.cli import main

if __name__ == "__main__":
    sys.exit(main())

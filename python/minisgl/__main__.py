"""`python -m minisgl`: the OpenAI-compatible server, or `--shell` for an interactive chat."""

import sys

from minisgl.server.launch import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m kvcal`: the kvcal command line (the same as the `kvcal` script)."""

from kvcal.cli import main

main()

"""`python -m scaling.endpoint`: see scaling.endpoint.cli."""

from scaling.endpoint.cli import main

main()

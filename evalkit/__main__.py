"""`python -m evalkit`: the command line (evalkit.cli.main)."""

from evalkit.cli.main import main

if __name__ == "__main__":
    main()

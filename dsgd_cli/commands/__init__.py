"""One module per `dsgd` command; cli.py puts them together."""

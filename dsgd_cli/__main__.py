from dsgd_cli.cli import main

main()

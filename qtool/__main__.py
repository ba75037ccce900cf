from qtool.cli.main import main

main()

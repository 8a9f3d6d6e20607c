from dsv4_cli.main import main

main()

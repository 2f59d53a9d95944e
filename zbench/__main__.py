from zbench.cli import main

main()

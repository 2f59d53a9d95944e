from zbench.cli import main

if __name__ == "__main__":  # not when a spawned worker imports this module (``zbench tune`` traces in several)
    main()

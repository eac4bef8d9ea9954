from spmdlm.cli.evaluate import main

if __name__ == "__main__":
    raise SystemExit(main())

from spmdlm.cli.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())

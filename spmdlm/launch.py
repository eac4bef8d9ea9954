"""`python -m spmdlm.launch`: the launcher's command line, spmdlm/cli/launch.py."""

from spmdlm import host

if __name__ == "__main__":  # before JAX loads (~3 s): the allocator is chosen when the process starts
    host.restart_with_huge_page_malloc()

from spmdlm.cli.launch import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())

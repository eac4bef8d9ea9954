from spmdlm.cli.export import main

raise SystemExit(main())

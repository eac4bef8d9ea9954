from spmdlm.cli.generate import main

raise SystemExit(main())

from datapipe.cli import main

raise SystemExit(main())

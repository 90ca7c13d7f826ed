from superneurons.cli import main

raise SystemExit(main())

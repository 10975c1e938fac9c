"""Command-line programs; scripts/*.py and the console entry points call their main()."""

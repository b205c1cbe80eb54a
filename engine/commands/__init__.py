"""Subcommands of `omniflow` beyond the workflow ones; see `engine.cli.COMMAND_MODULES`."""

"""Python ops of the example workflows (a package, so the workflow glob does not take it for one)."""
